"""Sampled against greedy iteration time, speculative (fixed and adaptive depth) and plain, in one process.

python bench/sampling_bench.py --out sampling.json [--shapes demo llama-3.1-8b]
    [--batch-sizes 1 8 32] [--output-len 96] [--input-len 128] [--repeats 3]

For each shape it builds three engines, which take turns run by run: speculative at a fixed depth (EAGLE-3 chain of 3, CUDA graphs,
overlap; --speculative-adaptive off), speculative with adaptive depth (the default), and plain. It times
engine steps once every request of the batch has its first token ("iteration_ms",
tandem.bench.measure.run_batch) for four kinds of request: greedy, temperature 1.0, temperature 1.0
with top-p 0.9, and temperature 1.0 with a repetition penalty and 5 logprobs (every sampling stage), each
the median of --repeats runs. Sampled / greedy iteration ratios are taken at the fixed
depth (the same work per step); tokens per second against plain for both speculative engines. "demo" is
the bundled pair with its real acceptance; "llama-3.1-8b" is random weights in that shape (bf16), whose
acceptance is about 1, so it measures the per-iteration cost of sampling, not speculation's gains.
"""

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.demo_batches import chain3_engine_kwargs  # noqa: E402
from tandem.bench.measure import median_of_runs, random_prompts, run_batch  # noqa: E402
from tandem.bench.presets import write_preset  # noqa: E402
from tandem.demo import demo_model_paths  # noqa: E402

MODES = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0), "t1_top_p0.9": dict(temperature=1.0, top_p=0.9),
         # Every stage on (the GENERAL graph): a repetition penalty and 5 logprobs per token.
         "t1_penalty_logprobs": dict(temperature=1.0, repetition_penalty=1.1, logprobs=5)}


def engine_kwargs(shape: str, root: str, max_bs: int, context: int) -> dict:
    if shape == "demo":
        return chain3_engine_kwargs(*demo_model_paths(), max_bs, context)
    return dict(chain3_engine_kwargs(*write_preset(shape, root), max_bs, context), load_format="dummy")


def measure(kw: dict, sizes, input_len: int, output_len: int, repeats: int) -> dict[str, dict]:
    """Every engine (fixed, adaptive, plain) at every batch size and sampling mode. The engines live side
    by side and take turns run by run: measured one engine after another, a slow stretch of the host
    (the demo pair's steps are host-bound: plain decoding's batch-32 step ran 0.51 ms in one run and
    1.06 ms in the next) landed on one engine alone, and adaptive's whole batch-32 set once ran at 2x
    fixed depth's step time, shape for shape."""
    configs = {"fixed": dict(kw, speculative_adaptive=False), "adaptive": dict(kw, speculative_adaptive=True),
               "plain": dict(kw, speculative_algorithm=None, speculative_draft_model_path=None)}
    engines = {}
    try:
        for mode, config in configs.items():
            engines[mode] = Engine(**config)
        vocab = engines["plain"].arch.vocab_size
        rows = {mode: {} for mode in engines}
        for b in sizes:
            prompts = random_prompts(b, input_len, vocab, seed=0)
            for sampling, params in MODES.items():
                runs = {mode: [] for mode in engines}
                for engine in engines.values():
                    run_batch(engine, prompts, 8, **params)  # warm-up at this shape
                for _ in range(repeats):
                    for mode, engine in engines.items():
                        runs[mode].append(run_batch(engine, prompts, output_len, **params)[0])
                for mode in engines:
                    rows[mode][f"{sampling}@{b}"] = row = median_of_runs(runs[mode])
                    print(f"  {mode} batch {b} {sampling}: {row['iteration_ms']:.3f} ms/iteration "
                          f"(median of {repeats}), tau {row['mean_accept_length']}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["demo", "llama-3.1-8b"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the median is reported")
    ns = ap.parse_args()
    result = {"tool": "bench/sampling_bench.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": report.revision(),
              "command": ["python", *sys.argv], "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "modes": MODES, "shapes": {}}
    with tempfile.TemporaryDirectory() as root:
        for shape in ns.shapes:
            kw = engine_kwargs(shape, root, max(ns.batch_sizes), ns.input_len + ns.output_len + 16)
            runs = measure(kw, ns.batch_sizes, ns.input_len, ns.output_len, ns.repeats)
            fixed, adaptive, plain = runs["fixed"], runs["adaptive"], runs["plain"]
            table = []
            for b in ns.batch_sizes:
                g_fixed, g_plain = fixed[f"greedy@{b}"]["iteration_ms"], plain[f"greedy@{b}"]["iteration_ms"]
                for mode in MODES:
                    f, a, p = fixed[f"{mode}@{b}"], adaptive[f"{mode}@{b}"], plain[f"{mode}@{b}"]
                    table.append({"batch": b, "mode": mode, "spec_iteration_ms": f["iteration_ms"],
                                  "spec_vs_greedy_spec": round(f["iteration_ms"] / g_fixed, 4),
                                  "plain_step_ms": p["iteration_ms"],
                                  "plain_vs_greedy_plain": round(p["iteration_ms"] / g_plain, 4),
                                  "spec_tau": f["mean_accept_length"], "adaptive_tau": a["mean_accept_length"],
                                  "fixed_tokens_per_s_vs_plain": round(f["tokens_per_s"] / p["tokens_per_s"], 4),
                                  "adaptive_tokens_per_s_vs_plain": round(a["tokens_per_s"] / p["tokens_per_s"], 4)})
            result["shapes"][shape] = {"table": table, **runs}
            print(f"\n{shape}: batch mode | fixed spec ms (x greedy) | plain ms (x greedy) | tau fixed/adaptive "
                  f"| tok/s vs plain: fixed, adaptive")
            for r in table:
                print(f"  {r['batch']:>3} {r['mode']:<12} | {r['spec_iteration_ms']:.3f} ({r['spec_vs_greedy_spec']:.3f}x) "
                      f"| {r['plain_step_ms']:.3f} ({r['plain_vs_greedy_plain']:.3f}x) | {r['spec_tau']}/{r['adaptive_tau']} "
                      f"| {r['fixed_tokens_per_s_vs_plain']:.3f}, {r['adaptive_tokens_per_s_vs_plain']:.3f}", flush=True)
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    report.write_json(result, ns.out)


if __name__ == "__main__":
    main()
