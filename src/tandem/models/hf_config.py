"""Reads a Hugging Face `config.json` into one plain, validated description of a Llama-family model.

The families differ in a handful of switches (qkv bias, q/k norm, head_dim, tied embeddings, rope
scaling); everything else is the same decoder, so one dataclass carries them all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# architecture name in config.json -> family defaults that the config does not spell out
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None
    raw: dict = field(repr=False, compare=False, default_factory=dict)


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(int(t) for t in x)


def parse_model_config(cfg: dict) -> ModelArchConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    qkv_bias = family["qkv_bias"]
    if qkv_bias is None:
        qkv_bias = bool(cfg.get("attention_bias", False))
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta", 10000.0)
    rope_parameters = cfg.get("rope_parameters")  # transformers 5 folds theta and scaling into one dict
    if rope_parameters:
        rope_theta = rope_parameters.get("rope_theta", rope_theta)
        if rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    use_sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    return ModelArchConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        # Llama's attention_bias also covers o_proj; Qwen2 biases q/k/v only.
        o_bias=bool(cfg.get("attention_bias", False)) and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family["qk_norm"],
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        sliding_window=cfg.get("sliding_window") if use_sliding else None,
        raw=cfg,
    )


def load_model_config(model_path: str) -> ModelArchConfig:
    """The config of a model directory's config.json, or of a GGUF file's metadata."""
    from tandem.gguf import is_gguf_path

    if is_gguf_path(model_path):
        from tandem.gguf.config import gguf_config

        return parse_model_config(gguf_config(model_path))
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_path!r}")
    with open(path) as f:
        return parse_model_config(json.load(f))
