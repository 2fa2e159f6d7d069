"""GPU time of one sampling call at the 8B shape's vocabulary (128,256), replayed from a CUDA graph as the
decode iteration replays it: greedy argmax against the sampling kernel (temperature 1; top-p 0.9; min-p;
top-k 50, which adds a sort) at several warp counts and numbers of parallel pivot rounds (0: each row
settles alone), for flat logits (random-weight models) and peaked
ones (trained models), and the torch reference (noise written out, a sort) for scale. Every variant's
tokens are checked against the reference's.

python bench/sampling_kernel_bench.py --out kernel.json
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem.bench import report  # noqa: E402
from tandem.layers import sampling_kernels  # noqa: E402
from tandem.layers.sampler import (  # noqa: E402
    GREEDY,
    SAMPLED,
    SAMPLED_TOP_K,
    SamplingMetadata,
    choose_tokens,
    sample_reference,
)
from tandem.request import SamplingParams  # noqa: E402

VOCAB = 128_256
MODES = {
    "greedy": (SamplingParams(temperature=0.0), GREEDY),
    "t1": (SamplingParams(temperature=1.0), SAMPLED),
    "t1_top_p0.9": (SamplingParams(temperature=1.0, top_p=0.9), SAMPLED),
    "t1_min_p0.05": (SamplingParams(temperature=1.0, min_p=0.05), SAMPLED),
    "t1_top_k50": (SamplingParams(temperature=1.0, top_k=50), SAMPLED_TOP_K),
}


def graph_time_us(fn, replays: int = 200) -> float:
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[16])
    ap.add_argument("--pivot-rounds", type=int, nargs="+", default=[0, 2, 3])
    ns = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    default_warps, default_rounds = sampling_kernels.NUM_WARPS, sampling_kernels.PIVOT_ROUNDS
    max_rows = sampling_kernels.PIVOT_ROUNDS_MAX_ROWS
    results = []
    for scale, kind in ((0.3, "flat"), (4.0, "peaked")):
        for rows in ns.rows:
            logits = (torch.randn(rows, VOCAB, generator=gen) * scale).cuda()
            for mode, (params, features) in MODES.items():
                meta = SamplingMetadata.from_params([params] * rows, list(range(rows)), device="cuda",
                                                    seeds=list(range(rows)))
                want = sample_reference(logits, meta)
                variants = [(w, r) for w in ns.warps for r in ns.pivot_rounds] if features.sampled else [(0, 0)]
                for warps, rounds in variants:
                    sampling_kernels.NUM_WARPS = warps or default_warps  # both read at each call
                    sampling_kernels.PIVOT_ROUNDS = rounds
                    sampling_kernels.PIVOT_ROUNDS_MAX_ROWS = 1 << 30  # every batch takes `rounds` here
                    if not torch.equal(choose_tokens(logits, meta, features), want):
                        raise SystemExit(f"{kind} rows {rows} {mode} warps {warps} rounds {rounds}: not the reference")
                    us = graph_time_us(lambda: choose_tokens(logits, meta, features))
                    results.append(dict(logits=kind, rows=rows, mode=mode, warps=warps, pivot_rounds=rounds,
                                        us=round(us, 2)))
                    print(f"{kind:>6} rows {rows:>3} {mode:<13} warps {warps:>2} rounds {rounds}: {us:8.1f} us",
                          flush=True)
                if features.sampled:
                    us = graph_time_us(lambda: sample_reference(logits, meta))
                    results.append(dict(logits=kind, rows=rows, mode=mode, warps="torch reference", us=round(us, 2)))
                    print(f"{kind:>6} rows {rows:>3} {mode:<13} torch reference: {us:8.1f} us", flush=True)
    sampling_kernels.NUM_WARPS, sampling_kernels.PIVOT_ROUNDS = default_warps, default_rounds
    sampling_kernels.PIVOT_ROUNDS_MAX_ROWS = max_rows
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    report.write_json({"tool": "bench/sampling_kernel_bench.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": ["python", *sys.argv], "device": torch.cuda.get_device_name(0),
                       "vocab": VOCAB, "results": results}, ns.out)


if __name__ == "__main__":
    main()
