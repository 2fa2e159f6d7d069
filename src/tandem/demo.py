"""The bundled demo pair that `Engine()` and `tandem generate` use when no model path is given.

A small Llama target (6 layers, hidden 384, 12.6M parameters) and its EAGLE-3 head (3.8M), trained on
the Python standard library's source by `tandem make-demo-pair` and stored in float16 under
`tandem/demo_models/` (upcast to float32 on a CPU). docs/demo_pair.md has the command, the held-out
packages and the measured results (also in `demo_models/results.json`).

With no model path the engine runs the pair: the target, drafted by its head (EAGLE-3, chain of 3
drafts unless the speculative flags say otherwise). Greedy output is the target's own, token for
token; for the target alone, pass its path: `Engine(model_path=demo_model_paths()[0])`.
"""

from __future__ import annotations

import dataclasses
import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_models")
DEMO_NAME = "demo"  # `--model-path demo`: the bundled pair, offline (the CLI's default is a pulled real model)


def is_demo(path: str | None) -> bool:
    """Whether a model path asks for the demo pair: none at all (`Engine()`), or the name `demo`."""
    return path is None or (path == DEMO_NAME and not os.path.exists(path))


def demo_model_paths() -> tuple[str, str]:
    """(target directory, EAGLE-3 head directory) of the bundled demo pair."""
    return os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "eagle3")


def with_demo_pair(args):
    """`EngineArgs` with no model path (or `demo`), completed with the demo pair: the target, and its head unless
    another draft or algorithm was asked for (EAGLE3 without a draft path gets the head too)."""
    target, head = demo_model_paths()
    changes = {"model_path": target}
    if args.speculative_draft_model_path is None and args.speculative_algorithm in (None, "EAGLE3"):
        changes.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    return dataclasses.replace(args, **changes)


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus <s>, </s>, <pad> (for tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
