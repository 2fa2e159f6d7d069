"""Should the EAGLE-3 draft layer be sharded like the target under tensor parallelism, or replicated?

Times one draft forward (the EAGLE-3 decoder layer, its 32k-vocabulary lm_head, and, for the extend
step, the fc over three target layers) of the Llama-3.1-8B-shape head at TP=1 (what every rank runs
when the draft is replicated) and at TP=2 with the layer split like the target's (column-parallel
q/k/v and gate/up, row-parallel o/down with an all-reduce each; lm_head and fc kept whole). Random
bf16 weights, triton attention over a 256-token paged prefix, each forward replayed from a CUDA
graph; two processes on two GPUs (NCCL), or on a CPU with gloo for a smoke run (`--device cpu`,
eager, float32).

python bench/draft_tp_bench.py --out draft_tp.json
"""

import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

PREFIX = 256
PAGE = 16


def build_layer(arch, tp, device, dtype):
    """The head's real decoder layer (Eagle3MidLayer, split over `tp`) with whole fc and lm_head."""
    from tandem.layers.linear import Linear
    from tandem.layers.norm import RMSNorm
    from tandem.layers.rotary import RotaryEmbedding
    from tandem.models.eagle3 import Eagle3MidLayer

    h = arch.hidden_size
    rotary = RotaryEmbedding(arch.head_dim, 4096, arch.rope_theta, arch.rope_scaling)
    mods = torch.nn.ModuleDict(dict(layer=Eagle3MidLayer(arch, rotary, tp), norm=RMSNorm(h, arch.rms_norm_eps),
                                    fc=Linear(3 * h, h, bias=False), lm_head=Linear(h, 32000, bias=False)))
    with torch.no_grad():
        for name, p in mods.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    mods.layer.self_attn.rotary = rotary.to(device)
    return mods.to(device, dtype)


def forward(mods, ctx, positions, embeds, g, aux):
    """One draft step; with `aux` (the extend step) g comes from fc over the target's three states."""
    if aux is not None:
        g = mods.fc(aux)
    return mods.lm_head(mods.norm(mods.layer(positions, embeds, g, ctx)))


def run_rank(rank, world, port, ns, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from tandem.distributed.parallel_state import TPGroup
    from tandem.layers.attention.base import AttentionBatch
    from tandem.models.draft_registry import draft_head_config
    from tandem.models.llama import StepContext
    from tandem.bench.presets import write_preset

    cuda = ns.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        arch = draft_head_config(write_preset("llama-3.1-8b", d)[1])
    if cuda:
        from tandem.layers.attention.triton_backend import TritonAttentionBackend as Backend
    else:
        from tandem.layers.attention.torch_backend import TorchAttentionBackend as Backend
    for tp_size in (1, 2):
        group = dist.new_group([0, 1]) if tp_size > 1 else None
        if rank >= tp_size:
            dist.barrier()
            continue
        tp = TPGroup(rank, tp_size, group, None) if tp_size > 1 else TPGroup.single()
        torch.manual_seed(0)
        mods = build_layer(arch, tp, device, dtype)
        h, kv_heads = arch.hidden_size, mods.layer.self_attn.num_kv_heads
        for batch in ns.batches:
            for q in (1, 4):  # a tree step (one query per row) and an extend (four)
                n = batch * q
                rows_slots = [list(range(r * (PREFIX + 8), r * (PREFIX + 8) + PREFIX + q)) for r in range(batch)]
                meta_batch = AttentionBatch([q] * batch, rows_slots, [s for row in rows_slots for s in row[PREFIX:]])
                backend = Backend()
                k_cache = torch.zeros(batch * (PREFIX + 8), kv_heads, arch.head_dim, device=device, dtype=dtype)
                ctx = StepContext(backend, backend.plan(meta_batch, device), [k_cache], [torch.zeros_like(k_cache)])
                positions = torch.full((n,), PREFIX, device=device, dtype=torch.long)
                embeds = torch.randn(n, h, device=device, dtype=dtype)
                g = torch.randn(n, h, device=device, dtype=dtype)
                aux = torch.randn(n, 3 * h, device=device, dtype=dtype) if q > 1 else None
                with torch.inference_mode():
                    step = (lambda: forward(mods, ctx, positions, embeds, g, aux))
                    for _ in range(3):
                        step()
                    if cuda:
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step()
                        step = graph.replay
                        for _ in range(10):
                            step()
                        torch.cuda.synchronize()
                    if tp_size > 1:
                        dist.barrier(group=group)
                    reps = ns.reps if cuda else 3
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        step()
                    if cuda:
                        torch.cuda.synchronize()
                    ms = (time.perf_counter() - t0) / reps * 1e3
                results[f"tp{tp_size}_b{batch}_q{q}"] = round(ms, 4)
        del mods
        dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, 2, port, ns, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = None
    while results is None:  # a rank that fails must not leave this waiting
        try:
            results = queue.get(timeout=2)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed (its traceback is above)")
    for p in procs:  # NCCL's teardown can hang once the results are in: do not wait for it long
        p.join(10)
        if p.is_alive():
            p.kill()
    rows = []
    for b in ns.batches:
        for q, step in ((1, "tree step"), (4, "extend")):
            one, two = results[f"tp1_b{b}_q{q}"], results[f"tp2_b{b}_q{q}"]
            rows.append({"batch": b, "step": step, "replicated_ms": one, "sharded_tp2_ms": two,
                         "sharded_over_replicated": round(two / one, 3)})
            print(f"batch {b:3d} {step:9s}  replicated {one:7.3f} ms  sharded (TP=2) {two:7.3f} ms  ratio {two / one:.2f}")
    if ns.out:
        info = {"tool": "bench/draft_tp_bench.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "device": torch.cuda.get_device_name(0) if ns.device == "cuda" else "cpu",
                "torch": torch.__version__, "shape": "llama-3.1-8b EAGLE-3 head (draft vocab 32000)",
                "prefix_tokens": PREFIX, "rows": rows}
        report.write_json(info, ns.out)


if __name__ == "__main__":
    main()
