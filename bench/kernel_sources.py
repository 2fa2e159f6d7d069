"""Which lines of tandem launch a decode step's kernels: every GPU kernel of a few eager steps, attributed to
the first tandem frame of the Python stack that launched it, summed per line and torch op.

python bench/kernel_sources.py [--shape llama-3.2-1b] [--batch 1] [--steps 10] [--plain] [--top 40]
    [--out kernel-sources.json]

Eager (no CUDA graphs: a graph replay hides which op launched what), random weights in the shape, bf16, the
speculative engine as overlap_bench.py builds it (EAGLE-3 chain of 3 at fixed depth, overlap and plan stream
on), or plain decoding with --plain. Launch counts match the graphed step's, kernel times do not (eager
steps leave gaps): read this beside overlap_bench.py, which times the graphed step and names its kernels.
"""

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.presets import write_preset  # noqa: E402

PROMPT_LEN = 256


def source_line(event) -> str:
    """The first frame inside tandem's sources of the op that launched a kernel, or of an op above it."""
    while event is not None:
        for frame in event.stack or ():
            if "tandem" in frame and "bench/" not in frame:
                return frame[frame.index("tandem"):]
        event = event.cpu_parent
    return "(no tandem frame)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    target, head = write_preset(ns.shape, tempfile.mkdtemp())
    spec = {} if ns.plain else dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                                    speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                                    speculative_adaptive=False)
    engine = Engine(target, load_format="dummy", device="cuda", dtype="bfloat16", attention_backend="triton",
                    disable_cuda_graph=True, max_running_requests=ns.batch, context_length=4096,
                    max_total_tokens=ns.batch * 4096, **spec)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=100_000, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(torch.randint(1000, 30000, (PROMPT_LEN,), generator=gen).tolist(), params)
            for _ in range(ns.batch)]
    while any(engine.scheduler.get_request(r).num_computed_tokens < PROMPT_LEN for r in rids):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True) as prof:
        for _ in range(ns.steps):
            engine.step()
        torch.cuda.synchronize()
    engine.shutdown()
    by_line = defaultdict(lambda: [0, 0.0, defaultdict(int)])  # line -> [kernels, us, {op: kernels}]
    total = 0
    events = prof.events()
    launched = [(e, k.duration) for e in events if e.device_type == torch.autograd.DeviceType.CPU for k in e.kernels]
    if not launched:  # (profilers that link each kernel to its op as a device event's parent instead)
        launched = [(e.cpu_parent, e.time_range.elapsed_us()) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.cpu_parent is not None]
    for op, us in launched:
        entry = by_line[source_line(op)]
        entry[0] += 1
        entry[1] += us
        entry[2][op.name] += 1
        total += 1
    rows = sorted(([line, n / ns.steps, us / ns.steps, {op: c / ns.steps for op, c in ops.items()}]
                   for line, (n, us, ops) in by_line.items()), key=lambda r: -r[1])
    print(f"{ns.shape} batch {ns.batch} {'plain' if ns.plain else 'speculative'}: {total / ns.steps:.0f} kernels a step"
          " (eager), by the tandem line that launched them")
    for line, n, us, ops in rows[:ns.top]:
        top_ops = ", ".join(f"{op} {c:g}" for op, c in sorted(ops.items(), key=lambda kv: -kv[1])[:3])
        print(f"  {n:6.1f} {us:8.1f} us  {line[:80]:80}  {top_ops}")
    if ns.out:
        report.write_json({"tool": "bench/kernel_sources.py", "command": "python " + " ".join(sys.argv),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": ns.shape,
                           "batch": ns.batch, "plain": ns.plain, "kernels_per_step": total / ns.steps,
                           "lines": [{"line": line, "kernels": n, "us": round(us, 2), "ops": ops}
                                     for line, n, us, ops in rows]}, ns.out)


if __name__ == "__main__":
    main()
