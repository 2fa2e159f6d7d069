"""The adaptive policy's choices through a sweep-like sequence, on a CPU, with a frozen cost table.

`tandem bench --sweep` on a GPU only reports tokens per second; this replays the same sequence (a warm-up
at each batch size, then per batch size: the acceptance averages reset to the prior, `--runs` runs of
`--output-len` tokens) on the demo pair with synthetic acceptance (BENCHMARK ONLY: outputs are the
draft's) and a cost table frozen at GPU-like values (depth 0's catch-up charge too), and prints what each
run chose: engine steps by depth, catch-ups, dormant admissions and the engine's acceptance. It found
the vain chains of one behind the H200 sweep's worst point (docs/performance.md, fourth session).

OMP_NUM_THREADS=2 python bench/policy_replay.py --cost-ms 5.2 5.7 6.2 6.7 --batch-sizes 1 8 32
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import synthetic  # noqa: E402
from tandem.bench.measure import random_prompts, run_batch  # noqa: E402
from tandem.demo import demo_model_paths  # noqa: E402
from tandem.layers.sampler import SamplingFeatures, step_mode  # noqa: E402
from tandem.request import SamplingParams  # noqa: E402
from tandem.speculative.policy import DepthPolicy, cost_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-ms", type=float, nargs=4, default=[5.2, 5.7, 6.2, 6.7],
                    help="iteration ms at depth 0..3, every batch size (frozen: online timing is off)")
    ap.add_argument("--catch-up-ms", type=float, default=None,
                    help="depth 0's catch-up charge per deferred step, every batch size (frozen; default 0.7%% of "
                         "depth 0's cost, the H200's 8B-shape ratio at batch 32). The CPU's own catch-ups cost "
                         "tens of times more against a GPU-like table and made depth 0 look dearer than it is")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--acceptance", type=float, default=0.0, help="synthetic acceptance per draft")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ns = ap.parse_args()
    DepthPolicy.observe_time = lambda self, *args, **kwargs: None  # the cost table stays as set below
    DepthPolicy.observe_catch_up = lambda self, *args, **kwargs: None
    DepthPolicy.observe_dormant_time = lambda self, *args, **kwargs: None  # (a dormant step: depth 0's cost)
    target, head = demo_model_paths()
    engine = Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, device="cpu",
                    max_running_requests=max(ns.batch_sizes), context_length=64 + ns.output_len + 16)
    policy = engine.runner.spec.policy
    charge = 0.007 * ns.cost_ms[0] if ns.catch_up_ms is None else ns.catch_up_ms
    mode = step_mode(SamplingFeatures.of([SamplingParams(temperature=ns.temperature)]))  # (the runs' cost tables)
    for bs in range(1, max(ns.batch_sizes) + 1):
        for shape in policy.options:
            policy.cost_ms[(cost_table(bs, mode), shape)] = ns.cost_ms[shape.depth]
        policy.catch_up_per_step_ms[bs] = charge
    vocab = engine.arch.vocab_size
    for b in ns.batch_sizes:
        run_batch(engine, random_prompts(b, 64, vocab, seed=10_007), 8, ns.temperature)
    synthetic.install(engine, ns.acceptance)
    print(f"depth 0's catch-up charge: {charge:.3f} ms a deferred step (frozen)")
    print("batch run | steps by depth | catch-ups | dormant | acceptance per position | modelled ms (x depth 0 "
          "throughout)")
    window = engine.runner.spec.pool.catch_up_window
    for b in ns.batch_sizes:
        policy.reset_acceptance()
        for r in range(ns.runs):
            m, _ = run_batch(engine, random_prompts(b, 64, vocab, seed=0), ns.output_len, ns.temperature)
            # The steps' time by the frozen table (a catch-up runs a whole window), against depth 0 on every step.
            ms = sum(n * ns.cost_ms[d] for d, n in enumerate(m.steps_by_depth)) + m.catch_ups * charge * window
            print(f"{b:5d} {r:3d} | {m.steps_by_depth} | {m.catch_ups} | {m.dormant_admitted} | "
                  f"{[round(a, 3) for a in policy.effective_acceptance()]} | {ms:.0f} "
                  f"({ns.output_len * ns.cost_ms[0] / ms:.3f}x)", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
