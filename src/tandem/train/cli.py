"""`tandem train-draft`: train an EAGLE-3 head (and measure its acceptance), or `--eval-only`.

Kept out of tandem/cli.py so that file only registers the subcommand; nothing here imports torch
until the command runs.
"""

from __future__ import annotations

import argparse
import json


def add_train_draft_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-3 draft head for a target model",
                       description="Train an EAGLE-3 draft head (training-time test, online target states) "
                                   "and write it in the public EAGLE-3 format; then measure its acceptance "
                                   "length with the engine on held-out documents of the corpus.")
    p.add_argument("--model-path", required=True, help="the target model directory (or a name: see `tandem pull --list`)")
    p.add_argument("--corpus", required=True,
                   help="a directory of text/code files, a .jsonl file ({'text'}, {'messages'} or "
                        "{'input_ids'} per line) or one text file")
    p.add_argument("--output-dir", required=True, help="where the head (and training_state.pt) is written")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 3%% of --steps")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: min(32000, target vocab)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=None, help="default: 0 (--eval-only: the training run's)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/training_state.pt")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="share of documents held out (default: 0.05; --eval-only: the training run's)")
    p.add_argument("--extensions", default=None,
                   help="comma-separated file endings read from a corpus directory (default: common text/code)")
    p.add_argument("--eval-only", action="store_true",
                   help="do not train: measure the acceptance of the head in OUTPUT_DIR")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts to measure on (0: skip)")
    p.add_argument("--eval-prompt-len", type=int, default=64)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_draft)


def _config(ns: argparse.Namespace):
    from tandem.train.checkpoint import load_run_config
    from tandem.train.config import DEFAULT_EXTENSIONS, TrainConfig

    # --eval-only must cut the same held-out split as training did: unset flags take the run's values.
    recorded = load_run_config(ns.output_dir) if ns.eval_only else {}
    extensions = tuple(recorded.get("extensions", DEFAULT_EXTENSIONS))
    if ns.extensions:
        extensions = tuple(e if e.startswith(".") else "." + e for e in ns.extensions.split(",") if e)
    seed = ns.seed if ns.seed is not None else recorded.get("seed", 0)
    eval_fraction = ns.eval_fraction if ns.eval_fraction is not None else recorded.get("eval_fraction", 0.05)
    return TrainConfig(seq_len=ns.seq_len, eval_fraction=eval_fraction, extensions=extensions,
                       draft_vocab_size=ns.draft_vocab_size, ttt_steps=ns.ttt_steps, steps=ns.steps,
                       batch_size=ns.batch_size, lr=ns.lr, warmup_steps=ns.warmup_steps, grad_clip=ns.grad_clip,
                       seed=seed, device=ns.device, save_every=ns.save_every, resume=ns.resume,
                       progress=not ns.no_progress)


def cmd_train_draft(ns: argparse.Namespace) -> int:
    from tandem.tokenizer import load_tokenizer
    from tandem.train import corpus as corpus_lib
    from tandem.train.evaluate import evaluate_acceptance, heldout_prompts
    from tandem.train.trainer import train_eagle3

    from tandem.named_models import named_model, model_paths

    if named_model(ns.model_path) is not None:
        ns.model_path = model_paths(ns.model_path)[0]
    config = _config(ns)
    record: dict = {"output_dir": ns.output_dir}
    if not ns.eval_only:
        summary = train_eagle3(ns.model_path, ns.corpus, ns.output_dir, config)
        record.update(steps_done=summary.steps_done, num_train_sequences=summary.num_train_sequences,
                      vocab_coverage=summary.vocab_coverage, heldout=summary.heldout,
                      final_loss=summary.history[-1]["loss"] if summary.history else None)
    if ns.eval_prompts > 0:
        docs = corpus_lib.read_documents(ns.corpus, load_tokenizer(ns.model_path), config.extensions)
        _, held = corpus_lib.split_documents(docs, config.eval_fraction, config.seed)
        prompts = heldout_prompts(held, ns.eval_prompts, ns.eval_prompt_len, config.seed)
        if not prompts:
            raise ValueError("no held-out documents to evaluate on (raise --eval-fraction, or --eval-prompts 0)")
        report = evaluate_acceptance(ns.model_path, ns.output_dir, prompts, max_new_tokens=ns.eval_max_new_tokens,
                                     num_steps=ns.speculative_num_steps, topk=ns.speculative_eagle_topk,
                                     device=ns.device)
        record["acceptance"] = report.as_dict()
    print(json.dumps(record))
    return 0
