"""Why a batch keeps (or drops) its drafts: the adaptive engine alone, run through the sampling benchmark's
sequence (bench/sampling_bench.py: each batch size, each sampling mode, a warm-up then --repeats runs),
with every admission and demotion judgment of the policy recorded: the batch size, the sampling class,
whether its estimate was settled, the best drafting option's expected tokens per ms, the dormant step's
cost it was weighed against, and the answer.

python bench/dormancy_probe.py --out dormancy.json [--batch-sizes 1 8] [--repeats 5]
    [--device cpu]

Prints, per mode and batch size, each run's steps by depth, dormant counts and the first judgments.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from sampling_bench import MODES, engine_kwargs  # noqa: E402

from tandem import Engine  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.measure import random_prompts, run_batch  # noqa: E402
from tandem.speculative.policy import GREEDY_MODE, expected_by_depth  # noqa: E402


def judgment(policy, table, sampled: bool, upkeep_ms: float, answer: bool, slowest=None) -> dict:
    """What `_drafting_cannot_pay` weighed at a cost table (padded batch and sampling mode), recomputed from
    the policy's state (for the record)."""
    cls = policy.rates_by_class[sampled]
    costs = {s.name: round(policy.cost_ms[(table, s)], 4) for s in policy.options if (table, s) in policy.cost_ms}
    estimated = expected_by_depth(cls.effective())
    optimistic = expected_by_depth(policy.optimistic_acceptance(sampled))
    timed = len(costs) == len(policy.options)
    weighed = policy._floored_costs(table) if timed else {}  # (the costs the policy weighs)
    best = {}
    for name, expected in (("estimated", estimated), ("optimistic", optimistic)):
        best[name] = (round(max(expected[s.depth] / weighed[s] for s in policy.options if s.drafts), 3)
                      if timed else None)
    dormant = policy.dormant_cost_ms.get(table)
    batch, mode = (table, GREEDY_MODE) if isinstance(table, int) else (table[1], table[0])
    return {"batch": batch, "mode": mode, "sampled": sampled, "seen_1": cls.seen[0],
            "rates": [round(r, 3) for r in cls.effective()], "costs": costs,
            "dormant_ms": round(dormant, 4) if dormant is not None else None, "upkeep_ms": round(upkeep_ms, 4),
            "dormant_step_ms": (round(policy.dormant_step_ms(table, costs.get("chain0", 0.0)), 4)
                                if costs else None),
            "slowest_row": [round(e, 3) for e in slowest] if slowest is not None else None,
            "best_tokens_per_ms": best, "cannot_pay": answer}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None)
    ns = ap.parse_args()
    kw = engine_kwargs("demo", "", max(ns.batch_sizes), ns.input_len + ns.output_len + 16)
    if ns.device:
        kw["device"] = ns.device
    engine = Engine(**kw)
    policy = engine.runner.spec.policy
    log: list[dict] = []
    cannot_pay = policy._drafting_cannot_pay

    def traced(table, upkeep_ms=0.0, sampled=False, slowest=None):
        answer = cannot_pay(table, upkeep_ms, sampled, slowest)
        log.append(judgment(policy, table, sampled, upkeep_ms, answer, slowest))
        return answer

    policy._drafting_cannot_pay = traced
    vocab = engine.arch.vocab_size
    result = {"tool": "bench/dormancy_probe.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": ["python", *sys.argv], "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "points": []}
    try:
        for b in ns.batch_sizes:
            prompts = random_prompts(b, ns.input_len, vocab, seed=0)
            for mode, params in MODES.items():
                run_batch(engine, prompts, 8, **params)  # the benchmark's warm-up at this shape
                for rep in range(ns.repeats):
                    log.clear()
                    m, _ = run_batch(engine, prompts, ns.output_len, **params)
                    point = {"mode": mode, "batch": b, "run": rep, "tokens_per_s": round(m.tokens_per_s, 1),
                             "steps_by_depth": m.steps_by_depth, "admitted_dormant": m.dormant_admitted,
                             "demoted": m.dormant_demoted, "dormant_steps": m.dormant_steps,
                             "costs": m.policy_costs_ms, "judgments": list(log[:6]), "judgments_total": len(log)}
                    result["points"].append(point)
                    print(f"{mode}@{b} run {rep}: {point['tokens_per_s']} tok/s, depth {m.steps_by_depth}, "
                          f"admitted dormant {m.dormant_admitted}, demoted {m.dormant_demoted}, "
                          f"dormant steps {m.dormant_steps}", flush=True)
                    for j in log[:3]:
                        print("    ", j, flush=True)
    finally:
        engine.shutdown()
    report.write_json(result, ns.out)  # (compact, paths relative to the checkout: the repository's records)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
