"""One grid from two `tandem bench --sweep` results: every point of the first, and the points it lacks from
the second (a sweep cut short by a time limit keeps the points it measured: `complete` is false). Each
point's three engines still ran side by side in one run; the merged file says which file gave what, and
its worst points and heatmaps are redrawn.

    python bench/merge_sweeps.py FIRST.json SECOND.json --out MERGED.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem.bench.sweep import _save, plot_heatmaps, worst_points  # noqa: E402


def key(point: dict) -> tuple:
    return point["temperature"], point["acceptance"], point["batch_size"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    with open(ns.first) as f:
        first = json.load(f)
    with open(ns.second) as f:
        second = json.load(f)
    have = {key(p) for p in first["points"]}
    added = [p for p in second["points"] if key(p) not in have]
    merged = dict(first, points=first["points"] + added, json=ns.out)
    keys = {key(p) for p in merged["points"]}
    temperatures, acceptances, sizes = ({k[i] for k in keys} for i in range(3))
    merged["complete"] = len(keys) == len(temperatures) * len(acceptances) * len(sizes)  # every combination
    merged["merged"] = {"points_from_first": [os.path.basename(ns.first), len(first["points"])],
                        "points_from_second": [os.path.basename(ns.second), [list(key(p)) for p in added]]}
    merged["worst"] = worst_points(merged["points"])
    merged["plots"] = plot_heatmaps(merged, os.path.splitext(ns.out)[0])
    _save(merged, ns.out)
    print(f"{len(first['points'])} points from {ns.first}, {len(added)} from {ns.second}; "
          f"complete: {merged['complete']}; worst: {merged['worst']}")


if __name__ == "__main__":
    main()
