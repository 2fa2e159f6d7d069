"""Reference attention over the paged KV cache: gather each request's KV, pad, and call SDPA with an
explicit mask. Slow next to a paged kernel, but obviously right and it runs everywhere, so every
other backend is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tandem.layers.attention.base import AttentionBackend, AttentionBatch
from tandem.runtime.uploads import to_device


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    query_index: torch.Tensor  # [B, Lq] row of the flat token list for (request, i); padding -> 0
    query_valid: torch.Tensor | None  # [B, Lq] bool; None: every query is real (uniform rows)
    kv_slots: torch.Tensor  # [B, Lkv] cache slot of KV entry j of row b; padding -> 0
    mask: torch.Tensor | None  # [B, 1, Lq, Lkv] bool, True = attend (None only with `causal`)
    # Read by backends that can use them (triton); the torch backend always goes by `mask`.
    q_lens: torch.Tensor | None = None  # [B] int32 new tokens per row
    kv_lens: torch.Tensor | None = None  # [B] int32 KV entries per row: the rest of kv_slots is masked out
    causal: bool = False  # mask derived from q_lens/kv_lens; `mask` may be None


class TorchAttentionBackend(AttentionBackend):
    derives_causal_mask = False

    def plan(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        num_rows = len(batch.query_lens)
        max_q = max(batch.query_lens)
        slot_lists = batch.slot_lists()
        max_kv = max(len(s) for s in slot_lists)
        query_index = torch.zeros(num_rows, max_q, dtype=torch.long)
        query_valid = torch.zeros(num_rows, max_q, dtype=torch.bool)
        kv_slots = torch.zeros(num_rows, max_kv, dtype=torch.long)
        mask = torch.zeros(num_rows, 1, max_q, max_kv, dtype=torch.bool)
        # Padded query rows attend to KV 0 only, so softmax never sees an all-masked row (NaN).
        mask[:, 0, :, 0] = True
        offset = 0
        for r, (q_len, slots) in enumerate(zip(batch.query_lens, slot_lists)):
            kv_len = len(slots)
            query_index[r, :q_len] = torch.arange(offset, offset + q_len)
            query_valid[r, :q_len] = True
            kv_slots[r, :kv_len] = torch.tensor(slots, dtype=torch.long)
            custom = batch.custom_masks[r] if batch.custom_masks is not None else None
            if custom is not None:
                mask[r, 0, :q_len, :kv_len] = custom
            else:
                # Query i sits at KV index kv_len - q_len + i and sees everything up to itself.
                q_at = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
                mask[r, 0, :q_len, :kv_len] = torch.arange(kv_len).unsqueeze(0) <= q_at
            offset += q_len
        return TorchAttentionMetadata(
            slot_mapping=to_device(batch.slot_mapping, device, torch.long),
            query_index=to_device(query_index, device),
            query_valid=to_device(query_valid, device),
            kv_slots=to_device(kv_slots, device),
            mask=to_device(mask, device),
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float,
                kv_stored: bool = False):
        if not kv_stored:
            k_cache[metadata.slot_mapping] = k
            v_cache[metadata.slot_mapping] = v
        q_pad = q[metadata.query_index].transpose(1, 2)  # [B, heads, Lq, D]
        k_pad = k_cache[metadata.kv_slots].transpose(1, 2)  # [B, kv_heads, Lkv, D]
        v_pad = v_cache[metadata.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad, k_pad, v_pad, attn_mask=metadata.mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out = out.transpose(1, 2)  # [B, Lq, heads, D]
        if metadata.query_valid is None:  # uniform rows: no boolean indexing, so no host sync
            return out.reshape(-1, *out.shape[2:])
        # Rows of query_valid in row-major order are exactly the flat batch order.
        return out[metadata.query_valid]
