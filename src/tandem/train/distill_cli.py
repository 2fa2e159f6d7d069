"""`tandem self-distill`: compose the instruction set (train/instruction_set.py) and have the target
answer its training prompts (train/self_distill.py), the corpus for `tandem train-draft`."""

from __future__ import annotations

import argparse
import json
import os


def add_self_distill_parser(sub) -> None:
    p = sub.add_parser("self-distill", help="have a target answer a composed instruction set (draft-head data)",
                       description="Compose chat, explanation, list/format and code-completion prompts over the "
                                   "Python standard library and general topics, hold some out, and have the target "
                                   "answer the training ones. Writes OUTPUT_DIR/prompts_train.jsonl, "
                                   "prompts_heldout.jsonl, eval_prompts.jsonl (EVAL_PER_KIND held-out prompts of each "
                                   "kind) and distill.jsonl (the corpus); the same command again resumes.")
    p.add_argument("--model-path", required=True, help="the target (a directory, a GGUF file or a name)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--per-module", type=int, default=5, help="functions or classes per module per template")
    p.add_argument("--eval-per-kind", type=int, default=60, help="held-out prompts of each kind in eval_prompts.jsonl")
    p.add_argument("--max-prompts", type=int, default=None, help="answer only the first N training prompts")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sampled-every", type=int, default=3, help="every Nth answer at temperature 0.7 (0: all greedy)")
    p.add_argument("--stdlib-dir", default=None, help="default: the running interpreter's stdlib")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_self_distill)


def cmd_self_distill(ns: argparse.Namespace) -> int:
    from tandem.train import instruction_set as iset
    from tandem.train.self_distill import distill

    os.makedirs(ns.output_dir, exist_ok=True)
    train_path = os.path.join(ns.output_dir, "prompts_train.jsonl")
    if os.path.isfile(train_path):  # resuming: the prompts of the first run, whatever stdlib runs now
        train = iset.read_prompts(train_path)
    else:
        prompts = iset.build_prompts(iset.read_stdlib_modules(ns.stdlib_dir), ns.per_module, ns.seed)
        train, held = iset.split(prompts)
        iset.write_prompts(os.path.join(ns.output_dir, "prompts_heldout.jsonl"), held)
        iset.write_prompts(os.path.join(ns.output_dir, "eval_prompts.jsonl"),
                           iset.heldout_sample(held, ns.eval_per_kind, ns.seed))
        iset.write_prompts(train_path, train)
    if ns.max_prompts is not None:
        train = train[:ns.max_prompts]
    kwargs = {"device": ns.device} if ns.device else {}
    summary = distill(ns.model_path, train, os.path.join(ns.output_dir, "distill.jsonl"), ns.max_new_tokens,
                      ns.batch_size, ns.sampled_every, ns.seed, **kwargs)
    print(json.dumps(summary))
    return 0
