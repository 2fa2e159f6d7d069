"""A fresh EAGLE-3 head for a target: its config.json (public format) and tandem's `Eagle3Draft`."""

from __future__ import annotations

import torch

from tandem.models.eagle3 import Eagle3Draft, eagle3_aux_layer_ids
from tandem.models.hf_config import ModelArchConfig, parse_model_config
from tandem.models.loader import default_dtype
from tandem.train.vocab import DraftVocab

INIT_STD = 0.02  # transformers' default initializer_range


def head_config(arch: ModelArchConfig, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None,
                intermediate_size: int | None = None, torch_dtype: str = "float32") -> dict:
    """config.json of an EAGLE-3 head with the target's attention shape.

    `aux_layer_ids` are the target layers whose *entering* residual stream the head reads (tandem's
    convention); the file stores the checkpoint convention, the layer whose output is taken (id - 1).
    """
    if aux_layer_ids is None:
        aux_layer_ids = eagle3_aux_layer_ids({}, arch.num_layers)
    bad = [i for i in aux_layer_ids if not 0 <= i <= arch.num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} outside [0, {arch.num_layers}] for a {arch.num_layers}-layer target")
    raw = arch.raw
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "intermediate_size": intermediate_size or arch.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": arch.hidden_size,
        "tie_word_embeddings": False,
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"),
        "torch_dtype": torch_dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in aux_layer_ids]},
    }


def build_head(config: dict, target, max_positions: int, device) -> Eagle3Draft:
    """tandem's own module (float32 master weights), exactly what the engine will load the result into."""
    cfg = parse_model_config({**config, "architectures": ["LlamaForCausalLM"]})
    aux = eagle3_aux_layer_ids(config, target.config.num_layers)
    with torch.device(device), default_dtype(torch.float32):
        return Eagle3Draft(cfg, target, max_positions, aux)


@torch.no_grad()
def init_head(head: Eagle3Draft, target, vocab: DraftVocab, seed: int) -> None:
    """Small random weights; the output layer starts as the target's own (final norm, and the
    lm_head rows of the kept tokens), so the head begins by reading logits the target's way."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if not p.requires_grad:
            continue
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
    head.d2t.copy_(vocab.d2t)
    target_head = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    if target_head.shape[1] == head.lm_head.weight.shape[1]:
        head.lm_head.weight.copy_(target_head[vocab.target_ids.to(target_head.device)])
        head.norm.weight.copy_(target.model.norm.weight)
