"""How far engine instances doing identical work differ in speed, on a CPU: what one `tandem bench` ratio
can be trusted to.

Builds, in one process and in this order, two plain engines and two speculative ones on the demo pair
(the speculative ones admit every request dormant, so each step is plain decoding's step), then runs one
64-token request at a time on each in turn (the order reversed every round, so a drift of the machine's
speed lands on all alike) and reports each engine's median decode iteration and its median ratio to the
first-built engine's, round by round. With identical work every ratio would be 1. Then the same again
with the engines taking turns step by step, each timed on its own calls (`run_in_lockstep`, what `tandem
bench` does on a CPU).

OMP_NUM_THREADS=1 PYTHONPATH=src python bench/engine_instance_spread.py --out spread.json
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.measure import (BatchRun, admit_every_request_dormant, random_prompts, run_batch,  # noqa: E402
                                  run_in_lockstep)
from tandem.demo import demo_model_paths  # noqa: E402


def dormant_engine(target: str, head: str, **kw) -> Engine:
    """A speculative engine whose every request is admitted dormant (plain decoding's step)."""
    engine = Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, **kw)
    admit_every_request_dormant(engine)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="plain_a,spec_a,plain_b,spec_b",
                    help="engines in the order they are built (names starting with 'spec' are speculative)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    target, head = demo_model_paths()
    kw = dict(device="cpu", max_running_requests=1, context_length=64 + ns.output_len + 16)
    names = ns.order.split(",")
    engines = {n: dormant_engine(target, head, **kw) if n.startswith("spec") else Engine(target, **kw) for n in names}
    vocab = engines[names[0]].arch.vocab_size
    for engine in engines.values():  # warm-up
        for _ in range(3):
            run_batch(engine, random_prompts(1, 64, vocab, seed=1), 16)
    result = {}
    for turns in ("run", "step"):
        iteration = {n: [] for n in names}
        for r in range(ns.rounds):
            prompts = random_prompts(1, 64, vocab, seed=100 + r)
            if turns == "step":
                runs = run_in_lockstep([BatchRun(engines[n], prompts, ns.output_len, busy_clock=True) for n in names])
                for n, (m, _) in zip(names, runs):
                    iteration[n].append(m.iteration_ms)
            else:
                for n in names if r % 2 == 0 else names[::-1]:
                    m, _ = run_batch(engines[n], prompts, ns.output_len)
                    iteration[n].append(m.iteration_ms)
            print(f"turns by {turns}: round {r + 1}/{ns.rounds}", end="\r", file=sys.stderr, flush=True)
        result[turns] = rows = {}
        first = names[0]
        for n in names:
            ratios = [a / b for a, b in zip(iteration[first], iteration[n])]
            rows[n] = {"median_iteration_ms": round(statistics.median(iteration[n]), 3),
                       "median_speed_vs_first_built": round(statistics.median(ratios), 3),
                       "speed_vs_first_built_range": [round(min(ratios), 3), round(max(ratios), 3)],
                       "iteration_ms": [round(x, 3) for x in iteration[n]]}
            print(f"turns by {turns}: {n:10s} median iteration {rows[n]['median_iteration_ms']} ms, speed vs "
                  f"first-built {rows[n]['median_speed_vs_first_built']} {rows[n]['speed_vs_first_built_range']}")
    for engine in engines.values():
        engine.shutdown()
    if ns.out:
        report.write_json({"tool": "bench/engine_instance_spread.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "command": sys.argv, "order": names, "rounds": ns.rounds, "output_len": ns.output_len,
                           "engines_by_turns": result}, ns.out)


if __name__ == "__main__":
    main()
