"""The adaptive policy's host time per step (observe the step, choose the next), two revisions side by side.

The policy runs on the host every step, so on a host-bound engine (the demo pair on an H200) its time is
the step's. This times `DepthPolicy.observe_step` + `choose` for a batch of new requests over their first
drafting steps (chains of three; every request accepts one draft a step), the current tree's policy
against another revision's `src` (each in its own process, taking turns), and reports the fastest of
--trials per revision and batch size (the machine's noise is one-sided).

git archive REV src | tar -x -C /tmp/old
python bench/policy_host_cost.py --other-src /tmp/old/src --other-label REV \
    --out bench/results/policy_host_cost_cpu.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from tandem.speculative.policy import DepthPolicy, DraftShape
batch, steps, trials = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
best = float("inf")
for _ in range(trials):
    p = DepthPolicy(3, tree=False)
    for shape, ms in zip(p.options, (5.0, 6.0, 7.0, 8.0)):
        p.observe_time(batch, shape, ms, weight=1.0)
    rids = [f"r{i}" for i in range(batch)]
    t0 = time.perf_counter()
    for _ in range(steps):
        p.observe_step(DraftShape(3), rids, [2] * batch)
        p.choose(rids, batch)
    best = min(best, (time.perf_counter() - t0) / steps * 1e6)
print(best)
"""


def time_one(src: str, batch: int, steps: int, trials: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, src, str(batch), str(steps), str(trials)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other-src", required=True, help="another revision's src directory")
    ap.add_argument("--other-label", default="other", help="what the other revision is (recorded in --out)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--steps", type=int, default=6, help="drafting steps timed (a request's first ones: < 8)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="turns of the two revisions per batch size")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    sources = {"this tree": os.path.join(HERE, "..", "src"), ns.other_label: ns.other_src}
    rows = []
    for b in ns.batch_sizes:
        us = {name: [] for name in sources}
        for _ in range(ns.rounds):
            for name, src in sources.items():
                us[name].append(time_one(src, b, ns.steps, ns.trials))
        row = {"batch": b, **{f"{name} us": round(min(v), 1) for name, v in us.items()}}
        row["ratio"] = round(row["this tree us"] / row[f"{ns.other_label} us"], 3)
        rows.append(row)
        print(row, flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"tool": "bench/policy_host_cost.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": ["bench/policy_host_cost.py", "--other-src", f"<{ns.other_label}>/src"],
                       "steps": ns.steps, "trials": ns.trials, "rounds": ns.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
