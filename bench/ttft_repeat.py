"""Time to first token at batch 1, repeated: how much one measurement of it can be trusted.

`tandem bench` times each batch size once, so its time to first token is one sample. This script
builds the engines as `tandem bench` does (Llama-3.1-8B shape, random weights, synthetic acceptance
for speculation), sized for batch sizes (1,) and (1, 8, 32), warms up at each batch size, then
measures single requests three ways: through `run_batch` (the bench's own timing, 128 output
tokens), step by step with 128 output tokens, and step by step with 16. Per request it records the
time to first token and the wall time of each `engine.step()` up to it (ms).

PYTHONPATH=src python bench/ttft_repeat.py --out bench/results/ttft_repeat_h200.json
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench import synthetic  # noqa: E402
from tandem.bench.measure import random_prompts, run_batch  # noqa: E402
from tandem.bench.run import BenchConfig, resolve_engine_kwargs  # noqa: E402
from ttft_profile import steps_to_first_token  # noqa: E402  (beside this script: bench/ is on sys.path)

INPUT_LEN = 128


def first_token(engine, prompt, output_len):
    """(time to first token ms, wall ms of each step up to it) for one request run to its end."""
    walls, first_ms = steps_to_first_token(engine, prompt, output_len)
    return round(first_ms, 2), walls


def measure(kw, speculative, sizes):
    engine = Engine(**kw)
    try:
        if speculative:
            synthetic.install(engine, 0.81, seed=0)
        vocab = engine.arch.vocab_size
        for b in sizes:  # warm-up at every batch size, as `tandem bench` does
            run_batch(engine, random_prompts(b, INPUT_LEN, vocab, seed=10_007), 8)
        prompt = lambda seed: random_prompts(1, INPUT_LEN, vocab, seed=seed)  # noqa: E731
        return {"run_batch_ttft_ms": [round(run_batch(engine, prompt(s), 128)[0].ttft_ms, 2) for s in range(3)],
                "steps_out128": [first_token(engine, prompt(100 + s)[0], 128) for s in range(3)],
                "steps_out16": [first_token(engine, prompt(200 + s)[0], 16) for s in range(2)]}
    finally:
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    results = {}
    for sizes in [(1,), (1, 8, 32)]:
        cfg = BenchConfig(engine_kwargs={"device": "cuda", "attention_backend": "triton"}, preset="llama-3.1-8b",
                          batch_sizes=sizes, input_len=INPUT_LEN, output_len=128, synthetic_acceptance=0.81)
        with tempfile.TemporaryDirectory() as d:
            spec_kw = resolve_engine_kwargs(cfg, d)
            plain_kw = dict(spec_kw, speculative_algorithm=None, speculative_draft_model_path=None)
            for mode, kw in (("spec", spec_kw), ("plain", plain_kw)):
                key = f"{mode} sizes={sizes}"
                results[key] = measure(kw, mode == "spec", sizes)
                print(key, json.dumps(results[key]), flush=True)
    if ns.out:
        record = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "command": "python " + " ".join(sys.argv), "results": results}
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
