"""The host's side of a dormant request's first token, speculation against plain decoding, on a CPU.

On an H200 (8B shape, batch 1, acceptance 0) a dormant request's first step, the eager prefill's launch,
took 22-34 ms against plain decoding's 15-26 ms, and that first token is most of what acceptance 0 loses at
small batches (docs/performance.md). The launch waits on the host (Python and kernel dispatch), so this
probe asks whether the speculative prefill path does more host work: a model of the 8B shape's depth
(32 layers) and a tiny width, on a CPU, where a step's time is mostly Python and dispatch, as the eager
prefill launch's is on the GPU. Both engines are held at once and their requests take turns; speculation
runs with synthetic acceptance 0 and every request admitted dormant. It prints, per engine, the medians
of the first two steps' wall times and of the decode iteration, and the Python calls of one prefill step
(cProfile), and writes them to --out.

OMP_NUM_THREADS=1 PYTHONPATH=src python bench/prefill_host_probe.py --out bench/results/prefill_host_probe_cpu.json
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import presets, synthetic  # noqa: E402
from tandem.bench.measure import admit_every_request_dormant, random_prompts, run_batch  # noqa: E402


def prefill_calls(engine, prompt: list[int]) -> int:
    """Python function calls of the step that launches one request's prefill."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    profile = cProfile.Profile()
    profile.enable()
    engine.step()
    profile.disable()
    while engine.has_unfinished():
        engine.step()
    return pstats.Stats(profile).total_calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    presets.PRESETS["host-probe"] = dict(presets.PRESETS["tiny-test"], num_hidden_layers=ns.layers)
    target, head = presets.write_preset("host-probe", tempfile.mkdtemp())
    kw = dict(device="cpu", load_format="dummy", max_running_requests=1,
              context_length=ns.input_len + ns.output_len + 16)
    engines = {"speculative, dormant": Engine(target, speculative_algorithm="EAGLE3",
                                              speculative_draft_model_path=head, **kw),
               "plain": Engine(target, **kw)}
    spec = engines["speculative, dormant"]
    synthetic.install(spec, 0.0)
    admit_every_request_dormant(spec)  # what acceptance 0 settles to
    vocab = spec.arch.vocab_size
    for engine in engines.values():  # warm-up
        for _ in range(5):
            run_batch(engine, random_prompts(1, ns.input_len, vocab, seed=1), ns.output_len)
    runs = {name: [] for name in engines}
    for r in range(ns.rounds):
        for name, engine in engines.items():
            m, _ = run_batch(engine, random_prompts(1, ns.input_len, vocab, seed=100 + r), ns.output_len)
            runs[name].append(m)
        print(f"round {r + 1}/{ns.rounds}", end="\r", file=sys.stderr, flush=True)
    result = {"tool": "bench/prefill_host_probe.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": sys.argv, "layers": ns.layers, "input_len": ns.input_len, "output_len": ns.output_len,
              "rounds": ns.rounds, "engines": {}}
    for name, engine in engines.items():
        ms = runs[name]
        row = {"first_step_ms": statistics.median(m.first_token_steps_ms[0] for m in ms),
               "second_step_ms": statistics.median(m.first_token_steps_ms[1] for m in ms),
               "ttft_ms": statistics.median(m.ttft_ms for m in ms),
               "iteration_ms": statistics.median(m.iteration_ms for m in ms),
               "prefill_step_python_calls": prefill_calls(engine, random_prompts(1, ns.input_len, vocab, seed=7)[0])}
        result["engines"][name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(f"{name:22s} " + "  ".join(f"{k} {v}" for k, v in result["engines"][name].items()))
    for engine in engines.values():
        engine.shutdown()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
