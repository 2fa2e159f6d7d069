"""Loads a draft model directory for a given target and speculative algorithm."""

from __future__ import annotations

import json
import os

import torch

from tandem.config import ModelLoadConfig
from tandem.distributed.parallel_state import TPGroup
from tandem.models import llama
from tandem.models.draft_base import DraftModel
from tandem.models.eagle import EagleDraft
from tandem.models.eagle3 import Eagle3Draft, eagle3_aux_layer_ids
from tandem.models.hf_config import load_model_config, parse_model_config
from tandem.models.loader import default_dtype, init_dummy_weights, iter_checkpoint, load_weights
from tandem.models.mtp import build_mtp_draft
from tandem.models.registry import build_target_model
from tandem.models.standalone_draft import StandaloneDraft


def draft_head_config(path: str):
    """An EAGLE/EAGLE-3 head's config.json as a model config."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in draft model directory {path!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    # EAGLE heads carry a Llama config whatever their architecture string says.
    return parse_model_config({**raw, "architectures": ["LlamaForCausalLM"]})


def build_draft_model(algorithm: str, path: str, target, load: ModelLoadConfig, max_positions: int,
                      tp: TPGroup | None = None) -> DraftModel:
    """`tp`: EAGLE and EAGLE-3 heads split their decoder layer over the tensor-parallel ranks like the
    target (measured faster than replicating it: docs/performance.md); standalone and MTP drafts are
    replicated on every rank."""
    dtype = target.model.embed_tokens.weight.dtype
    if algorithm == "STANDALONE":
        arch = load_model_config(path)
        if arch.vocab_size != target.config.vocab_size:
            raise ValueError(f"standalone draft vocab_size {arch.vocab_size} != target vocab_size "
                             f"{target.config.vocab_size}; the draft must share the target's tokenizer")
        draft_load = ModelLoadConfig(path, {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                            torch.float16: "float16"}[dtype], load.device, load.load_format,
                                     load.seed + 1)
        return StandaloneDraft(build_target_model(draft_load, arch, max_positions)).eval()
    if algorithm == "MTP":  # DeepSeek-style next-n modules: their own config keys and tensor names (models/mtp.py)
        return build_mtp_draft(path, target, load, max_positions)
    cfg = draft_head_config(path)
    with torch.device(load.device), default_dtype(dtype):
        if algorithm == "EAGLE":
            model = EagleDraft(cfg, target, max_positions, tp)
            skip = frozenset({"embed_tokens.weight"})  # the target's embedding is used
        elif algorithm == "EAGLE3":
            aux = eagle3_aux_layer_ids(cfg.raw, target.config.num_layers)
            model = Eagle3Draft(cfg, target, max_positions, aux, tp)
            skip = frozenset({"embed_tokens.weight", "t2d"})  # t2d is the inverse map, unused here
        else:
            raise ValueError(f"unknown draft algorithm {algorithm!r}")
    if load.load_format == "dummy":
        init_dummy_weights(model, load.seed + 1)
        if isinstance(model, Eagle3Draft):
            model.d2t.zero_()
    else:
        load_weights(model, iter_checkpoint(path, desc="loading draft weights"), llama.PACKED_MODULES,
                     skip=skip)
    if isinstance(model, Eagle3Draft):
        _check_d2t(model, target.config.vocab_size)
    return model.eval()


def _check_d2t(model: Eagle3Draft, target_vocab: int) -> None:
    ids = model.to_target_ids(torch.arange(model.draft_vocab_size, device=model.d2t.device))
    if ids.min() < 0 or ids.max() >= target_vocab:
        raise ValueError("EAGLE-3 d2t maps draft ids outside the target vocabulary")
