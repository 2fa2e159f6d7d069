"""The frozen target model and what training needs from it, computed online for each batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config import ModelLoadConfig
from tandem.models.hf_config import ModelArchConfig, load_model_config
from tandem.models.llama import StepContext
from tandem.models.registry import build_target_model
from tandem.train.attention import DenseTTTAttention, GridMetadata, new_caches

LOGIT_ROWS = 4096  # tokens per slice of full-vocabulary logits


def load_frozen_target(path: str, device: str, dtype: str, max_positions: int):
    """(target model with gradients off, its architecture config), loaded by tandem's own loader."""
    arch: ModelArchConfig = load_model_config(path)
    target = build_target_model(ModelLoadConfig(path, dtype, device), arch, max_positions)
    target.requires_grad_(False)
    return target, arch


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, T, 3 * H_t] residual streams entering the aux layers, concatenated
    probs: torch.Tensor  # [B, T, V_draft] float32: next-token distribution restricted to the draft vocab
    argmax: torch.Tensor  # [B, T] the target's greedy next token (full vocabulary)


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, aux_layer_ids: tuple[int, ...],
                    draft_target_ids: torch.Tensor) -> TargetFeatures:
    """One dense causal forward of the target over `input_ids` [B, T]."""
    b, t = input_ids.shape
    k_caches, v_caches = new_caches(target.config.num_layers)
    ctx = StepContext(DenseTTTAttention(), GridMetadata(b, t), k_caches, v_caches)
    positions = torch.arange(t, device=input_ids.device).repeat(b)
    hidden, aux = target(input_ids.reshape(-1), positions, ctx, aux_layer_ids=aux_layer_ids)
    probs, argmax = [], []
    # Full-vocabulary float32 logits of a whole batch can take gigabytes: a slice at a time.
    for rows in hidden.split(LOGIT_ROWS):
        logits = target.compute_logits(rows)  # [n, V] float32
        # Soft labels over the draft vocabulary only: the head cannot propose anything else.
        probs.append(torch.softmax(logits[:, draft_target_ids], dim=-1))
        argmax.append(logits.argmax(-1))
    return TargetFeatures(aux=torch.cat(aux, dim=-1).view(b, t, -1), probs=torch.cat(probs).view(b, t, -1),
                          argmax=torch.cat(argmax).view(b, t))
