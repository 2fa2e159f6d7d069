"""Which lines of tandem issue a decode step's torch ops on the GPU (each op one kernel or more; Triton kernels
are launched outside torch's dispatcher and not counted): every op of a few eager steps, attributed to the
innermost tandem frame that called it, summed per line.

python bench/op_sources.py [--shape llama-3.2-1b] [--batch 1] [--steps 10] [--plain] [--top 40]
    [--out op-sources.json]

Eager (no CUDA graphs: a replay issues no ops), random weights in the shape, bf16, the speculative engine as
overlap_bench.py builds it (EAGLE-3 chain of 3 at fixed depth, overlap and plan stream on), or plain decoding
with --plain. Read it beside overlap_bench.py, which names and times the graphed step's kernels: the lines
that issue most ops are where fusing pays first.
"""

import argparse
import os
import sys
import tempfile
import traceback
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.presets import write_preset  # noqa: E402

PROMPT_LEN = 256


# Ops that only make a tensor's metadata, never a kernel.
_NO_KERNEL = {torch.ops.aten.detach, torch.ops.aten.alias, torch.ops.aten.empty, torch.ops.aten.empty_strided,
              torch.ops.aten.lift_fresh, torch.ops.aten.set_, torch.ops.aten.resize_}


class OpCounter(TorchDispatchMode):
    """Counts every op on a CUDA tensor by the innermost frame of tandem's sources that called it."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.by_line = defaultdict(lambda: [0, defaultdict(int)])  # line -> [ops, {op: count}]
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket in _NO_KERNEL:
            return out
        tensors = [t for t in (*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else (out,)))
                   if isinstance(t, torch.Tensor)]
        if any(t.device.type == self.device_type for t in tensors):
            entry = self.by_line[_caller()]
            entry[0] += 1
            entry[1][str(func.overloadpacket)] += 1
            self.total += 1
        return out


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = os.path.normpath(frame.filename).replace(os.sep, "/")
        if "/tandem/" in path:
            return f"{path[path.rindex('/tandem/') + 1:]}:{frame.lineno} {frame.name}"
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
    counter = OpCounter()
    with counter:
        for _ in range(ns.steps):
            engine.step()
        torch.cuda.synchronize()
    engine.shutdown()
    by_line, total = counter.by_line, counter.total
    rows = sorted(([line, n / ns.steps, {op: c / ns.steps for op, c in ops.items()}]
                   for line, (n, ops) in by_line.items()), key=lambda r: -r[1])
    print(f"{ns.shape} batch {ns.batch} {'plain' if ns.plain else 'speculative'}: {total / ns.steps:.0f} torch ops a "
          "step on the GPU (eager), by the tandem line that issued them")
    for line, n, ops in rows[:ns.top]:
        top_ops = ", ".join(f"{op} {c:g}" for op, c in sorted(ops.items(), key=lambda kv: -kv[1])[:3])
        print(f"  {n:6.1f}  {line[:90]:90}  {top_ops}")
    if ns.out:
        report.write_json({"tool": "bench/op_sources.py", "command": "python " + " ".join(sys.argv),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": ns.shape,
                           "batch": ns.batch, "plain": ns.plain, "ops_per_step": total / ns.steps,
                           "lines": [{"line": line, "ops": n, "by_op": ops} for line, n, ops in rows]}, ns.out)


if __name__ == "__main__":
    main()
