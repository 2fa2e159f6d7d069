"""Where a host-bound engine's step time goes: the demo pair (or any model) decoding with plain decoding,
fixed-depth speculation, adaptive speculation, and adaptive speculation with every request admitted
dormant (the floor of its depth-0 path), engines side by side, runs interleaved.

Each engine method on a step's path is wrapped with a timer, so the table gives host microseconds per
step in: scheduling, choosing the draft shape, launching, waiting for the device, reading the results,
and the engine's own processing. One cProfile per engine (the last batch size) lists the top functions.

    python bench/host_profile.py --batch-sizes 1 8 32 --output-len 128 --repeats 5 --out host.json
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import functools
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.measure import admit_every_request_dormant, random_prompts, run_batch  # noqa: E402
from tandem.demo import demo_model_paths  # noqa: E402
from tandem.engine.engine import Engine as EngineClass  # noqa: E402
from tandem.runtime import model_runner, streams  # noqa: E402
from tandem.scheduler.scheduler import Scheduler  # noqa: E402
from tandem.speculative import worker  # noqa: E402

# (class, method, label): the segments of one step, timed where they run.
SEGMENTS = [
    (Scheduler, "schedule", "schedule"),
    (worker.SpecWorker, "choose_shape", "choose shape"),
    (model_runner.ModelRunner, "launch", "launch (all)"),
    (model_runner.ModelRunner, "collect", "collect (all)"),
    (streams.StreamSet, "host_wait", "wait (spec)"),
    (Scheduler, "update", "scheduler update"),
    (EngineClass, "_process", "process (all)"),
    (EngineClass, "step", "step (all)"),
]


class Timers:
    def __init__(self):
        self.us = collections.defaultdict(float)
        self.active = None  # the engine name being timed

    def wrap(self, cls, name, label):
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.active is not None:
                    self.us[(self.active, label)] += 1e6 * (time.perf_counter() - start)

        setattr(cls, name, timed)


def plain_wait(timers: Timers):
    """Plain decoding waits in _collect_plain on handle.ready.synchronize(): time it there."""
    original = model_runner.ModelRunner._collect_plain

    def collect(self, handle):
        ready = handle.ready
        if ready is not None:
            start = time.perf_counter()
            ready.synchronize()
            if timers.active is not None:
                timers.us[(timers.active, "wait (plain)")] += 1e6 * (time.perf_counter() - start)
        return original(self, handle)

    model_runner.ModelRunner._collect_plain = collect


def graph_replay_ms(engines, sizes, temperature: float) -> dict:
    """Per batch size: the replay time of plain decoding's graph, speculation's depth-0 and deepest
    whole-iteration graphs and the dormant-decode graph (the sampling kind of the run). Timed first, while
    every static input still holds the padding of capture: a replay writes only the sink page and pad rows."""
    if not torch.cuda.is_available():
        return {}
    from tandem.layers.sampler import GREEDY, SAMPLED
    from tandem.speculative.worker import _replay_ms

    kind = GREEDY if temperature == 0 else SAMPLED
    graphs = {"plain": engines["plain"].runner.decode_graphs.get(kind)}
    phases = engines["dormant"].runner.spec.phases
    graphs.update({"depth 0": phases.graphs.get(f"iteration:{kind.name}:chain0"),
                   "chain 3": phases.graphs.get(f"iteration:{kind.name}:chain3"),
                   "dormant": phases.graphs.get(f"dormant:{kind.name}")})
    out = {}
    for b in sizes:
        row = {}
        for name, graph in graphs.items():
            if graph is not None and graph.fits(b):
                padded = min(s for s in graph.graphs if s >= b)
                row[name] = round(min(_replay_ms(graph.graphs[padded], 20) for _ in range(3)), 4)
        out[b] = row
    torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    target, head = demo_model_paths()
    max_bs = max(ns.batch_sizes)
    context = ns.input_len + ns.output_len + 16
    kw = dict(model_path=target, speculative_draft_model_path=head, speculative_algorithm="EAGLE3",
              speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
              max_running_requests=max_bs, context_length=context, max_total_tokens=max_bs * (context + 64),
              cuda_graph_max_bs=max_bs, device=ns.device)
    configs = {"plain": dict(kw, speculative_algorithm=None, speculative_draft_model_path=None),
               "fixed": dict(kw, speculative_adaptive=False), "adaptive": dict(kw, speculative_adaptive=True),
               "dormant": dict(kw, speculative_adaptive=True)}
    timers = Timers()
    for cls, name, label in SEGMENTS:
        timers.wrap(cls, name, label)
    plain_wait(timers)
    engines = {name: Engine(**config) for name, config in configs.items()}
    admit_every_request_dormant(engines["dormant"])
    replays = graph_replay_ms(engines, ns.batch_sizes, ns.temperature)
    vocab = engines["plain"].arch.vocab_size
    result = {"tool": "bench/host_profile.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": ["python", *sys.argv], "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "points": []}
    profiles = {}
    for b in ns.batch_sizes:
        prompts = random_prompts(b, ns.input_len, vocab, seed=0)
        for engine in engines.values():
            run_batch(engine, prompts, 8, temperature=ns.temperature)  # warm-up at this shape
        timers.us.clear()
        steps, runs = collections.Counter(), collections.defaultdict(list)
        for r in range(ns.repeats):
            for name, engine in engines.items():
                timers.active = name
                prof = cProfile.Profile() if (b == ns.batch_sizes[-1] and r == ns.repeats - 1) else None
                if prof:
                    prof.enable()
                metrics, _ = run_batch(engine, prompts, ns.output_len, temperature=ns.temperature)
                if prof:
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                    profiles[name] = out.getvalue()
                timers.active = None
                runs[name].append(metrics)
        point = {"batch": b, "engines": {}}
        for name in engines:
            ms = sorted(m.iteration_ms for m in runs[name])
            n_steps = sum(m.decode_iterations for m in runs[name])
            tok_s = sorted(m.tokens_per_s for m in runs[name])
            segs = {label: round(us / max(n_steps, 1), 1) for (eng, label), us in timers.us.items() if eng == name}
            point["engines"][name] = {"iteration_ms_median": round(ms[len(ms) // 2], 4),
                                      "tokens_per_s_median": round(tok_s[len(tok_s) // 2], 1),
                                      "mean_accept_length": runs[name][-1].mean_accept_length,
                                      "steps_by_depth": runs[name][-1].steps_by_depth,
                                      "us_per_decode_step": segs}
        plain_tps = point["engines"]["plain"]["tokens_per_s_median"]
        for name, e in point["engines"].items():
            e["tokens_per_s_vs_plain"] = round(e["tokens_per_s_median"] / plain_tps, 4)
        result["points"].append(point)
        print(f"\n== batch {b} (T {ns.temperature}, {ns.output_len} tokens, median of {ns.repeats})", flush=True)
        labels = sorted({label for e in point["engines"].values() for label in e["us_per_decode_step"]})
        print(f"{'segment (us/step)':<20}" + "".join(f"{n:>10}" for n in engines))
        for key in ("iteration_ms_median", "tokens_per_s_vs_plain", "mean_accept_length"):
            print(f"{key:<20}" + "".join(f"{str(point['engines'][n][key]):>10}" for n in engines))
        for label in labels:
            print(f"{label:<20}" + "".join(f"{point['engines'][n]['us_per_decode_step'].get(label, 0):>10}"
                                          for n in engines))
    result["graph_replay_ms"] = replays
    if replays:
        print("\ngraph replay ms (GPU time of one step's graph, padded rows, before any request)")
        for b, row in replays.items():
            print(f"  batch {b}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    result["profiles"] = profiles
    for name, text in profiles.items():
        print(f"\n==== cProfile, {name}, batch {ns.batch_sizes[-1]}")
        print("\n".join(text.splitlines()[:38]))
    for engine in engines.values():
        engine.shutdown()
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    report.write_json(result, ns.out)


if __name__ == "__main__":
    main()
