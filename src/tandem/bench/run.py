"""`tandem bench`: offline latency and throughput over batch sizes, speculation on and off side by side
in one process (both engines held at once, taking turns step by step on a CPU and run by run on a GPU;
same prompts), optionally against transformers.

Each batch size adds B random prompts of input_len tokens at once and runs them to exactly output_len
tokens each (ignore_eos). Weights are a real checkpoint, the bundled demo pair, or random weights in a
named shape (`--preset`, with a random EAGLE-3 head). Random heads accept almost nothing, so presets
measure the pipeline's cost; `--synthetic-acceptance P` measures what a head accepting with
probability P would gain (its outputs are then not the model's: see tandem/bench/synthetic.py).
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tandem.bench import report, synthetic
from tandem.bench.measure import (BatchRun, median_of_runs, random_prompts, rounded, run_batch, run_in_lockstep,
                                  upper_median)
from tandem.bench.presets import PRESETS, write_preset

MODES = ("spec_on", "spec_off")


@dataclass(frozen=True)
class BenchConfig:
    engine_kwargs: dict  # EngineArgs fields, as the CLI parsed them
    batch_sizes: tuple[int, ...]
    preset: str | None = None
    input_len: int = 256
    output_len: int = 256
    spec: str = "both"  # both | on | off
    synthetic_acceptance: float | tuple[float, ...] | None = None  # one rate, or one per chain position
    compare_hf: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    json_schema: dict | None = None  # constrain every output to this schema (structured output)
    out: str | None = None  # None: bench/results/bench-<name>-<commit>.json
    trace: bool = False  # keep each speculative run's per-step trace in the record
    plots: bool = True
    progress: bool = True
    warmup: bool = True
    repeats: int = 1  # timed runs per batch size and mode; the row holds each metric's median
    interleave: bool = True  # every mode's engine at once, taking turns (False: one engine at a time)
    turns: str | None = None  # how interleaved engines take turns: "step" or "run" (None: step on a CPU, run on a GPU)
    command: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.preset is not None and self.engine_kwargs.get("model_path") is not None:
            raise ValueError("give --preset or --model-path, not both")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1 (got {self.repeats})")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1 (got {list(self.batch_sizes)})")
        if self.input_len < 1 or self.output_len < 2:
            raise ValueError(f"--input-len >= 1 and --output-len >= 2 are required "
                             f"(got {self.input_len}, {self.output_len})")
        if self.spec not in ("both", "on", "off"):
            raise ValueError(f"--spec must be both, on or off (got {self.spec!r})")
        if self.synthetic_acceptance is not None:
            if self.spec == "off":
                raise ValueError("--synthetic-acceptance replaces verification: it needs speculation (--spec on/both)")
            synthetic.check_rate(self.synthetic_acceptance)
        if self.turns not in (None, "step", "run"):
            raise ValueError(f"--turns must be step or run (got {self.turns!r})")
        if self.compare_hf and self.temperature != 0.0:
            raise ValueError("--compare-hf compares greedy outputs: use --temperature 0")

    @property
    def modes(self) -> list[str]:
        return {"both": list(MODES), "on": ["spec_on"], "off": ["spec_off"]}[self.spec]


def resolve_engine_kwargs(cfg: BenchConfig, preset_dir: str) -> dict:
    """The speculative engine's arguments: the preset's or demo pair's paths filled in, and a KV pool
    and batch cap that hold every request of the largest batch at full length (no preemption)."""
    kw = dict(cfg.engine_kwargs)
    if cfg.preset is not None:
        if kw.get("speculative_draft_model_path") or kw.get("speculative_algorithm") not in (None, "EAGLE3"):
            raise ValueError("--preset drafts with its own random EAGLE-3 head: leave --speculative-algorithm "
                             "and --speculative-draft-model-path unset")
        target, head = write_preset(cfg.preset, preset_dir)
        kw.update(model_path=target, load_format="dummy", speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=head)
    elif kw.get("model_path") is None:
        from tandem.demo import demo_model_paths

        target, head = demo_model_paths()
        kw["model_path"] = target
        if kw.get("speculative_draft_model_path") is None and kw.get("speculative_algorithm") in (None, "EAGLE3"):
            kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    if "spec_on" in cfg.modes and kw.get("speculative_algorithm") is None:
        raise ValueError("speculation needs --speculative-algorithm and --speculative-draft-model-path "
                         "(or --preset, or no --model-path for the demo pair); or pass --spec off")
    max_batch = max(cfg.batch_sizes)
    kw["max_running_requests"] = max(kw.get("max_running_requests") or 0, max_batch)
    if kw.get("context_length") is None:
        kw["context_length"] = cfg.input_len + cfg.output_len + 1
    if kw.get("max_total_tokens") is None:
        page = kw.get("page_size") or 16
        # Worst case per request: its tokens plus a lookahead for this step and the ones in flight.
        lookahead = 3 * max(kw.get("speculative_num_draft_tokens") or 0,
                            (kw.get("speculative_num_steps") or 0) * (kw.get("speculative_eagle_topk") or 1))
        pages = -(-(kw["context_length"] + lookahead) // page) + 1
        kw["max_total_tokens"] = max_batch * pages * page
    return kw


def run_bench(cfg: BenchConfig) -> dict:
    """Runs every (mode, batch size) and writes the JSON (and plots); returns the JSON record."""
    import torch
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as preset_dir:
        spec_kw = resolve_engine_kwargs(cfg, preset_dir)
        plain_kw = dict(spec_kw, speculative_algorithm=None, speculative_draft_model_path=None)
        rows = {b: {"batch_size": b} for b in cfg.batch_sizes}
        tokens: dict[tuple[str, int], list[list[int]]] = {}
        n_runs = len(cfg.modes) * len(cfg.batch_sizes) + (len(cfg.batch_sizes) if cfg.compare_hf else 0)
        bar = tqdm(total=n_runs, desc="tandem bench", unit="run", disable=not cfg.progress)
        engines: dict[str, object] = {}
        info = {}
        try:
            # Interleaved (the default): every mode's engine at once, taking turns, so that a slow stretch
            # of the machine lands on all modes alike (on a 2-core CPU, plain decoding's own runs moved
            # 17-30% between one engine's turn and the next). Turns are steps on a CPU (each engine timed
            # on its own calls, measure.run_in_lockstep) and runs on a GPU. Sequential: one engine at a
            # time, for a model that fits only once.
            groups = [list(cfg.modes)] if cfg.interleave else [[mode] for mode in cfg.modes]
            turns = cfg.turns
            for gi, group in enumerate(groups):
                for mode in group:
                    engines[mode] = _bench_engine(cfg, mode, spec_kw, plain_kw)
                    info = info or _run_info(engines[mode])
                turns = turns or ("step" if info["device_type"] == "cpu" else "run")
                if turns == "step" and info["device_type"] != "cpu":
                    raise ValueError("--turns step times each engine's host calls: CPU engines only (a GPU step "
                                     "returns before its device work is done)")
                for b in cfg.batch_sizes:
                    bar.set_postfix_str(f"{' and '.join(m.replace('_', ' ') for m in group)}, batch {b}")
                    prompts = random_prompts(b, cfg.input_len, info["vocab_size"], seed=spec_kw.get("seed") or 0)
                    runs = {mode: [] for mode in group}
                    for _ in range(cfg.repeats):  # the same prompts each time
                        for mode, (metrics, toks) in zip(group, _timed_runs(cfg, engines, group, prompts, turns)):
                            if cfg.json_schema is None:  # documents end where their schema says
                                _check_lengths(toks, cfg.output_len)
                            runs[mode].append(metrics)
                            tokens[(mode, b)] = toks
                    for mode in group:
                        row = median_of_runs(runs[mode])
                        if mode == "spec_off":
                            row.pop("mean_accept_length")
                            row.pop("accept_per_position")
                        elif cfg.synthetic_acceptance is not None:
                            row["label"] = synthetic.LABEL
                        rows[b][mode] = row
                        bar.update()
                if cfg.compare_hf and gi == len(groups) - 1:
                    _compare_hf(cfg, engines.pop(group[-1]), rows, tokens, bar)
                for mode in list(engines):
                    engines.pop(mode).shutdown()
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        finally:
            bar.close()
            for engine in engines.values():
                engine.shutdown()

    for row in rows.values():
        on, off = row.get("spec_on"), row.get("spec_off")
        if on and off:
            row.update(_speedups(on, off, paired=cfg.interleave))
    result = _record(cfg, spec_kw, info, list(rows.values()), turns)
    out = cfg.out or report.default_out(f"bench-{result['model']['name']}")
    result["json"] = out
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    if cfg.plots:
        result["plots"] = report.plot(result, os.path.splitext(out)[0])
    report.write_json(result, out)
    return result


def _speedups(on: dict, off: dict, paired: bool) -> dict:
    """Speculation's speedup in tokens per second and in per-request latency. Runs that took turns
    (`paired`) are compared pair by pair: the median of the runs' own ratios (upper median for an even
    count, as median_of_runs), each pair having met the same stretch of the machine; the ratio of the two
    medians would mix runs from different stretches (on a 2-core CPU one invocation's runs moved 86-119 tokens/s).
    Sequential runs have no pairs: the ratio of the medians."""
    def ratio(a, b):
        return a / b if a and b else None

    if paired and "runs" in on and "runs" in off:
        pairs = list(zip(on["runs"], off["runs"]))
        by_run = [ratio(a["tokens_per_s"], b["tokens_per_s"]) for a, b in pairs]
        out = {"speedup": upper_median(by_run), "speedup_by_run": [round(r, 4) for r in by_run],
               "latency_speedup": upper_median(ratio(b["ms_per_output_token"], a["ms_per_output_token"])
                                               for a, b in pairs)}
    else:
        out = {"speedup": ratio(on["tokens_per_s"], off["tokens_per_s"]),
               "latency_speedup": ratio(off["ms_per_output_token"], on["ms_per_output_token"])}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items() if v is not None}


def _timed_runs(cfg: BenchConfig, engines: dict, group: list[str], prompts, turns: str) -> list:
    """One timed run of `prompts` on each engine of `group`: together, step by step (turns "step"), or one
    after the other."""
    args = (prompts, cfg.output_len, cfg.temperature, cfg.top_p, cfg.json_schema)
    if turns == "step" and len(group) > 1:
        return run_in_lockstep([BatchRun(engines[mode], *args, busy_clock=True, trace=cfg.trace) for mode in group])
    return [run_batch(engines[mode], *args, trace=cfg.trace) for mode in group]


def _bench_engine(cfg: BenchConfig, mode: str, spec_kw: dict, plain_kw: dict):
    """One mode's engine, warmed up: first-call costs (allocator, kernel selection) stay out of the
    numbers; every batch size, because kernels specialise on their shapes (triton compiles separate
    variants when an argument is 1, as a batch of one makes some of them)."""
    from tandem import Engine

    engine = Engine(**(spec_kw if mode == "spec_on" else plain_kw))
    if mode == "spec_on" and cfg.synthetic_acceptance is not None:
        synthetic.install(engine, cfg.synthetic_acceptance, seed=spec_kw.get("seed") or 0)
    if cfg.warmup:
        vocab = engine.arch.vocab_size
        for b in cfg.batch_sizes:
            run_batch(engine, random_prompts(b, cfg.input_len, vocab, seed=10_007), min(cfg.output_len, 8),
                      cfg.temperature, cfg.top_p, cfg.json_schema)
    return engine


def _compare_hf(cfg: BenchConfig, engine, rows: dict, tokens: dict, bar) -> None:
    """transformers' greedy generate on the last engine's weights, per batch size (OOM: recorded)."""
    import torch

    from tandem.bench.hf_compare import build_hf_model, run_hf, token_agreement

    model = build_hf_model(engine, copy_weights=engine.args.load_format == "dummy")
    vocab = engine.arch.vocab_size
    engine.shutdown()  # its weights now live in the transformers model too
    gc.collect()
    if cfg.warmup:
        run_hf(model, random_prompts(1, cfg.input_len, vocab, seed=10_007), 2)
    for b in cfg.batch_sizes:
        bar.set_postfix_str(f"transformers, batch {b}")
        prompts = random_prompts(b, cfg.input_len, vocab, seed=cfg.engine_kwargs.get("seed") or 0)
        try:
            metrics, toks = run_hf(model, prompts, cfg.output_len)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows[b]["hf"] = {"error": "out of memory"}
            bar.update()
            continue
        hf = metrics.as_dict()
        for key in ("mean_accept_length", "accept_per_position"):
            hf.pop(key)
        if ("spec_off", b) in tokens:
            hf["match_spec_off"] = token_agreement(tokens[("spec_off", b)], toks)
        if ("spec_on", b) in tokens and cfg.synthetic_acceptance is None:
            hf["match_spec_on"] = token_agreement(tokens[("spec_on", b)], toks)
        rows[b]["hf"] = hf
        bar.update()
    del model


def _check_lengths(toks: list[list[int]], output_len: int) -> None:
    short = [len(t) for t in toks if len(t) != output_len]
    if short:
        raise RuntimeError(f"requests finished with {short} tokens instead of {output_len} (context too short?)")


def _run_info(engine) -> dict:
    import torch

    device = engine.runner.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"device": name, "dtype": str(engine.runner.dtype).removeprefix("torch."), "torch": torch.__version__,
            "vocab_size": engine.arch.vocab_size, "device_type": device.type}


def _record(cfg: BenchConfig, spec_kw: dict, info: dict, rows: list[dict], turns: str | None) -> dict:
    model_path = spec_kw["model_path"]
    name = cfg.preset or ("demo" if cfg.engine_kwargs.get("model_path") is None
                          else os.path.basename(os.path.normpath(model_path)))
    algorithm = spec_kw.get("speculative_algorithm")
    draft = None
    if algorithm is not None and "spec_on" in cfg.modes:
        draft = {"algorithm": algorithm,
                 "path": None if cfg.preset else spec_kw.get("speculative_draft_model_path"),
                 "num_steps": spec_kw["speculative_num_steps"], "eagle_topk": spec_kw["speculative_eagle_topk"],
                 "num_draft_tokens": spec_kw["speculative_num_draft_tokens"]}
    result = {
        "tool": "tandem bench",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": report.revision(),
        "command": cfg.command or sys.argv,
        **{k: info.get(k) for k in ("device", "dtype", "torch")},
        "model": {"name": name, "preset": cfg.preset, "model_path": None if cfg.preset else model_path,
                  "load_format": spec_kw.get("load_format"), "draft": draft},
        "input_len": cfg.input_len, "output_len": cfg.output_len, "temperature": cfg.temperature,
        "top_p": cfg.top_p, "json_schema": cfg.json_schema,
        "repeats": cfg.repeats,
        "turns": turns if cfg.interleave and len(cfg.modes) > 1 else None,
        "batch_sizes": list(cfg.batch_sizes), "modes": cfg.modes,
        "synthetic_acceptance": None,
        "engine_args": {k: v for k, v in spec_kw.items() if not (cfg.preset and k.endswith("model_path"))},
        "batches": rows,
    }
    if cfg.synthetic_acceptance is not None:
        p = cfg.synthetic_acceptance
        chain = spec_kw["speculative_eagle_topk"] == 1
        result["label"] = synthetic.LABEL
        result["synthetic_acceptance"] = {
            "p": p, "label": synthetic.LABEL,
            # Closed form for chains only; a tree's walk also tries later siblings.
            "expected_mean_accept_length": rounded(synthetic.expected_accept_length(
                p, spec_kw["speculative_num_steps"])) if chain else None,
        }
        # The label first, so it is the first thing a reader of the file sees.
        result = {"label": result.pop("label"), **result}
    return result
