"""Attention metadata of a plain decode batch (one new token per row), built on the device from the
rows' page tables and positions, so a CUDA graph can build it from its static inputs."""

from __future__ import annotations

import torch

from tandem.layers.attention.base import page_slots
from tandem.layers.attention.torch_backend import TorchAttentionMetadata


def decode_metadata(page_rows: torch.Tensor, positions: torch.Tensor, kv_width: int, page_size: int,
                    derives_causal_mask: bool) -> TorchAttentionMetadata:
    """page_rows [B, P], positions [B] (of the new tokens); every row sees KV positions [0, position]
    within a window of `kv_width` columns. Backends that derive the causal rule from lengths get no
    mask (and stop at each row's length); the others get the [B, 1, 1, kv_width] mask."""
    b, device = page_rows.shape[0], page_rows.device
    kv_pos = torch.arange(kv_width, device=device)
    kv_lens = (positions + 1).to(torch.int32)
    mask = None
    if not derives_causal_mask:
        mask = (kv_pos[None, :] <= positions[:, None])[:, None, None, :]
    return TorchAttentionMetadata(
        slot_mapping=page_slots(page_rows, positions[:, None], page_size).reshape(-1),
        query_index=torch.arange(b, device=device)[:, None],
        query_valid=None,
        kv_slots=page_slots(page_rows, kv_pos.expand(b, -1), page_size),
        mask=mask,
        q_lens=torch.ones(b, dtype=torch.int32, device=device),
        kv_lens=kv_lens,
        causal=derives_causal_mask,
    )
