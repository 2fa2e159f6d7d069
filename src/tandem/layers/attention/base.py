"""The attention-backend interface and the per-step description of a batch it works from.

A step's batch is a flat list of tokens from several requests laid out request by request
(prefill chunks, decodes and, later, verify trees side by side). The backend turns that
description into whatever index tensors it needs once per step (`plan`), then every layer calls
`forward` with its own q/k/v and KV-cache slice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionBatch:
    """What attention needs to know about one step, as plain CPU lists (built by the runner)."""

    query_lens: list[int]  # new tokens per request
    seq_lens: list[int]  # KV length per request after this step (cached + new)
    slot_mapping: list[int]  # cache slot of every new token, in batch order
    page_tables: list[list[int]]  # pages of each request, in order
    page_size: int
    # Optional [query_len, seq_len] boolean mask per request (True = may attend), replacing the
    # causal rule; used by tree verification, where drafts attend to their ancestors only.
    custom_masks: list[torch.Tensor] | None = None


class AttentionBackend(ABC):
    @abstractmethod
    def plan(self, batch: AttentionBatch, device: torch.device) -> object:
        """Build the metadata every layer of this step shares."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [N, heads, D]
        k: torch.Tensor,  # [N, kv_heads, D]
        v: torch.Tensor,  # [N, kv_heads, D]
        k_cache: torch.Tensor,  # [num_slots, kv_heads, D] (one layer)
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:  # [N, heads, D]
        """Write this step's k/v into the cache slots, then attend over the whole sequence."""
