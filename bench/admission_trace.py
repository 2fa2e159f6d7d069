"""Why the adaptive policy admits requests dormant and drafts what it drafts, for the demo pair.

python bench/admission_trace.py --batch-sizes 1 8 32 --runs 3 [--choices] [--warmup-len 8] --out trace.json

Builds the adaptive engine as bench/sampling_bench.py does (EAGLE-3 chain of 3, CUDA graphs, overlap), runs
greedy batches of random prompts (after a warm-up batch of --warmup-len tokens at each size, as that bench
does), and records at each admission (`DepthPolicy.admit`) the cost table the decision saw (each option's
cost floored at the host-bound step's, the dormant step's, depth 0's), the engine-wide acceptance as
estimated and as optimism allows, the draft prefill's share, and the answer. With --choices, every step's
choice too (`DepthPolicy.choose`): the batch's acceptance and observations, the tokens each depth is
expected to make and the costs it was weighed at (`_effective_costs`), and the answer; and every online step
time the policy is told (`step_times`). Each run also
records the acceptance of position 1 by the requests' step number (what their drafting steps showed).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.demo_batches import add_batch_arguments, demo_engine_kwargs  # noqa: E402
from tandem.bench.measure import random_prompts, run_batch  # noqa: E402
from tandem.speculative.policy import cost_table, expected_by_depth  # noqa: E402


def traced(policy, log):
    real_admit = policy.admit

    def admit(request_id, padded_batch, prompt_tokens=0, max_new_tokens=0, sampled=False, finish_together=False,
              mode="greedy"):
        table = cost_table(padded_batch, mode)
        entry = {"batch": padded_batch, "sampled": sampled, "finish_together": finish_together}
        if all((table, s) in policy.cost_ms for s in policy.options):
            costs = policy._floored_costs(table)
            entry["costs_ms"] = {s.name: round(ms, 4) for s, ms in costs.items()}
            entry["raw_costs_ms"] = {s.name: round(policy.cost_ms[(table, s)], 4) for s in policy.options}
            entry["host_bound_ms"] = round(policy.host_bound_ms(table), 4)
            entry["dormant_step_ms"] = round(policy.dormant_step_ms(table, costs[policy.options[0]]), 4)
        cls = policy.rates_by_class[sampled]
        entry["acceptance"] = [round(a, 3) for a in cls.effective()]
        entry["seen"] = list(cls.seen)
        entry["expected"] = [round(e, 3) for e in expected_by_depth(cls.effective())]
        entry["optimistic"] = [round(a, 3) for a in policy.optimistic_acceptance(sampled)]
        entry["upkeep_ms"] = round(policy.prefill_share_ms(padded_batch, prompt_tokens, max_new_tokens), 4)
        answer = real_admit(request_id, padded_batch, prompt_tokens, max_new_tokens, sampled, finish_together, mode)
        entry["dormant"] = answer
        log.append(entry)
        return answer

    policy.admit = admit


def traced_choices(policy, log):
    """Wraps `choose`: each call's inputs and answer go to `log`."""
    real_choose, real_costs, real_progress = policy.choose, policy._effective_costs, policy._slowest_rows_progress
    seen = {}

    def costs(*args, **kwargs):
        out = seen["costs"] = real_costs(*args, **kwargs)
        return out

    def progress(*args, **kwargs):
        out = seen["slowest_rows"] = real_progress(*args, **kwargs)
        return out

    def choose(request_ids, padded_batch, *args, **kwargs):
        seen.clear()
        shape = real_choose(request_ids, padded_batch, *args, **kwargs)
        cls = policy._batch_class(request_ids)
        entry = {"batch": padded_batch, "rows": len(request_ids), "choice": shape.name,
                 "dormant_rows": len(policy.dormant.intersection(request_ids)),
                 "acceptance": [round(a, 3) for a in cls.effective()], "seen": list(cls.seen),
                 "prefill_rows": kwargs.get("prefill_rows", 0)}
        if "costs" in seen:
            entry["costs_ms"] = {s.name: round(ms, 4) for s, ms in seen["costs"].items()}
        if "slowest_rows" in seen:
            chain, tree = seen["slowest_rows"]
            entry["slowest_rows_tokens"] = [round(x, 3) for x in chain]
        log.append(entry)
        return shape

    policy._effective_costs, policy._slowest_rows_progress, policy.choose = costs, progress, choose


def traced_times(policy, log):
    """Wraps `observe_time` and `observe_dormant_time`: each online step time the policy is told (start-up
    timings left out), as [option or "dormant", padded batch, sampling mode, ms], in arrival order."""
    real_time, real_dormant = policy.observe_time, policy.observe_dormant_time

    def observe_time(padded_batch, shape, ms, weight=None, mode="greedy"):
        if weight is None:
            log.append([shape.name, padded_batch, mode, round(ms, 4)])
        return real_time(padded_batch, shape, ms, weight=weight, mode=mode)

    def observe_dormant_time(padded_batch, ms, weight=None, mode="greedy"):
        if weight is None:
            log.append(["dormant", padded_batch, mode, round(ms, 4)])
        return real_dormant(padded_batch, ms, weight=weight, mode=mode)

    policy.observe_time, policy.observe_dormant_time = observe_time, observe_dormant_time


def traced_acceptance(policy, by_step):
    """Wraps `observe_step`: position 1's hits by each request's drafting-step number."""
    real_observe = policy.observe_step
    steps = {}

    def observe_step(shape, request_ids, accept_lens):
        if shape.drafts:
            for rid, k in zip(request_ids, accept_lens):
                if rid not in policy.dormant:
                    n = steps[rid] = steps.get(rid, -1) + 1
                    by_step.setdefault(n, []).append(int(k > 1))
        return real_observe(shape, request_ids, accept_lens)

    policy.observe_step = observe_step


def main():
    ap = argparse.ArgumentParser()
    add_batch_arguments(ap)
    ap.add_argument("--choices", action="store_true", help="trace every step's choice too")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    engine = Engine(**demo_engine_kwargs(ns.batch_sizes, ns.input_len, ns.output_len))
    log, choices, by_step, times = [], [], {}, []
    policy = engine.runner.spec.policy
    traced(policy, log)
    if ns.choices:
        traced_choices(policy, choices)
        traced_times(policy, times)
    traced_acceptance(policy, by_step)
    runs = []
    try:
        for b in ns.batch_sizes:
            prompts = random_prompts(b, ns.input_len, engine.arch.vocab_size, seed=0)
            if ns.warmup_len:
                run_batch(engine, prompts, ns.warmup_len)
            for i in range(ns.runs):
                start, first_choice, first_time = len(log), len(choices), len(times)
                by_step.clear()
                metrics, _ = run_batch(engine, prompts, ns.output_len)
                admitted = log[start:]
                runs.append({"batch": b, "run": i, "iteration_ms": metrics.iteration_ms,
                             "steps_by_depth": metrics.steps_by_depth, "dormant": sum(e["dormant"] for e in admitted),
                             "first_admission": admitted[0] if admitted else None,
                             # step number -> [rows that drafted then, of them accepting position 1]
                             "position1_by_step": {n: [len(h), sum(h)] for n, h in sorted(by_step.items())}})
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "position1_by_step"}), flush=True)
                if ns.choices:
                    runs[-1]["choices"] = choices[first_choice:]
                    runs[-1]["step_times"] = times[first_time:]
    finally:
        engine.shutdown()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"tool": "bench/admission_trace.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "commit": report.revision(),
                       "command": "python " + " ".join(sys.argv), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
