"""`tandem make-demo-pair`: registered by tandem/cli.py; nothing here imports torch until the command runs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys


def add_make_demo_pair_parser(sub) -> None:
    p = sub.add_parser("make-demo-pair", help="train the bundled demo pair (target + EAGLE-3 head) from the stdlib",
                       description="Train a byte-level BPE tokenizer, a small Llama target and its EAGLE-3 head on "
                                   "the Python standard library's source (held-out packages excluded), store them "
                                   "in float16 and measure them (docs/demo_pair.md).")
    p.add_argument("--output-dir", required=True, help="where target/, eagle3/ and results.json go "
                                                       "(the repository's bundle: src/tandem/demo_models)")
    p.add_argument("--stdlib-dir", default=None, help="default: the running interpreter's stdlib")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--preset", default="full", choices=("full", "tiny"), help="tiny: a dry run in seconds on a CPU")
    p.add_argument("--target-steps", type=int, default=None, help="override the preset's target training steps")
    p.add_argument("--head-steps", type=int, default=None, help="override the preset's head training steps")
    p.add_argument("--target-seconds", type=float, default=None,
                   help="shorten target training to fit this many seconds (the steps done are recorded)")
    p.add_argument("--head-seconds", type=float, default=None, help="the same for the head")
    p.add_argument("--measure-only", action="store_true",
                   help="do not train: measure the bundle in OUTPUT_DIR on --device and add its results entry")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (recorded with the results)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_make_demo_pair)


def cmd_make_demo_pair(ns: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from tandem.train.demo_recipe import PRESETS, make_demo_pair, measure_demo_pair

    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    recipe = PRESETS[ns.preset]
    if ns.target_steps is not None:
        recipe = dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, steps=ns.target_steps))
    if ns.head_steps is not None:
        recipe = dataclasses.replace(recipe, head_steps=ns.head_steps)
    command = "tandem " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if ns.measure_only:
        entry = measure_demo_pair(ns.output_dir, recipe, ns.device, ns.seed, not ns.no_progress, command)
    else:
        entry = make_demo_pair(ns.output_dir, recipe, ns.stdlib_dir, ns.seed, ns.device, ns.target_seconds,
                               ns.head_seconds, not ns.no_progress, command)
    summary = {"acceptance": {k: round(v["mean_accept_length"], 3) for k, v in entry["acceptance"].items()},
               "speed": entry["speed"]["batch_1_tokens_per_s"], "speedup": entry["speed"]["batch_1_speedup"]}
    if "heldout_perplexity" in entry:
        summary["heldout_perplexity"] = round(entry["heldout_perplexity"]["perplexity"], 3)
    print(json.dumps(summary))
    return 0
