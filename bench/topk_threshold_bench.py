"""The k-th largest scaled logit per row (the top-k cut) three ways, on the GPU: a full sort (the
sampler's way above MAX_SELECTED_TOP_K), torch.topk of the 1,024 largest (a radix select: the sampler's
way up to it), and a 32-step bisection over the float order. Checks they agree bit for bit and times each
(CUDA events, medians).

python bench/topk_threshold_bench.py --out topk.json
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem.bench import report  # noqa: E402

K_MAX = 1024


def by_sort(x, k):
    return x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None]).squeeze(1)


def by_topk(x, k):
    return x.topk(min(K_MAX, x.shape[-1]), dim=-1).values.gather(1, (k - 1)[:, None]).squeeze(1)


def by_bisection(x, k):
    bits = x.view(torch.int32)
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    lo = torch.full_like(k, -(2 ** 31))
    hi = torch.full_like(k, 2 ** 31 - 1)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        ok = (keys >= mid[:, None]).sum(-1) >= k
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    key = lo.to(torch.int32)
    return torch.where(key >= 0, key, key ^ 0x7FFFFFFF).view(torch.float32)


def time_ms(fn, *args, reps=20):
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(*args); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for r in (4, 32, 128):
        x = torch.randn(r, 128256, device="cuda", generator=gen) * 3
        k = torch.randint(1, K_MAX + 1, (r,), device="cuda", generator=gen)
        want = by_sort(x, k)
        row = {"rows": r, "vocab": 128256}
        for name, fn in (("sort", by_sort), ("topk1024", by_topk), ("bisection", by_bisection)):
            got = fn(x, k)
            row[f"{name}_equal"] = bool(torch.equal(got, want))
            row[f"{name}_ms"] = round(time_ms(fn, x, k), 4)
        rows.append(row)
        print(row, flush=True)
    report.write_json({"tool": "bench/topk_threshold_bench.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, ns.out)


if __name__ == "__main__":
    main()
