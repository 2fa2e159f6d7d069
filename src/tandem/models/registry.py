"""From a model directory to a loaded target model."""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import ModelLoadConfig
from tandem.distributed.parallel_state import TPGroup
from tandem.models import llama
from tandem.models.hf_config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from tandem.models.loader import default_dtype, init_dummy_weights, iter_checkpoint, load_weights, resolve_dtype

# Every supported architecture is the same decoder with different switches (see hf_config).
MODEL_CLASSES = {arch: llama.LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def build_target_model(load: ModelLoadConfig, arch: ModelArchConfig, max_positions: int,
                       tp: TPGroup | None = None) -> nn.Module:
    """`tp`: build this rank's shard of a tensor-parallel model (each rank reads only its slices)."""
    dtype = resolve_dtype(load.dtype, load.device, arch.torch_dtype)
    model_cls = MODEL_CLASSES[arch.architecture]
    sharded = tp is not None and tp.size > 1
    with torch.device(load.device), default_dtype(dtype):
        model = model_cls(arch, max_positions, tp=tp) if sharded else model_cls(arch, max_positions)
    if load.load_format == "dummy":
        init_dummy_weights(model, load.seed)  # same seed on every rank: replicated tensors agree
    else:
        skip = frozenset({"lm_head.weight"}) if arch.tie_word_embeddings else frozenset()
        load_weights(model, iter_checkpoint(load.model_path, lazy=sharded), llama.PACKED_MODULES, skip=skip)
    return model.eval()
