"""Where the time to first token goes, speculation on and off, for one preset shape at batch 1.

For each mode it builds the engine as `tandem bench` does (random weights, synthetic acceptance for
speculation, at the fixed depth of a chain of 3), warms up, then runs single requests and records, for the steps up to the first token:
the wall time of each `engine.step()` (host), and under the torch profiler the GPU kernels that ran
(busy time, top kernels), and for one more request every call that made the host wait for the device
(torch's sync debug mode). The JSON says how much of the TTFT is GPU work and how much the host.

python bench/ttft_profile.py --preset llama-3.1-8b --out ttft.json
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report, synthetic  # noqa: E402
from tandem.bench.measure import random_prompts  # noqa: E402
from tandem.bench.run import BenchConfig, resolve_engine_kwargs  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steps_to_first_token(engine, prompt, output_len):
    """(wall ms of each `engine.step()` up to the one that returned the first token, time to first
    token in ms) for one request; then runs the request to its end."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    engine.add_request(prompt, params)
    walls, first_ms = [], None
    while first_ms is None:
        s = time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        walls.append(round(1e3 * (now - s), 3))
        if any(d.new_token_ids for d in out.deltas):
            first_ms = 1e3 * (now - t0)
    while engine.has_unfinished():
        engine.step()
    return walls, first_ms


def kernel_table(prof, top):
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key[:70], e.count, dev / 1e3))
    rows.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    return busy, [{"kernel": k, "count": c, "ms": round(ms, 3)} for k, c, ms in rows[:top]]


def host_syncs(engine, prompt, output_len):
    """Where one request's steps up to its first token make the host wait for the device: torch's
    sync debug mode warns at each synchronising call; each warning's innermost tandem frames."""
    import traceback
    import warnings

    found = []

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                  if os.sep + "tandem" + os.sep in f.filename]
        found.append({"warning": str(message)[:80], "frames": frames[-3:]})

    sync()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            engine.add_request(prompt, SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
            while not any(d.new_token_ids for d in engine.step().deltas):
                pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
    return found


def profile_mode(kw, synthetic_p, input_len, output_len, top):
    engine = Engine(**kw)
    prompts = random_prompts(7, input_len, engine.arch.vocab_size, seed=3)
    if synthetic_p is not None:
        synthetic.install(engine, synthetic_p, seed=0)
    try:
        for p in prompts[:2]:  # warm-up: allocator, kernel selection
            steps_to_first_token(engine, p, output_len)
        runs = [steps_to_first_token(engine, p, output_len) for p in prompts[2:5]]
        from torch.profiler import ProfilerActivity, profile

        # Two output tokens: the profile covers the first token and one decode step after it.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            walls, first_ms = steps_to_first_token(engine, prompts[5], 2)
        busy, kernels = kernel_table(prof, top)
        syncs = host_syncs(engine, prompts[6], output_len) if torch.cuda.is_available() else []
        return {"host_syncs_to_first_token": syncs, "ttft_ms": [round(r[1], 3) for r in runs], "step_wall_ms": [r[0] for r in runs],
                "profiled_ttft_ms": round(first_ms, 3), "profiled_step_wall_ms": walls,
                "gpu_busy_ms_to_first_token_and_one_more": round(busy, 3), "top_kernels": kernels}
    finally:
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--synthetic-acceptance", type=float, default=0.81)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="engine sizing as `tandem bench`'s command line gives it (64); default: Engine's")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--overlap-only", action="store_true", help="skip the runs without the overlap scheduler")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    engine_kwargs = {"device": ns.device, "attention_backend": ns.attention_backend}
    for key in ("max_running_requests", "cuda_graph_max_bs"):
        if getattr(ns, key) is not None:
            engine_kwargs[key] = getattr(ns, key)
    cfg = BenchConfig(engine_kwargs=engine_kwargs,
                      batch_sizes=(1,), preset=ns.preset, input_len=ns.input_len, output_len=ns.output_len,
                      synthetic_acceptance=ns.synthetic_acceptance)
    result = {"tool": "bench/ttft_profile.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu", "preset": ns.preset, "input_len": ns.input_len,
              "label": synthetic.LABEL, "command": "python " + " ".join(sys.argv), "modes": {}}
    with tempfile.TemporaryDirectory() as d:
        spec_kw = dict(resolve_engine_kwargs(cfg, d), speculative_adaptive=False)  # (the configured chain, always)
        plain_kw = dict(spec_kw, speculative_algorithm=None, speculative_draft_model_path=None)
        for mode, kw, p in (("spec_on", spec_kw, ns.synthetic_acceptance), ("spec_off", plain_kw, None)):
            for overlap in (True,) if ns.overlap_only else (True, False):
                name = f"{mode}{'' if overlap else '_no_overlap'}"
                r = profile_mode(dict(kw, disable_overlap_schedule=not overlap), p, ns.input_len, ns.output_len, ns.top)
                result["modes"][name] = r
                print(f"== {name}: ttft {r['ttft_ms']} ms, steps {r['step_wall_ms']} ms, "
                      f"GPU busy {r['gpu_busy_ms_to_first_token_and_one_more']} ms")
                for k in r["top_kernels"]:
                    print(f"   {k['ms']:8.3f} ms {k['count']:5d}x  {k['kernel']}")
                for sync_point in r["host_syncs_to_first_token"]:
                    print("   host waits:", " <- ".join(reversed(sync_point["frames"])), "|", sync_point["warning"])
    if ns.out:
        report.write_json(result, ns.out)


if __name__ == "__main__":
    main()
