"""`tandem bench` with every request of the speculative engine admitted dormant (each step plain decoding's
step, `admit_every_request_dormant`): the ratio a perfect admission policy would get in the benchmark's own
harness, where only the two engines' instances and host paths differ. A measurement, not a mode.

OMP_NUM_THREADS=1 PYTHONPATH=src python bench/all_dormant_bench.py --device cpu --batch-sizes 1 4 \
    --input-len 64 --output-len 64 --repeats 7 --out bench/results/all_dormant.json --no-progress --no-plots

Takes `tandem bench`'s arguments (the command recorded in the JSON is `tandem bench`'s).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import tandem  # noqa: E402
from tandem.bench.measure import admit_every_request_dormant  # noqa: E402
from tandem.cli import main  # noqa: E402

Engine = tandem.Engine


def dormant_engine(*args, **kwargs):
    """An Engine; a speculative one admits every request dormant from its first (its warm-up included)."""
    engine = Engine(*args, **kwargs)
    if engine.runner.spec is not None:
        admit_every_request_dormant(engine)
    return engine


if __name__ == "__main__":
    tandem.Engine = dormant_engine  # (the benchmark builds its engines through `from tandem import Engine`)
    raise SystemExit(main(["bench", *sys.argv[1:]]))
