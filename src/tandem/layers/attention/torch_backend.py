"""Reference attention over the paged KV cache: gather each request's KV, pad, and call SDPA with an
explicit mask. Slow next to a paged kernel, but obviously right and it runs everywhere, so every
other backend is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tandem.layers.attention.base import AttentionBackend, AttentionBatch


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    query_index: torch.Tensor  # [B, Lq] row of the flat token list for (request, i); padding -> 0
    query_valid: torch.Tensor  # [B, Lq] bool
    kv_slots: torch.Tensor  # [B, Lkv] cache slot of KV position j of request b; padding -> 0
    mask: torch.Tensor  # [B, 1, Lq, Lkv] bool, True = attend


class TorchAttentionBackend(AttentionBackend):
    def plan(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        num_reqs = len(batch.query_lens)
        max_q = max(batch.query_lens)
        max_kv = max(batch.seq_lens)
        query_index = torch.zeros(num_reqs, max_q, dtype=torch.long)
        query_valid = torch.zeros(num_reqs, max_q, dtype=torch.bool)
        kv_slots = torch.zeros(num_reqs, max_kv, dtype=torch.long)
        mask = torch.zeros(num_reqs, 1, max_q, max_kv, dtype=torch.bool)
        # Padded query rows attend to KV 0 only, so softmax never sees an all-masked row (NaN).
        mask[:, 0, :, 0] = True
        offset = 0
        for b, (q_len, kv_len, pages) in enumerate(zip(batch.query_lens, batch.seq_lens, batch.page_tables)):
            query_index[b, :q_len] = torch.arange(offset, offset + q_len)
            query_valid[b, :q_len] = True
            pos = torch.arange(kv_len)
            page_ids = torch.tensor(pages, dtype=torch.long)
            kv_slots[b, :kv_len] = page_ids[pos // batch.page_size] * batch.page_size + pos % batch.page_size
            if batch.custom_masks is not None and batch.custom_masks[b] is not None:
                mask[b, 0, :q_len, :kv_len] = batch.custom_masks[b]
            else:
                # Query i sits at position kv_len - q_len + i and sees everything up to itself.
                q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
                mask[b, 0, :q_len, :kv_len] = pos.unsqueeze(0) <= q_pos
            offset += q_len
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long).to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            kv_slots=kv_slots.to(device),
            mask=mask.to(device),
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float):
        k_cache[metadata.slot_mapping] = k
        v_cache[metadata.slot_mapping] = v
        q_pad = q[metadata.query_index].transpose(1, 2)  # [B, heads, Lq, D]
        k_pad = k_cache[metadata.kv_slots].transpose(1, 2)  # [B, kv_heads, Lkv, D]
        v_pad = v_cache[metadata.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad, k_pad, v_pad, attn_mask=metadata.mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        # Rows of query_valid in row-major order are exactly the flat batch order.
        return out.transpose(1, 2)[metadata.query_valid]
