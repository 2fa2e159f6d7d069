"""Draft-model checkpoints written tensor by tensor with the public names and shapes (DESIGN §4),
independently of tandem's own modules, so loading them tests the real formats."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

STD = 0.25  # peaked random outputs, as for the tiny targets


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen) * STD


def _norm(gen, n):
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def _layer_tensors(gen, prefix, cfg, attn_in):
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(gen, q, attn_in),
        f"{prefix}.self_attn.k_proj.weight": _rand(gen, kv, attn_in),
        f"{prefix}.self_attn.v_proj.weight": _rand(gen, kv, attn_in),
        f"{prefix}.self_attn.o_proj.weight": _rand(gen, h, q),
        f"{prefix}.mlp.gate_proj.weight": _rand(gen, i, h),
        f"{prefix}.mlp.up_proj.weight": _rand(gen, i, h),
        f"{prefix}.mlp.down_proj.weight": _rand(gen, h, i),
        f"{prefix}.post_attention_layernorm.weight": _norm(gen, h),
    }


def _head_config(target_cfg: dict, **extra) -> dict:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps",
            "rope_theta", "max_position_embeddings", "rope_scaling")
    cfg = {k: target_cfg[k] for k in keys if k in target_cfg}
    cfg.update(intermediate_size=2 * target_cfg["hidden_size"], num_hidden_layers=1, torch_dtype="float32")
    cfg.update(extra)
    return cfg


def write_eagle_head(path: str, target_cfg: dict, seed: int = 0, drop=(), extra=None) -> dict:
    """EAGLE-1/2 format. `drop` removes tensors, `extra` adds some (for the error tests)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = _head_config(target_cfg, architectures=["LlamaForCausalLM"], bias=True)
    h = cfg["hidden_size"]
    tensors = {"fc.weight": _rand(gen, h, 2 * h), "fc.bias": _rand(gen, h),
               "embed_tokens.weight": _rand(gen, cfg["vocab_size"], h)}
    tensors.update(_layer_tensors(gen, "layers.0", cfg, h))
    return _save(path, cfg, tensors, drop, extra)


def write_eagle3_head(path: str, target_cfg: dict, seed: int = 0, draft_vocab: int | None = None,
                      drop=(), extra=None, aux_ids=None) -> dict:
    """EAGLE-3 format with a reduced draft vocabulary (d2t / t2d)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target_cfg["vocab_size"]
    draft_vocab = draft_vocab or vocab // 2
    extra_cfg = {"draft_vocab_size": draft_vocab, "target_hidden_size": target_cfg["hidden_size"]}
    if aux_ids is not None:
        extra_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    cfg = _head_config(target_cfg, architectures=["LlamaForCausalLMEagle3"], **extra_cfg)
    h = cfg["hidden_size"]
    kept = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values  # target ids the draft knows
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": _rand(gen, h, 3 * target_cfg["hidden_size"]),
        "midlayer.input_layernorm.weight": _norm(gen, h),
        "midlayer.hidden_norm.weight": _norm(gen, h),
        "norm.weight": _norm(gen, h),
        "lm_head.weight": _rand(gen, draft_vocab, h),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    tensors.update(_layer_tensors(gen, "midlayer", cfg, 2 * h))
    return _save(path, cfg, tensors, drop, extra)


def _save(path, cfg, tensors, drop, extra) -> dict:
    os.makedirs(path, exist_ok=True)
    for name in drop:
        del tensors[name]
    tensors.update(extra or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


def write_mtp_head(path: str, target_cfg: dict, num_modules: int = 3, seed: int = 0, own_heads=(),
                   drop=(), extra=None, embed: bool = True, overrides=None) -> dict:
    """MTP format (DeepSeek-V3-style next-n modules, models/mtp.py): `model.layers.{k}.` per module.
    `own_heads` lists the modules that store `shared_head.head.weight` (the others use the target's
    lm_head); `embed` stores an `embed_tokens.weight`, which loading ignores; `overrides` replaces
    tensors by name after they are drawn (for hand-built heads)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = _head_config(target_cfg, architectures=["LlamaForCausalLMMTP"], num_nextn_predict_layers=num_modules,
                       num_hidden_layers=target_cfg["num_hidden_layers"],
                       intermediate_size=target_cfg["intermediate_size"])
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    tensors = {"model.embed_tokens.weight": _rand(gen, vocab, h)} if embed else {}
    for k in range(num_modules):
        p = f"model.layers.{k}"
        tensors.update({f"{p}.enorm.weight": _norm(gen, h), f"{p}.hnorm.weight": _norm(gen, h),
                        f"{p}.eh_proj.weight": _rand(gen, h, 2 * h) / 2,
                        f"{p}.input_layernorm.weight": _norm(gen, h),
                        f"{p}.shared_head.norm.weight": _norm(gen, h)})
        tensors.update(_layer_tensors(gen, p, cfg, h))
        if k in own_heads:
            tensors[f"{p}.shared_head.head.weight"] = _rand(gen, vocab, h)
    tensors.update(overrides or {})
    return _save(path, cfg, tensors, drop, extra)
