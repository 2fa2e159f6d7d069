"""`tandem bench` with the adaptive policy's sentinels off: what the sentinel rule (one request in
SENTINEL_EVERY keeps its draft while the others run dormant) costs a benchmark. A measurement, not a mode:
without sentinels nothing notices acceptance rising once every request is dormant.

OMP_NUM_THREADS=1 PYTHONPATH=src python bench/no_sentinel_bench.py --device cpu --batch-sizes 1 4 \
    --input-len 64 --output-len 64 --repeats 7 --out bench/results/no_sentinel.json --no-progress --no-plots

Takes `tandem bench`'s arguments (the command recorded in the JSON is `tandem bench`'s).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import tandem.speculative.policy as policy  # noqa: E402
from tandem.cli import main  # noqa: E402

if __name__ == "__main__":
    policy.SENTINEL_EVERY = 10**9  # (read at every admission)
    raise SystemExit(main(["bench", *sys.argv[1:]]))
