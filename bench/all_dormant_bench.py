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
import tandem.bench.run as run  # noqa: E402
from tandem.bench.measure import admit_every_request_dormant, random_prompts, run_batch  # noqa: E402
from tandem.cli import main  # noqa: E402

plain_or_spec_engine = run._bench_engine


def dormant_bench_engine(cfg, mode, spec_kw, plain_kw):
    """`run._bench_engine`, with the speculative engine's requests dormant from its warm-up on."""
    if mode != "spec_on":
        return plain_or_spec_engine(cfg, mode, spec_kw, plain_kw)
    from tandem import Engine

    engine = Engine(**spec_kw)
    admit_every_request_dormant(engine)
    if cfg.warmup:
        for b in cfg.batch_sizes:
            run_batch(engine, random_prompts(b, cfg.input_len, engine.arch.vocab_size, seed=10_007),
                      min(cfg.output_len, 8), cfg.temperature, cfg.top_p, cfg.json_schema)
    return engine


if __name__ == "__main__":
    run._bench_engine = dormant_bench_engine
    raise SystemExit(main(["bench", *sys.argv[1:]]))
