"""Rotary position embedding (the "rotate half" layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.layers.fused import kernels, use_fused


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 throughout, exactly as transformers computes it, so greedy tokens match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        # Kept in float32 whatever the model dtype; cast at use (matches HF numerics).
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [N, heads, D], k: [N, kv_heads, D]
        if use_fused(q) and q.stride(2) == 1 and k.stride(2) == 1:
            return kernels().rotary_(positions, q, k, self.cos, self.sin)  # in place
        cos = self.cos[positions].unsqueeze(1)  # [N, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_store_(self, positions, q, k, v, k_cache, v_cache, slot_mapping) -> bool:
        """Where the fused kernel applies: rotates q and k in place and writes the rotated k and v into
        the cache slots, all in one kernel; returns False (and does nothing) elsewhere."""
        if not (use_fused(q) and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))):
            return False
        kernels().rotary_(positions, q, k, self.cos, self.sin, store=(v, k_cache, v_cache, slot_mapping))
        return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same operation order as transformers: x*cos + rotate_half(x)*sin in the model dtype.
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
