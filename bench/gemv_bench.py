"""Can a Triton GEMV beat cuBLAS on the decode step's matmuls at 1-8 rows? The projections of the
Llama-3.1-8B and Llama-3.2-1B shapes, bf16, each timed inside a CUDA graph (no launch cost), against
torch's `F.linear` (cuBLAS, with the split-K reductions it picks at few rows). Prints microseconds and
the weight-read bandwidth of each, and checks the Triton result against torch's.

python bench/gemv_bench.py --out gemv.json [--rows 1 4 8]

The kernel: one program per block of output columns walks the whole K dimension (no split-K, so no
reduction kernel), the rows of x held in registers; autotuned over tile shapes per (N, K).
"""

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem.bench import report  # noqa: E402

SHAPES = {  # name: (N, K) of W in y = x @ W.T
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "8b.lm_head": (128256, 4096),
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192),
    "1b.lm_head": (128256, 2048),
}
CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=3)
           for n in (8, 16, 32) for k in (128, 256, 512) for w in (4, 8)]


def _fits_registers(configs, named_args, **kwargs):
    """Drop tiles whose (rows, N, K) product would spill: at most 64 fp32 values a thread."""
    rows = triton.next_power_of_2(named_args["M"])
    keep = [c for c in configs
            if rows * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 64 * 32 * c.num_warps]
    return keep or configs[:1]


@triton.autotune(configs=CONFIGS, key=["N", "K", "M"], prune_configs_by={"early_config_prune": _fits_registers})
@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=(offs_m[:, None] < M) & k_mask[None, :],
                    other=0.0)
        # (BLOCK_M, 1, BLOCK_K) * (1, BLOCK_N, BLOCK_K) summed over K: a few rows need no tensor cores
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=(offs_m[:, None] < M) & n_mask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                       BLOCK_M=max(1, triton.next_power_of_2(m)))
    return y


def graph_time_us(fn, reps: int = 200) -> float:
    """Median over 5 replays of a CUDA graph holding `reps` calls, per call."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / reps * 1e6)
    return sorted(times)[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    ns = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':12} {'M':>2} {'cuBLAS us':>9} {'triton us':>9} {'ratio':>6} {'cuBLAS TB/s':>11} {'triton TB/s':>11} "
          f"{'max err':>8}  config")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in ns.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x.float(), w.float())
            err = (gemv(x, w).float() - want).abs().max().item()
            ref_err = (torch.nn.functional.linear(x, w).float() - want).abs().max().item()
            t_torch = graph_time_us(lambda: torch.nn.functional.linear(x, w))
            t_triton = graph_time_us(lambda: gemv(x, w))
            gb = n * k * 2 / 1e9
            best = _gemv_kernel.best_config
            r = {"shape": name, "n": n, "k": k, "rows": m, "cublas_us": round(t_torch, 2), "triton_us": round(t_triton, 2),
                 "triton_over_cublas": round(t_triton / t_torch, 3), "cublas_tb_s": round(gb / t_torch * 1e3, 3),
                 "triton_tb_s": round(gb / t_triton * 1e3, 3), "triton_max_abs_err": err, "cublas_max_abs_err": ref_err,
                 "config": str(best)}
            rows.append(r)
            print(f"{name:12} {m:>2} {t_torch:>9.1f} {t_triton:>9.1f} {t_triton / t_torch:>6.2f} "
                  f"{r['cublas_tb_s']:>11.2f} {r['triton_tb_s']:>11.2f} {err:>8.4f}  {best}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "command": "python bench/gemv_bench.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    report.write_json(result, ns.out)
    print(json.dumps({"written": ns.out}))


if __name__ == "__main__":
    main()
