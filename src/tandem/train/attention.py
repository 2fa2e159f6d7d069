"""Dense attention over a [B, T] grid of tokens, for training only (no paged cache, differentiable).

It plugs into tandem's modules where an inference backend does (`StepContext.backend`), so the
target and the draft head run their own code. The per-layer "caches" are plain lists that collect
the keys and values of each training-time-test (TTT) step:

- the first forward of a layer (an empty list) is ordinary causal attention;
- TTT step j > 1 at position t attends to step-1 keys at positions <= t and to the keys of steps
  2..j at the same t only ("causal + diagonal"). That is what inference computes when a tree node
  at depth j attends to the real draft prefix plus its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class GridMetadata:
    batch_size: int
    seq_len: int  # the flat token list is row-major over [batch_size, seq_len]


def new_caches(num_layers: int) -> tuple[list[list], list[list]]:
    return [[] for _ in range(num_layers)], [[] for _ in range(num_layers)]


class DenseTTTAttention:
    """Satisfies `AttentionBackend.forward`; there is nothing to plan."""

    accepts_stored_kv = False  # the "cache" is this list of steps: the layer never writes it

    def forward(self, q, k, v, k_cache: list, v_cache: list, metadata: GridMetadata, scale: float,
                kv_stored: bool = False):
        b, t = metadata.batch_size, metadata.seq_len
        heads, dim = q.shape[1], q.shape[2]
        q, k, v = (x.view(b, t, x.shape[1], dim).transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
        k_cache.append(k)
        v_cache.append(v)
        if len(k_cache) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=heads != k.shape[1])
        else:
            out = ttt_attention(q, k_cache, v_cache, scale)
        return out.transpose(1, 2).reshape(b * t, heads, dim)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """q [B, h, T, D]; keys/values: one [B, kv_h, T, D] per step so far, step 1 first -> [B, h, T, D]."""
    t = q.shape[2]
    groups = q.shape[1] // keys[0].shape[1]
    keys = [k.repeat_interleave(groups, dim=1) for k in keys]
    values = [v.repeat_interleave(groups, dim=1) for v in values]
    causal = torch.matmul(q, keys[0].transpose(-1, -2)).float() * scale  # [B, h, T, T]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    diagonal = [(q * k).sum(-1, keepdim=True).float() * scale for k in keys[1:]]  # each [B, h, T, 1]
    probs = torch.softmax(torch.cat([causal, *diagonal], dim=-1), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :t], values[0])
    for i, v in enumerate(values[1:]):
        out = out + probs[..., t + i:t + i + 1] * v
    return out
