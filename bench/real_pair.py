"""A real trained pair on real prompts: acceptance of an EAGLE-3 head per draft position, and speculative
against plain decoding speed, on held-out prompts the head never saw.

    python bench/real_pair.py --out real-pair.json [--model-path smollm2-135m-instruct] [--draft DIR]
        [--prompts bench/data/smollm2-heldout-prompts.jsonl] [--device cpu] [--skip-speed]

Acceptance: every prompt at once, fixed depth (a chain of 3, and a tree of at most 16 nodes), greedy and at
temperature 0.7 (seeded); from each verify step's accept length: the share of steps that accepted draft
position k, the rate at k given k-1 accepted (what `tandem bench --synthetic-acceptance-profile` replays),
and the mean acceptance length, overall and per prompt kind. Speed: adaptive depth on, greedy, the same
prompts one at a time (batch 1) and four at a time (batch 4), each batch run with speculation and then
without, back to back (paired): output tokens per second of each, their ratio per pair, and the total.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.named_models import model_paths  # noqa: E402
from tandem.train.instruction_set import read_prompts  # noqa: E402
from tandem.train.self_distill import prompt_ids  # noqa: E402

DEFAULT_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "smollm2-heldout-prompts.jsonl")
SHAPES = {  # name -> (speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens)
    "chain3": (3, 1, 4),
    "tree6": (3, 2, 6),
    "tree8": (4, 2, 8),
    "tree16": (4, 4, 16),
}


def acceptance(lengths: list[int], depth: int) -> dict:
    """Per-position shares and conditional rates from verify steps' accept lengths (accepted drafts + 1)."""
    n = max(1, len(lengths))
    reached = [sum(1 for x in lengths if x > k) / n for k in range(depth + 1)]  # reached[0] == 1
    return {"verify_steps": len(lengths), "mean_accept_length": round(sum(lengths) / n, 4),
            "accepted_share": [round(r, 4) for r in reached[1:]],
            "conditional_rate": [round(reached[k] / reached[k - 1], 4) if reached[k - 1] else None
                                 for k in range(1, depth + 1)]}


def measure_acceptance(target, draft, prompts, ids, shape, temperature, max_new_tokens, device) -> dict:
    steps, topk, nodes = SHAPES[shape]
    with Engine(target, device=device, dtype="float32", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=draft, speculative_num_steps=steps, speculative_eagle_topk=topk,
                speculative_num_draft_tokens=nodes, speculative_adaptive="off", max_running_requests=64,
                max_total_tokens=64 * (max(map(len, ids)) + max_new_tokens + 64)) as engine:
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i)
                  for i in range(len(ids))]
        outs = engine.generate(input_ids=ids, sampling_params=params)
    by_kind: dict[str, list[int]] = {}
    for p, out in zip(prompts, outs):
        by_kind.setdefault(p.kind, []).extend(out.spec_accept_lengths)
    every = [x for xs in by_kind.values() for x in xs]
    return {"shape": shape, "num_steps": steps, "topk": topk, "num_draft_tokens": nodes,
            "temperature": temperature, "prompts": len(ids),
            "output_tokens": sum(len(o.token_ids) for o in outs), **acceptance(every, steps),
            "by_kind": {k: acceptance(v, steps) for k, v in sorted(by_kind.items())}}


def measure_speed(target, draft, ids, batch, max_new_tokens, device, shape="chain3", adaptive=True) -> dict:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    common = dict(device=device, dtype="float32", max_running_requests=max(4, batch),
                  max_total_tokens=8 * (max(map(len, ids)) + max_new_tokens + 64))
    steps, topk, nodes = SHAPES[shape]
    spec = Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                  speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes,
                  speculative_adaptive=adaptive, **common)
    plain = Engine(target, **common)
    pairs = []
    try:
        for engine in (spec, plain):  # warm-up: first-call costs
            engine.generate(input_ids=ids[:batch], sampling_params=SamplingParams(max_new_tokens=8))
        for i in range(0, len(ids) - batch + 1, batch):
            group, row = ids[i:i + batch], {}
            for name, engine in (("spec", spec), ("plain", plain)):
                start = time.perf_counter()
                outs = engine.generate(input_ids=group, sampling_params=params)
                wall = time.perf_counter() - start
                row[name] = {"tokens": sum(len(o.token_ids) for o in outs), "wall_s": round(wall, 4)}
                if name == "spec":
                    row["accept_lengths"] = [x for o in outs for x in o.spec_accept_lengths]
            row["ratio"] = round((row["spec"]["tokens"] / row["spec"]["wall_s"])
                                 / (row["plain"]["tokens"] / row["plain"]["wall_s"]), 4)
            pairs.append(row)
            print(f"  batch {batch}, group {i // batch}: spec/plain {row['ratio']:.3f}", flush=True)
    finally:
        spec.shutdown()
        plain.shutdown()
    total = {name: sum(p[name]["tokens"] for p in pairs) / sum(p[name]["wall_s"] for p in pairs)
             for name in ("spec", "plain")}
    lengths = [x for p in pairs for x in p.pop("accept_lengths")]
    ratios = sorted(p["ratio"] for p in pairs)
    return {"batch_size": batch, "shape": shape, "adaptive": adaptive, "groups": len(pairs),
            "spec_tokens_per_s": round(total["spec"], 3),
            "plain_tokens_per_s": round(total["plain"], 3), "speedup": round(total["spec"] / total["plain"], 4),
            "pair_ratio_min": ratios[0], "pair_ratio_median": ratios[len(ratios) // 2], "pair_ratio_max": ratios[-1],
            "mean_accept_length": round(sum(lengths) / max(1, len(lengths)), 4), "pairs": pairs}


def cpu_host() -> dict:
    """What the speed rows depend on, so records from different hosts can be told apart: the processor's name
    and one float32 GEMM the size of the target's lm_head (49,152 x 576) at 1 and 4 rows, the rows of a plain
    step and of a chain-of-3 verify (on some hosts 4 rows cost twice 1 row, and speculation gains little)."""
    name = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    weight = torch.randn(49152, 576)
    gemm_ms = {}
    for rows in (1, 4):
        x = torch.randn(rows, 576)
        torch.nn.functional.linear(x, weight)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - start)
        gemm_ms[rows] = round(best * 1e3, 3)
    return {"cpu": name, "threads": torch.get_num_threads(), "lm_head_gemm_ms_by_rows": gemm_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="the EAGLE-3 head (default: the named model's own)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--speed-prompts", type=int, default=8, help="prompts timed at each batch size")
    ap.add_argument("--speed-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--speed-max-new-tokens", type=int, default=128)
    ap.add_argument("--speed-shapes", nargs="+", default=["chain3"], choices=list(SHAPES),
                    help="drafting the speed runs configure (adaptive depth chooses among its chains and the tree)")
    ap.add_argument("--speed-fixed", action="store_true", help="speed runs at fixed depth (adaptive depth off)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    target, draft = ns.model_path, ns.draft
    if os.path.isdir(target) is False:
        target, head = model_paths(ns.model_path)
        draft = draft or head
    if draft is None:
        raise SystemExit("no EAGLE-3 head: pass --draft")
    prompts = read_prompts(ns.prompts)
    with Engine(target, device=ns.device, dtype="float32", max_total_tokens=256) as engine:
        ids = [prompt_ids(engine.tokenizer, p) for p in prompts]
    result = {"tool": "bench/real_pair.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": report.revision(),
              "command": ["python", *sys.argv], "model_path": ns.model_path, "draft": os.path.basename(draft),
              "device": ns.device, "threads": os.environ.get("OMP_NUM_THREADS"), "prompts": len(prompts),
              "kinds": {k: sum(p.kind == k for p in prompts) for k in sorted({p.kind for p in prompts})},
              "host": cpu_host() if ns.device == "cpu" else None, "acceptance": [], "speed": []}
    if not ns.skip_acceptance:
        for shape in ns.shapes:
            for t in ns.temperatures:
                row = measure_acceptance(target, draft, prompts, ids, shape, t, ns.max_new_tokens, ns.device)
                result["acceptance"].append(row)
                print(f"{shape} T={t}: mean length {row['mean_accept_length']:.3f}, per position "
                      f"{row['accepted_share']}, conditional {row['conditional_rate']}", flush=True)
    if not ns.skip_speed:
        # One prompt of each kind in turn, so each batch mixes kinds.
        kinds = sorted({p.kind for p in prompts})
        order = [i for group in zip(*[[i for i, p in enumerate(prompts) if p.kind == k] for k in kinds])
                 for i in group][:ns.speed_prompts]
        for shape, batch in [(s, b) for s in ns.speed_shapes for b in ns.speed_batches]:
            row = measure_speed(target, draft, [ids[i] for i in order], batch, ns.speed_max_new_tokens, ns.device,
                                shape, adaptive=not ns.speed_fixed)
            result["speed"].append(row)
            print(f"{shape}, batch {batch}: spec {row['spec_tokens_per_s']:.1f} tok/s, "
                  f"plain {row['plain_tokens_per_s']:.1f}"
                  f" tok/s, {row['speedup']:.3f}x (pairs {row['pair_ratio_min']}-{row['pair_ratio_max']}), "
                  f"accept length {row['mean_accept_length']:.2f}", flush=True)
    report.write_json(result, ns.out)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
