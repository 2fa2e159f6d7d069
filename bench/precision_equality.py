"""Does speculation give plain decoding's tokens? Greedy and seeded requests, speculation against plain
decoding on the same weights, in one dtype: the share of requests whose tokens are equal and where the
others first differ.

In float32 they are equal token for token. In bf16 and fp16 a verify forward over k+1 tokens and a decode
over one round differently, and where the target's two best tokens are nearly tied the two can pick
different ones; from there the outputs go their own ways. This measures how often that happens.

Each model runs one plain engine and one engine per speculative configuration (`--configs`: a chain of 3 at
fixed depth, the same chain with adaptive depth, an EAGLE-2 tree of 8 tokens at fixed depth), one after the
other on the same weights (random weights are seeded), each over the same load: every prompt once greedy
and once seeded (temperature 0.8, top-p 0.95, seed 1000 + i), half the requests added one step after the
rest, so prompts and decodes share steps. "llama-3.1-8b" is random weights in that shape with a random
EAGLE-3 head (drafts are rarely accepted, but every verify step still computes the bonus token over k+1
tokens); "demo" is the bundled pair with its trained head, prompts cut from its held-out prompts.

    python bench/precision_equality.py --out precision.json        # bf16, 64 prompts x 256 tokens, GPU
    python bench/precision_equality.py --quick --out /tmp/p.json   # CPU, float32, demo pair, a few seconds

Prints a table and writes a compact JSON record (tandem.bench.report).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.measure import random_prompts  # noqa: E402
from tandem.bench.presets import PRESETS, write_preset  # noqa: E402
from tandem.demo import DEMO_DIR, demo_model_paths  # noqa: E402

CONFIGS = {
    "fixed": dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                  speculative_adaptive=False),
    "adaptive": dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                     speculative_adaptive=True),
    "tree": dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                 speculative_adaptive=False),
}
SEEDED = dict(temperature=0.8, top_p=0.95)


def model_kwargs(model: str, root: str) -> dict:
    if model == "demo":
        target, head = demo_model_paths()
        return dict(model_path=target, speculative_draft_model_path=head)
    target, head = write_preset(model, root)
    return dict(model_path=target, speculative_draft_model_path=head, load_format="dummy")


def make_prompts(model: str, n: int, vocab: int) -> list[list[int]]:
    """The demo pair: its held-out prompts, each cut to 32, 64, 96 and 128 tokens in turn (real text, a
    different prompt per request); random weights: random ids."""
    if model != "demo":
        return random_prompts(n, 64, vocab, seed=0)
    held_out = json.load(open(os.path.join(DEMO_DIR, "eval_prompts.json")))["prompts"]
    return [held_out[i % len(held_out)][:32 * (1 + (i // len(held_out)) % 4)] for i in range(n)]


def run_load(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, list]:
    """Every prompt greedy and seeded, interleaved, half of the requests one step late; the tokens of
    the greedy requests and of the seeded ones, in prompt order."""
    params = []
    for i in range(len(prompts)):
        params.append(SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
        params.append(SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=1000 + i, **SEEDED))
    load = [p for p in prompts for _ in (0, 1)]
    half = len(load) // 2
    rids = [engine.add_request(p, q) for p, q in zip(load[:half], params[:half])]
    engine.step()
    rids += [engine.add_request(p, q) for p, q in zip(load[half:], params[half:])]
    done = {}
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out.token_ids
    tokens = [done[r] for r in rids]
    return tokens[0::2], tokens[1::2]


def compare(reference: list[list[int]], got: list[list[int]]) -> dict:
    """How many requests equal the reference, and the first position each other one differs at."""
    first = []
    for want, have in zip(reference, got):
        if want != have:
            first.append(next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have))))
    return {"equal": len(reference) - len(first), "total": len(reference), "first_divergence": sorted(first)}


def measure(model: str, ns, root: str) -> dict:
    kw = dict(model_kwargs(model, root), device=ns.device, dtype=ns.dtype,
              max_running_requests=2 * ns.prompts, context_length=128 + ns.max_new_tokens + 16,
              cuda_graph_max_bs=min(2 * ns.prompts, 128),
              # A pool for the load alone (every request at full length, with room for drafts), not the
              # GPU's free memory: the measurement can share the GPU with other work.
              max_total_tokens=2 * ns.prompts * (128 + ns.max_new_tokens + 16 + 64))
    plain_kw = dict(kw, speculative_draft_model_path=None)
    engine = Engine(**plain_kw)
    prompts = make_prompts(model, ns.prompts, engine.arch.vocab_size)
    try:
        greedy_ref, seeded_ref = run_load(engine, prompts, ns.max_new_tokens)
    finally:
        engine.shutdown()
    out = {"configs": {}}
    for name in ns.configs:
        engine = Engine(**kw, speculative_algorithm="EAGLE3", **CONFIGS[name])
        try:
            t0 = time.perf_counter()
            greedy, seeded = run_load(engine, prompts, ns.max_new_tokens)
            out["configs"][name] = {"greedy": compare(greedy_ref, greedy), "seeded": compare(seeded_ref, seeded),
                                    "seconds": round(time.perf_counter() - t0, 2), **CONFIGS[name]}
        finally:
            engine.shutdown()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(f"  {model} {name}: {row(out['configs'][name])}", flush=True)
    return out


def row(r: dict) -> str:
    def part(c):
        firsts = c["first_divergence"]
        where = f" (first differs at {firsts[0]}, median {statistics.median(firsts):g})" if firsts else ""
        return f"{c['equal']}/{c['total']}{where}"
    return f"greedy {part(r['greedy'])}, seeded {part(r['seeded'])}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "demo"], choices=["demo", *PRESETS],
                    help="the demo pair, or random weights in a preset's shape")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--prompts", type=int, default=64, help="prompts (each runs greedy and seeded)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true",
                    help="a check on a CPU: the demo pair in float32, 4 prompts of 16 tokens, fixed and adaptive")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.models, ns.configs, ns.prompts, ns.max_new_tokens = ["demo"], ["fixed", "adaptive"], 4, 16
        ns.dtype, ns.device = "float32", "cpu"
    result = {"tool": "bench/precision_equality.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "commit": report.revision(), "command": ["python", "bench/precision_equality.py", *sys.argv[1:]],
              "device": torch.cuda.get_device_name(0) if ns.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "dtype": ns.dtype, "prompts": ns.prompts,
              "max_new_tokens": ns.max_new_tokens, "seeded": SEEDED, "models": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-precision-") as root:
        for model in ns.models:
            result["models"][model] = measure(model, ns, root)
    print(f"\n{ns.dtype}, {ns.prompts} prompts x {ns.max_new_tokens} tokens, speculation against plain decoding:")
    for model, m in result["models"].items():
        for name, r in m["configs"].items():
            print(f"  {model:<13} {name:<9} {row(r)}")
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    report.write_json(result, ns.out)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
