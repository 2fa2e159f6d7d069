"""`tandem bench`: the subcommand's flags. Kept out of tandem/cli.py so that file only registers it;
nothing here imports torch until the command runs."""

from __future__ import annotations

import argparse
import sys

from tandem.bench.presets import PRESETS

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def add_bench_parser(sub) -> None:
    from tandem.engine_flags import add_engine_args

    p = sub.add_parser(
        "bench", help="offline latency/throughput over batch sizes, speculation on vs off",
        description="Offline latency and throughput at each batch size, with speculation on and off side by "
                    "side in one process; writes a JSON record and PNG plots. Weights: --model-path, --preset "
                    "(random weights in a named shape, with a random EAGLE-3 head), or neither (the demo pair).")
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="random weights (load_format=dummy) in a named shape, drafted by a random EAGLE-3 head")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help=f"default {' '.join(map(str, DEFAULT_BATCH_SIZES))} (with --sweep: 1 8 32 64 128)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (random ids)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (EOS ignored)")
    p.add_argument("--spec", choices=["both", "on", "off"], default="both",
                   help="run with speculation, without, or both and report the speedup (default)")
    p.add_argument("--synthetic-acceptance", type=float, default=None, metavar="P",
                   help="BENCHMARK ONLY: accept each draft token with probability P instead of verifying it; "
                        "outputs are then the draft's, not the model's (every output is labelled)")
    p.add_argument("--synthetic-acceptance-profile", default=None, metavar="A1,A2,...",
                   help="BENCHMARK ONLY: as --synthetic-acceptance, with one rate per chain position (position k "
                        "accepted with probability Ak given the ones before it; the last rate repeats), for "
                        "stating a measured head's per-position acceptance on another model's shapes")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run transformers' greedy generate on the same weights and prompts")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for --temperature > 0")
    p.add_argument("--json-schema", default=None, metavar="PATH|builtin",
                   help="constrain every output to a JSON schema (a file, or 'builtin': a list of records); "
                        "outputs then end with their document, at most --output-len tokens")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/bench-<name>-<commit>.json); "
                                               "plots go beside it")
    p.add_argument("--trace", action="store_true",
                   help="keep each speculative run's per-step trace in the JSON (wall ms, the depth whose results "
                        "the step took, catch-ups launched); left out by default, it is most of a record's size")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs per engine")
    p.add_argument("--sweep", action="store_true",
                   help="BENCHMARK ONLY: plain, fixed-depth and adaptive speculation over a grid of synthetic "
                        "acceptance x batch size x temperature; JSON and heatmaps (outputs are the draft's)")
    p.add_argument("--sweep-acceptance", type=float, nargs="+", default=None, metavar="P",
                   help="the grid's acceptance rates (default 0 0.3 0.6 0.81 0.95)")
    p.add_argument("--sweep-temperatures", type=float, nargs="+", default=None, metavar="T",
                   help="the grid's temperatures (default 0 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per batch size and mode (same prompts); each reported metric is the "
                        "median, every run is kept in the JSON (time to first token is one noisy sample per run). "
                        "multi-turn / no-reuse: runs of every engine, cache on and off taking turns at going first")
    p.add_argument("--sequential", action="store_true",
                   help="one engine at a time (for a model that fits only once); by default the engines of "
                        "speculation on and off are held together and their runs take turns")
    p.add_argument("--turns", choices=["step", "run"], default=None,
                   help="how the engines held together take turns: step by step, each timed on its own calls "
                        "(the default on a CPU: a slow stretch of the machine lands on both alike), or run by run "
                        "(the default on a GPU, where a step returns before its device work is done)")
    p.add_argument("--workload", choices=["batch", "multi-turn", "no-reuse"], default="batch",
                   help="batch: batches of random prompts (default); multi-turn: conversations sharing a system "
                        "prompt, each turn resending its history, prefix cache on and off (bench/multi_turn.py); "
                        "no-reuse: the same lengths with nothing shared")
    p.add_argument("--conversations", type=int, default=32, help="multi-turn: conversations side by side")
    p.add_argument("--conversation-turns", type=int, default=6, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=1024, help="multi-turn: tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, default=128, help="multi-turn: tokens of each user message")
    p.add_argument("--answer-len", type=int, default=128, help="multi-turn: tokens of each answer")
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(ns: argparse.Namespace) -> int:
    from tandem.bench import report
    from tandem.bench.run import BenchConfig, run_bench
    from tandem.engine_flags import engine_kwargs

    if ns.sweep:
        return _cmd_sweep(ns)
    if ns.workload != "batch":
        from tandem.bench.multi_turn import main_from_namespace

        return main_from_namespace(ns)
    ns.batch_sizes = ns.batch_sizes or list(DEFAULT_BATCH_SIZES)
    cfg = BenchConfig(
        engine_kwargs=engine_kwargs(ns), preset=ns.preset, batch_sizes=tuple(ns.batch_sizes),
        input_len=ns.input_len, output_len=ns.output_len, spec=ns.spec,
        synthetic_acceptance=synthetic_rate(ns), compare_hf=ns.compare_hf, temperature=ns.temperature,
        top_p=ns.top_p, json_schema=_json_schema(ns.json_schema),
        out=ns.out, plots=not ns.no_plots, progress=not ns.no_progress, warmup=not ns.no_warmup,
        repeats=ns.repeats, interleave=not ns.sequential, turns=ns.turns, trace=ns.trace,
        command=["tandem", *sys.argv[1:]],
    )
    result = run_bench(cfg)
    print(report.table(result))
    print(f"wrote {result['json']}" + "".join(f"\nwrote {p}" for p in result.get("plots", [])))
    return 0


def _json_schema(arg: str | None) -> dict | None:
    if arg is None:
        return None
    if arg == "builtin":
        from tandem.bench.json_schemas import BENCH_SCHEMA
        return BENCH_SCHEMA
    import json
    with open(arg) as f:
        return json.load(f)


def _cmd_sweep(ns: argparse.Namespace) -> int:
    from tandem.bench import sweep
    from tandem.engine_flags import engine_kwargs

    cfg = sweep.SweepConfig(
        engine_kwargs=engine_kwargs(ns),
        acceptance=tuple(ns.sweep_acceptance or sweep.SWEEP_ACCEPTANCE),
        batch_sizes=tuple(ns.batch_sizes or sweep.SWEEP_BATCH_SIZES),
        temperatures=tuple(ns.sweep_temperatures if ns.sweep_temperatures is not None else sweep.SWEEP_TEMPERATURES),
        input_len=ns.input_len, output_len=ns.output_len, repeats=ns.repeats, out=ns.out, plots=not ns.no_plots,
        progress=not ns.no_progress, command=["tandem", *sys.argv[1:]], trace=ns.trace)
    result = sweep.sweep_with_preset(cfg, ns.preset)
    print(f"{'T':>4} {'p':>5} {'batch':>5} {'fixed/plain':>11} {'adaptive/plain':>14} {'adaptive/best':>13}")
    for pt in result["points"]:
        print(f"{pt['temperature']:>4g} {pt['acceptance']:>5g} {pt['batch_size']:>5} {pt['fixed_speedup']:>11.3f} "
              f"{pt['adaptive_speedup']:>14.3f} {pt['adaptive_vs_best']:>13.3f}")
    worst = result["worst"]
    print(f"worst adaptive/plain: {worst['adaptive_vs_plain']}; worst adaptive/best: {worst['adaptive_vs_best']}")
    print(f"wrote {result['json']}" + (f" and {', '.join(result['plots'])}" if result.get("plots") else ""))
    return 0


def synthetic_rate(ns: argparse.Namespace):
    """--synthetic-acceptance P or --synthetic-acceptance-profile A1,A2,... (None when neither)."""
    from tandem.bench import synthetic

    if ns.synthetic_acceptance_profile is None:
        return ns.synthetic_acceptance
    if ns.synthetic_acceptance is not None:
        raise SystemExit("give --synthetic-acceptance or --synthetic-acceptance-profile, not both")
    try:
        return synthetic.parse_profile(ns.synthetic_acceptance_profile)
    except ValueError as e:
        raise SystemExit(str(e)) from None
