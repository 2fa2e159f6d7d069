"""Host time of filling one step's pinned staging rows (page tables; the speculative worker's
`_stage_page_tables` and plain decoding's `_decode_graphed` fill them every step): a torch tensor and
slice copy per row, as before 2026-12-01's fourth session, against assignments through a numpy view of
the same buffer, as now. Host only (runs on any machine); both variants must leave the same buffer.

python bench/host_staging_bench.py --out bench/results/host_staging_cpu.json
"""

import argparse
import json
import platform
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--pages", type=int, default=9, help="pages per request")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    rows = []
    for b in ns.batch_sizes:
        staging = torch.zeros(max(ns.batch_sizes), 64, dtype=torch.long)
        page_ids = [tuple(range(i * ns.pages, (i + 1) * ns.pages)) for i in range(b)]

        def per_row_tensors():
            staging[:b] = 0
            for i, pages in enumerate(page_ids):
                staging[i, :len(pages)] = torch.tensor(pages)

        view = staging.numpy()

        def numpy_view():
            view[:b] = 0
            for i, pages in enumerate(page_ids):
                view[i, :len(pages)] = pages

        result = {"batch": b}
        for fn in (per_row_tensors, numpy_view):
            fn()
            start = time.perf_counter()
            for _ in range(ns.calls):
                fn()
            result[f"{fn.__name__}_us"] = round(1e6 * (time.perf_counter() - start) / ns.calls, 2)
        per_row_tensors()
        before = staging.clone()
        numpy_view()
        assert torch.equal(before, staging)
        rows.append(result)
        print(result, flush=True)
    with open(ns.out, "w") as f:
        json.dump({"tool": "bench/host_staging_bench.py", "machine": platform.processor() or platform.machine(),
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
