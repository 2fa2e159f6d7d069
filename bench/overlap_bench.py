"""Iteration time and GPU idle time of the speculative decode loop with and without the overlap
scheduler and the plan stream (random weights in real shapes, EAGLE-3 chain of 3 steps at fixed depth, bf16:
adaptive depth would stop drafting for a random head).

python bench/overlap_bench.py --out overlap.json [--shapes llama-3.2-1b llama-3.1-8b]
    [--attention-backend torch|triton] [--disable-cuda-graph] [--plain]

--plain adds one row per batch for plain decoding (no draft) in the same run, as the baseline;
--default-only measures the speculative engine only as it ships (overlap and plan stream on).

The floor is the target's weight bytes over --copy-tb-s (4.27 TB/s: the H200's measured device-to-device
copy bandwidth, docs/performance.md): no decode step can read its weights faster. Each row prints its
iteration over the floor, kernels per iteration, GPU busy time and the gaps between kernels, so what stands
between a step and the floor can be read off one table. The JSON keeps every kernel by name, with its
launches and GPU time per iteration: a speculative row against the plain one says what drafting adds.

GPU idle = 1 - (union of kernel/memcpy intervals) / (first kernel start .. last kernel end), from the
torch profiler over a window of decode iterations. Acceptance is whatever random heads give (~1):
this measures the pipeline's overheads, not speculation's gains.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.presets import write_preset  # noqa: E402

PROMPT_LEN = 256
WARMUP, MEASURE, PROFILE = 5, 30, 10


def gpu_idle_fraction(prof) -> float:
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    if not intervals:
        return float("nan")
    busy, cur_s, cur_e = 0, *intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = intervals[-1][1] - intervals[0][0]
    return 1 - busy / span


def weight_bytes(engine: Engine) -> int:
    """Bytes of the target's parameters (tied embeddings once): what a decode step must read at least."""
    seen, total = set(), 0
    for p in engine.runner.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def measure(engine: Engine, batch: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=100_000, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(torch.randint(1000, 100000, (PROMPT_LEN,), generator=gen).tolist(), params)
            for _ in range(batch)]
    while any(engine.scheduler.get_request(r).num_computed_tokens < PROMPT_LEN for r in rids):
        engine.step()  # prefill
    for _ in range(WARMUP):
        engine.step()
    torch.cuda.synchronize()
    phases = _time_phases(engine)
    t0 = time.perf_counter()
    for _ in range(MEASURE):
        engine.step()
    torch.cuda.synchronize()
    iter_ms = (time.perf_counter() - t0) / MEASURE * 1e3
    cpu = {k: round(v / MEASURE * 1e3, 3) for k, v in phases.pop("totals").items()}
    phases["restore"]()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE):
            engine.step()
        torch.cuda.synchronize()
    idle = gpu_idle_fraction(prof)
    span_ms = _span_us(prof) / PROFILE / 1e3
    gpu_ms = (1 - idle) * span_ms
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    top = sorted(((e.key, e.device_time_total / PROFILE / 1e3) for e in kernels), key=lambda kv: -kv[1])[:8]
    by_kind = {}
    for e in kernels:
        kind = _kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.device_time_total / PROFILE / 1e3
    tokens = sum(len(engine.scheduler.get_request(r).output_token_ids) for r in rids)
    for r in rids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return {"iter_ms": round(iter_ms, 3), "gpu_idle_frac": round(idle, 4), "gpu_busy_ms_per_iter": round(gpu_ms, 3),
            "gpu_gap_ms_per_iter": round(idle * span_ms, 3),
            "tokens_after": tokens, "cpu_ms_per_iter": cpu,
            "kernels_per_iter": round(sum(e.count for e in kernels) / PROFILE, 1),
            "gpu_ms_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items())},
            "top_gpu_ms_per_iter": [[k[:80], round(v, 4)] for k, v in top],
            # Every kernel: name, launches and ms per iteration (what a speculative step adds over a plain one).
            "kernels_by_name": sorted(([e.key[:100], round(e.count / PROFILE, 2),
                                        round(e.device_time_total / PROFILE / 1e3, 4)] for e in kernels),
                                      key=lambda row: -row[1])}


def _kernel_kind(name: str) -> str:
    """Coarse class of a GPU kernel by name: where a step's time goes."""
    if any(tag in name for tag in ("nvjet", "gemm", "gemv", "splitKreduce", "cutlass")):
        return "gemm"
    if "attention_kernel" in name or "merge_splits" in name:
        return "attention"
    if "rms_norm" in name:
        return "rms_norm"
    return "other"


def _span_us(prof) -> float:
    times = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return max(t[1] for t in times) - min(t[0] for t in times) if times else float("nan")


def _time_phases(engine: Engine) -> dict:
    """Wraps the loop's phases to see where host time goes: scheduling, launching the GPU work
    (Python + kernel launches), and waiting for / applying results."""
    totals = {"schedule": 0.0, "launch": 0.0, "collect_wait": 0.0, "update": 0.0}
    originals = {}

    def wrap(obj, name, key):
        fn = getattr(obj, name)
        originals[(obj, name)] = fn

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[key] += time.perf_counter() - t
        setattr(obj, name, timed)

    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.runner, "launch", "launch")
    wrap(engine.runner, "collect", "collect_wait")
    wrap(engine.scheduler, "update", "update")

    def restore():
        for (obj, name), fn in originals.items():
            setattr(obj, name, fn)
    return {"totals": totals, "restore": restore}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--plain", action="store_true", help="also measure plain decoding (no draft)")
    ap.add_argument("--default-only", action="store_true", help="speculative rows with overlap and plan stream on only")
    ap.add_argument("--copy-tb-s", type=float, default=4.27, help="the bandwidth of the floor (TB/s)")
    ns = ap.parse_args()
    root = tempfile.mkdtemp()
    rows = []
    configs = [(True, True)] if ns.default_only else [(o, p) for o in (True, False) for p in (True, False)]
    configs += [(None, None)] if ns.plain else []
    for shape in ns.shapes:
        target, head = write_preset(shape, root)
        for overlap, plan in configs:
            spec = {} if overlap is None else dict(
                speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=3,
                speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_adaptive=False,
                disable_overlap_schedule=not overlap, disable_plan_stream=not plan)
            engine = Engine(target, load_format="dummy", device="cuda", dtype="bfloat16", **spec,
                            attention_backend=ns.attention_backend, disable_cuda_graph=ns.disable_cuda_graph,
                            max_running_requests=max(ns.batches), context_length=4096,
                            max_total_tokens=max(ns.batches) * 4096, chunked_prefill_size=8192)
            floor_ms = weight_bytes(engine) / (ns.copy_tb_s * 1e12) * 1e3
            for batch in ns.batches:
                r = {"shape": shape, "mode": "plain" if overlap is None else "spec", "overlap": overlap,
                     "plan_stream": plan, "batch": batch, "attention_backend": ns.attention_backend,
                     "cuda_graphs": not ns.disable_cuda_graph, "floor_ms": round(floor_ms, 3),
                     **measure(engine, batch)}
                r["iter_over_floor"] = round(r["iter_ms"] / floor_ms, 3)
                rows.append(r)
                print(json.dumps(r), flush=True)
            engine.shutdown()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python bench/overlap_bench.py " + " ".join(sys.argv[1:]), "rows": rows}
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    report.write_json(result, ns.out)
    print(f"{'shape':14} {'mode':5} {'B':>3} {'overlap':>7} {'plan':>5} {'iter ms':>8} {'floor':>6} {'x floor':>7} "
          f"{'kernels':>7} {'gpu ms':>7} {'gaps ms':>7} {'idle':>6}  host ms: sched launch wait update")
    for r in rows:
        c = r["cpu_ms_per_iter"]
        print(f"{r['shape']:14} {r['mode']:5} {r['batch']:>3} {r['overlap']!s:>7} {r['plan_stream']!s:>5} "
              f"{r['iter_ms']:>8.2f} {r['floor_ms']:>6.2f} {r['iter_over_floor']:>7.2f} {r['kernels_per_iter']:>7.0f} "
              f"{r['gpu_busy_ms_per_iter']:>7.2f} {r['gpu_gap_ms_per_iter']:>7.2f} {r['gpu_idle_frac']:>6.1%}  "
              f"{c['schedule']:6.2f} {c['launch']:6.2f} {c['collect_wait']:6.2f} {c['update']:6.2f}")
    for r in rows:
        kinds = " ".join(f"{k} {v:.3f}" for k, v in r["gpu_ms_by_kind"].items())
        print(f"top GPU ms/iter {r['shape']} {r['mode']} B={r['batch']} overlap={r['overlap']} plan={r['plan_stream']}"
              f" ({r['kernels_per_iter']:.0f} kernels; {kinds}):")
        for name, ms in r["top_gpu_ms_per_iter"]:
            print(f"    {ms:8.3f}  {name}")
    print_added_kernels(rows)


def print_added_kernels(rows: list[dict]) -> None:
    """For each shape and batch measured both ways, the kernels a default speculative step launches beyond a
    plain step's, by name: launches and GPU time per iteration, most launches first."""
    plain = {(r["shape"], r["batch"]): r for r in rows if r["mode"] == "plain"}
    for r in rows:
        base = plain.get((r["shape"], r["batch"]))
        if r["mode"] != "spec" or base is None or not (r["overlap"] and r["plan_stream"]):
            continue
        spec_k = {name: (n, ms) for name, n, ms in r["kernels_by_name"]}
        plain_k = {name: (n, ms) for name, n, ms in base["kernels_by_name"]}
        added = sorted(((spec_k.get(k, (0, 0))[0] - plain_k.get(k, (0, 0))[0],
                         spec_k.get(k, (0, 0))[1] - plain_k.get(k, (0, 0))[1], k) for k in set(spec_k) | set(plain_k)),
                       key=lambda row: -row[0])
        print(f"kernels a speculative step adds, {r['shape']} B={r['batch']}: "
              f"{r['kernels_per_iter'] - base['kernels_per_iter']:+.0f} launches, "
              f"{r['gpu_busy_ms_per_iter'] - base['gpu_busy_ms_per_iter']:+.3f} GPU ms")
        for n, ms, name in added:
            if abs(n) >= 0.5:
                print(f"    {n:+7.1f} {1e3 * ms:+8.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
