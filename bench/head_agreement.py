"""Where an EAGLE-3 head's acceptance is lost: the engine's acceptance against the head run teacher-forced by
the training code, on held-out prompts.

    python bench/head_agreement.py --out head-agreement.json [--model-path smollm2-135m-instruct] [--draft DIR]
        [--prompts bench/data/smollm2-heldout-prompts.jsonl] [--per-kind 12] [--max-new-tokens 96]

1. The engine decodes every prompt greedily (a chain of 3 at fixed depth) and keeps each verify step's
   accept length.
2. The training code's own forward (train/target.py, train/ttt.py: dense attention, no pages, no graphs)
   runs the target and the head teacher-forced over each prompt and its answer.
3. At the positions where the engine's verify steps began, the head's step-1 top-1 agreeing with the target
   must be exactly the engine accepting draft position 1: the same computation, paged instead of dense. A
   difference is a mismatch between how the head was trained and how the engine runs it.
4. Over every answer position: the agreement of TTT steps 1-3 with the target's greedy token, by prompt kind,
   and the share of the target's tokens inside the draft vocabulary (which bounds every step).

Compared with the agreement `tandem train-draft` reports on held-out documents of its own corpus (prompts of
the training subjects and templates), step 3's agreement here says how much of the gap is generalization to
new subjects and phrasings.
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
from tandem.models import llama  # noqa: E402
from tandem.models.loader import iter_checkpoint, load_weights  # noqa: E402
from tandem.named_models import model_paths  # noqa: E402
from tandem.train.head import build_head  # noqa: E402
from tandem.train.instruction_set import read_prompts  # noqa: E402
from tandem.train.self_distill import prompt_ids  # noqa: E402
from tandem.train.target import load_frozen_target, target_features  # noqa: E402
from tandem.train.ttt import ttt_forward  # noqa: E402

DEFAULT_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "smollm2-heldout-prompts.jsonl")
TTT_STEPS = 3


def engine_answers(target: str, draft: str, prompts, max_new_tokens: int) -> tuple[list[list[int]], list]:
    """Each prompt's token ids (through the chat template where its kind is chat) and the engine's output."""
    with Engine(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=draft, speculative_num_steps=TTT_STEPS, speculative_eagle_topk=1,
                speculative_num_draft_tokens=TTT_STEPS + 1, speculative_adaptive=False, max_running_requests=64,
                max_total_tokens=64 * (256 + max_new_tokens + 64)) as engine:  # (longer prompts queue)
        ids = [prompt_ids(engine.tokenizer, p) for p in prompts]
        return ids, engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=max_new_tokens,
                                                                                  temperature=0.0))


def load_head(draft: str, target, max_positions: int):
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    head = build_head(config, target, max_positions, "cpu")
    load_weights(head, iter_checkpoint(draft), llama.PACKED_MODULES, skip=frozenset({"embed_tokens.weight", "t2d"}))
    return head.float().eval()


def count(hits: int, n: int) -> dict:
    return {"hits": hits, "positions": n, "rate": round(hits / n, 4) if n else None}


@torch.no_grad()
def compare(target_dir: str, draft: str, prompts, ids, outs) -> dict:
    longest = max(len(p) + len(o.token_ids) for p, o in zip(ids, outs))
    target, _ = load_frozen_target(target_dir, "cpu", "float32", longest + 8)
    head = load_head(draft, target, longest + 8)
    draft_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
    in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    in_vocab[draft_ids] = True
    tally = {}  # kind -> counters

    def bump(kind, key, hit):
        for k in (kind, "all"):
            row = tally.setdefault(k, {})
            h, n = row.get(key, (0, 0))
            row[key] = (h + int(hit), n + 1)

    for prompt, p_ids, out in zip(prompts, ids, outs):
        seq = torch.tensor(p_ids + list(out.token_ids))[None]
        feats = target_features(target, seq, head.aux_layer_ids, draft_ids)
        hiddens = ttt_forward(head, seq, feats.aux, TTT_STEPS)
        # preds[j - 1][t]: step j's guess at position t, of the token after x[t + j] (the target's at t + j)
        preds = [head.to_target_ids(head.compute_logits(h[0]).argmax(-1)) for h in hiddens]
        greedy = feats.argmax[0]
        n_prompt, n_all = len(p_ids), seq.shape[1]
        for j, pred in enumerate(preds, start=1):
            for t in range(n_prompt - 1, n_all - 1 - j):  # the label, greedy[t + j], is an answer token
                bump(prompt.kind, f"step{j}", pred[t] == greedy[t + j])
        for t in range(n_prompt - 1, n_all - 1):
            bump(prompt.kind, "in_draft_vocab", in_vocab[greedy[t]])
        start = 0  # answer index of the token each verify step began from (the first came from the prefill)
        for length in out.spec_accept_lengths:
            t = n_prompt + start - 1
            if t + 2 < n_all:
                bump(prompt.kind, "engine_position1", length > 1)
                bump(prompt.kind, "teacher_forced_at_verify_starts", preds[0][t] == greedy[t + 1])
            start += length
    return {kind: {key: count(*v) for key, v in sorted(row.items())} for kind, row in sorted(tally.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="the EAGLE-3 head (default: the named model's own)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--per-kind", type=int, default=12, help="prompts of each kind, the first in the file")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    target, draft = ns.model_path, ns.draft
    if not os.path.isdir(target):
        target, head_dir = model_paths(ns.model_path)
        draft = draft or head_dir
    if draft is None:
        raise SystemExit("no EAGLE-3 head: pass --draft")
    prompts, taken = [], {}
    for p in read_prompts(ns.prompts):
        if taken.get(p.kind, 0) < ns.per_kind:
            prompts.append(p)
            taken[p.kind] = taken.get(p.kind, 0) + 1
    print(f"engine: {len(prompts)} prompts, greedy, chain of {TTT_STEPS}", flush=True)
    ids, outs = engine_answers(target, draft, prompts, ns.max_new_tokens)
    print("teacher-forced: the training code's forward over every prompt and answer", flush=True)
    by_kind = compare(target, draft, prompts, ids, outs)
    result = {"tool": "bench/head_agreement.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "commit": report.revision(), "command": ["python", *sys.argv], "model_path": ns.model_path,
              "draft": os.path.basename(os.path.normpath(draft)), "prompts": len(prompts), "by_kind": by_kind}
    report.write_json(result, ns.out)
    keys = ["engine_position1", "teacher_forced_at_verify_starts", "step1", "step2", "step3", "in_draft_vocab"]
    print(f"{'kind':8} " + " ".join(f"{k:>31}" for k in keys))
    for kind, row in by_kind.items():
        print(f"{kind:8} " + " ".join(f"{row[k]['rate']:>31}" for k in keys))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
