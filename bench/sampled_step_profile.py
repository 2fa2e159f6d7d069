"""Why a sampled speculative step can cost more than a greedy one on a tiny model: for each request kind,
one timed run of a batch on the demo pair (fixed chain of 3, CUDA graphs, overlap), with the GPU's busy
time per step (torch.profiler, kernels and copies) against the step's wall time, and the host functions
that took the most time (cProfile). A step whose wall time exceeds its GPU time is host-bound.

python bench/sampled_step_profile.py --batch 32 --out bench/results/sampled_step_profile_h200.json
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from bench.sampling_bench import MODES, engine_kwargs  # noqa: E402
from tandem import Engine  # noqa: E402
from tandem.bench.measure import random_prompts, run_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["greedy", "t1"])
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    kw = dict(engine_kwargs("demo", tempfile.mkdtemp(), ns.batch, 128 + ns.output_len + 8),
              speculative_adaptive="off")
    engine = Engine(**kw)
    prompts = random_prompts(ns.batch, 128, engine.arch.vocab_size, seed=0)
    report = {}
    from torch.profiler import ProfilerActivity, profile

    for mode in ns.modes:
        params = MODES[mode]
        run_batch(engine, prompts, 8, **params)  # warm-up
        plain_run = run_batch(engine, prompts, ns.output_len, **params)[0]
        host = cProfile.Profile()
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            host.enable()
            metrics = run_batch(engine, prompts, ns.output_len, **params)[0]
            host.disable()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        gpu_us = sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA")  # (0 on a CPU)
        steps = metrics.decode_iterations + 1
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(12)
        report[mode] = {"iteration_ms_unprofiled": plain_run.iteration_ms, "iteration_ms_profiled": metrics.iteration_ms,
                        "gpu_ms_per_step": gpu_us / 1e3 / steps, "mean_accept_length": metrics.mean_accept_length,
                        "host_top": text.getvalue().splitlines()[-16:]}
        print(f"{mode}: iteration {plain_run.iteration_ms:.3f} ms (profiled {metrics.iteration_ms:.3f}), GPU busy "
              f"{gpu_us / 1e3 / steps:.3f} ms/step, accept length {metrics.mean_accept_length:.2f}", flush=True)
        print("\n".join(report[mode]["host_top"]), flush=True)
    engine.shutdown()
    with open(ns.out, "w") as f:
        json.dump({"tool": "bench/sampled_step_profile.py",
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "batch": ns.batch, "modes": report}, f, indent=1)


if __name__ == "__main__":
    main()
