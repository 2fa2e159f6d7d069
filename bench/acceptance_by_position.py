"""Acceptance by position in the answer: does a pair's acceptance rise, fall or stay flat along each answer?

    python bench/acceptance_by_position.py --pair smollm2-135m-instruct --temperatures 0 0.7 --out real.json
    python bench/acceptance_by_position.py --pair demo --temperatures 0 1 --out demo.json

Every prompt at once at fixed depth (an EAGLE-3 chain of 3, adaptive depth off, float32), seeded when sampled.
Each request's verify steps are numbered from its first drafting step, and grouped into buckets of step
numbers (0-3, 4-7, 8-15, 16-31, 32-63, 64 and on). For each bucket: the verify steps in it, the share that
accepted draft position 1, and the mean accept length (accepted drafts + 1). An acceptance model by position
in the answer would pay only if the buckets differ in the same direction across pairs.

The real pair answers held-out prompts through its chat template, and stops at its end-of-sequence token
unless --ignore-eos; the demo pair answers random prompts (its weights are random, so it never says more
than a pattern).
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402

DEFAULT_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "smollm2-heldout-prompts.jsonl")
BUCKET_STARTS = (0, 4, 8, 16, 32, 64)


def bucket_of(step: int) -> int:
    return max(i for i, start in enumerate(BUCKET_STARTS) if step >= start)


def bucket_name(i: int) -> str:
    end = BUCKET_STARTS[i + 1] - 1 if i + 1 < len(BUCKET_STARTS) else None
    return f"{BUCKET_STARTS[i]}-{end}" if end is not None else f"{BUCKET_STARTS[i]}+"


def by_position(accept_lengths_per_request: list[list[int]]) -> list[dict]:
    """Buckets of verify-step numbers: steps, position 1's acceptance share, mean accept length."""
    groups: list[list[int]] = [[] for _ in BUCKET_STARTS]
    for lengths in accept_lengths_per_request:
        for step, length in enumerate(lengths):
            groups[bucket_of(step)].append(length)
    return [{"steps": bucket_name(i), "verify_steps": len(g),
             "position1_accepted": round(sum(x > 1 for x in g) / len(g), 4) if g else None,
             "mean_accept_length": round(sum(g) / len(g), 4) if g else None}
            for i, g in enumerate(groups)]


def real_prompts(pair: str, path: str, count: int) -> tuple[str, str, list[list[int]]]:
    from tandem.named_models import model_paths
    from tandem.train.instruction_set import read_prompts
    from tandem.train.self_distill import prompt_ids

    target, head = model_paths(pair)
    every = read_prompts(path)
    kinds = sorted({p.kind for p in every})  # the same number of each kind, in turn
    per_kind = [[p for p in every if p.kind == k] for k in kinds]
    prompts = [group[i] for i in range(count // len(kinds)) for group in per_kind]
    with Engine(target, device="cpu", dtype="float32", max_total_tokens=256) as engine:
        return target, head, [prompt_ids(engine.tokenizer, p) for p in prompts]


def demo_prompts(count: int, length: int, seed: int = 0) -> tuple[str, str, list[list[int]]]:
    from tandem.demo import demo_model_paths

    target, head = demo_model_paths()
    rng = random.Random(seed)
    return target, head, [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def measure(target, head, ids, temperature, max_new_tokens, ignore_eos, device) -> dict:
    with Engine(target, device=device, dtype="float32", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=head, speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4, speculative_adaptive="off", max_running_requests=len(ids),
                max_total_tokens=len(ids) * (max(map(len, ids)) + max_new_tokens + 64)) as engine:
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i,
                                 ignore_eos=ignore_eos) for i in range(len(ids))]
        outs = engine.generate(input_ids=ids, sampling_params=params)
    lengths = [o.spec_accept_lengths for o in outs]
    every = [x for xs in lengths for x in xs]
    return {"temperature": temperature, "output_tokens": sum(len(o.token_ids) for o in outs),
            "mean_accept_length": round(sum(every) / max(1, len(every)), 4),
            "buckets": by_position(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m-instruct", help="a named model with its head, or demo")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="held-out prompts (the real pair)")
    ap.add_argument("--num-prompts", type=int, default=48, help="the real pair: an equal share of each kind")
    ap.add_argument("--input-len", type=int, default=128, help="random prompt length (the demo pair)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    if ns.pair == "demo":
        target, head, ids = demo_prompts(ns.num_prompts, ns.input_len)
    else:
        target, head, ids = real_prompts(ns.pair, ns.prompts, ns.num_prompts)
    result = {"tool": "bench/acceptance_by_position.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "commit": report.revision(), "command": ["python", *sys.argv], "pair": ns.pair,
              "device": ns.device, "prompts": len(ids), "shape": "EAGLE-3 chain of 3, fixed depth",
              "max_new_tokens": ns.max_new_tokens, "ignore_eos": ns.ignore_eos, "rows": []}
    for t in ns.temperatures:
        start = time.perf_counter()
        row = measure(target, head, ids, t, ns.max_new_tokens, ns.ignore_eos, ns.device)
        result["rows"].append(row)
        cells = "  ".join(f"{b['steps']}: {b['position1_accepted']} ({b['mean_accept_length']}, n={b['verify_steps']})"
                          for b in row["buckets"])
        print(f"T={t} ({time.perf_counter() - start:.0f} s), position 1 (accept length, steps) by step: {cells}",
              flush=True)
    report.write_json(result, ns.out)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
