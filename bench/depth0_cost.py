"""What a depth-0 speculative step costs over a plain decode step, and where (one GPU, one process).

For each batch size: the replay time of plain decoding's graph and of speculation's depth-0
whole-iteration graph (and the catch-up graph, which runs once per CATCH_UP_WINDOW depth-0 steps), then
the CUDA kernels inside one replay of each (torch.profiler), the depth-0 graph's extra kernels listed
by time. Prints a table and writes JSON.

    python bench/depth0_cost.py --shape llama-3.1-8b --batch-sizes 1 32 128 --out depth0_cost.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.presets import write_preset  # noqa: E402
from tandem.layers.sampler import GREEDY  # noqa: E402
from tandem.speculative.policy import DraftShape  # noqa: E402
from tandem.speculative.worker import _replay_ms  # noqa: E402 (the start-up timing's own)


def kernels(graph) -> dict[str, float]:
    """Kernel name -> total µs inside one replay."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    target, head = write_preset(ns.shape, tempfile.mkdtemp())
    common = dict(load_format="dummy", device="cuda", dtype="bfloat16", context_length=2048,
                  max_running_requests=max(ns.batch_sizes), cuda_graph_max_bs=max(ns.batch_sizes),
                  attention_backend="triton", max_total_tokens=max(ns.batch_sizes) * 2048)
    rows = {b: {} for b in ns.batch_sizes}
    plain = Engine(target, **common)
    plain_graph = plain.runner.decode_graphs[GREEDY]
    plain_kernels = {}
    for b in ns.batch_sizes:
        rows[b]["plain_ms"] = _replay_ms(plain_graph.graphs[b], 20)
        plain_kernels[b] = kernels(plain_graph.graphs[b])
    plain.shutdown()
    del plain
    torch.cuda.empty_cache()
    spec = Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4, **common)
    phases = spec.runner.spec.phases
    depth0 = phases.iteration_graph(GREEDY, DraftShape(0))
    deepest = phases.iteration_graph(GREEDY, DraftShape(3))
    catch_up = phases.graphs["catch_up"]
    report = []
    for b in ns.batch_sizes:
        r = rows[b]
        r["depth0_ms"] = _replay_ms(depth0.graphs[b], 20)
        r["chain3_ms"] = _replay_ms(deepest.graphs[b], 20)
        r["catch_up_ms"] = _replay_ms(catch_up.graphs[b], 20)
        r["depth0_over_plain"] = r["depth0_ms"] / r["plain_ms"]
        k0, kp = kernels(depth0.graphs[b]), plain_kernels[b]
        extra = {name: us - kp.get(name, 0.0) for name, us in k0.items() if us - kp.get(name, 0.0) > 0.5}
        r["kernels"] = {"plain": len(kp), "depth0": len(k0), "plain_us": sum(kp.values()), "depth0_us": sum(k0.values())}
        r["depth0_extra_us"] = dict(sorted(extra.items(), key=lambda kv: -kv[1])[:25])
        report.append(r)
        print(f"batch {b:4d}: plain {r['plain_ms']:.3f} ms, depth-0 {r['depth0_ms']:.3f} ms "
              f"({r['depth0_over_plain']:.3f}x), chain3 {r['chain3_ms']:.3f} ms, catch-up {r['catch_up_ms']:.3f} ms; "
              f"kernel time {r['kernels']['plain_us']:.0f} vs {r['kernels']['depth0_us']:.0f} us")
        for name, us in list(r["depth0_extra_us"].items())[:12]:
            print(f"    +{us:8.1f} us  {name}")
    if ns.out:
        report.write_json({"shape": ns.shape, "gpu": torch.cuda.get_device_name(), "rows": rows}, ns.out)


if __name__ == "__main__":
    main()
