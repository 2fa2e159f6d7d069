"""The attention-backend interface and the per-step description of a batch it works from.

A step's batch is a flat list of tokens from several requests laid out request by request
(prefill chunks, decodes and, later, verify trees side by side). The backend turns that
description into whatever index tensors it needs once per step (`plan`), then every layer calls
`forward` with its own q/k/v and KV-cache slice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionBatch:
    """What attention needs to know about one step, as plain CPU lists (built by the runner).

    A row is a run of query tokens that share one KV sequence: a prefill chunk, a decode token, a
    verify tree, or one draft-tree node. `kv_slots[r]` lists the cache slots of row r's whole KV
    sequence in attention order (the row's own new tokens included), so rows may see any subset
    of the cache, not only a contiguous prefix.

    A batch made with `paged` gives each row's page table and KV length instead: its KV is positions
    0..kv_len-1 of its request. Listing those slots costs the host O(context) a step (2k-token rows at
    batch 32 took longer than the 8B shape's forward on an H200), so a backend that can should build
    them on the device from the page tables; `slot_lists()` lists them for one that cannot.
    """

    query_lens: list[int]  # new tokens per row
    kv_slots: list[list[int]] | None  # cache slot of every KV entry each row attends over (None: paged)
    slot_mapping: list[int]  # cache slot where each new token's k/v is written, in batch order
    # Optional [query_len, kv_len] boolean mask per row (True = may attend), replacing the causal
    # rule (query i sees KV entries up to kv_len - query_len + i); tree verification uses it.
    custom_masks: list[torch.Tensor | None] | None = None
    page_tables: list[Sequence[int]] | None = None  # paged: each row's pages (at least its KV's)
    kv_lens: list[int] | None = None  # paged: each row's KV length
    page_size: int = 0

    @classmethod
    def paged(cls, query_lens: list[int], page_tables: list[Sequence[int]], kv_lens: list[int],
              slot_mapping: list[int], page_size: int) -> AttentionBatch:
        return cls(query_lens, None, slot_mapping, page_tables=page_tables, kv_lens=kv_lens, page_size=page_size)

    @property
    def seq_lens(self) -> list[int]:
        return list(self.kv_lens) if self.kv_slots is None else [len(s) for s in self.kv_slots]

    def slot_lists(self) -> list[list[int]]:
        """`kv_slots`, listed from the page tables for a paged batch."""
        if self.kv_slots is None:
            self.kv_slots = [positions_to_slots(pages, range(n), self.page_size)
                             for pages, n in zip(self.page_tables, self.kv_lens)]
        return self.kv_slots

    def page_rows(self) -> torch.Tensor:
        """[B, P] int64 (CPU): a paged batch's page tables, zero-padded to the longest row's KV pages."""
        ps = self.page_size
        need = [-(-n // ps) for n in self.kv_lens]
        rows = np.zeros((len(need), max(need, default=0) or 1), dtype=np.int64)
        for r, (pages, k) in enumerate(zip(self.page_tables, need)):
            rows[r, :k] = pages[:k]
        return torch.from_numpy(rows)


def positions_to_slots(pages, positions, page_size: int) -> list[int]:
    """Cache slots of token positions in a request whose pages are `pages`."""
    return [pages[p // page_size] * page_size + p % page_size for p in positions]


def page_slots(page_rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Device version: cache slots of `positions` [B, L] for requests whose page tables are `page_rows` [B, P]."""
    pages = page_rows.gather(1, (positions // page_size).clamp(max=page_rows.shape[1] - 1))
    return pages * page_size + positions % page_size


class AttentionBackend(ABC):
    # Whether the backend applies the causal rule from per-row lengths (metadata.causal, no mask).
    derives_causal_mask: bool = False
    # Whether the layer may write k/v into the cache itself (fused with the rotary embedding) and
    # call `forward` with kv_stored=True; needs `metadata.slot_mapping`.
    accepts_stored_kv: bool = False

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
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [N, heads, D]
        """Write this step's k/v into the cache slots (unless the caller did: `kv_stored`), then
        attend over the whole sequence."""

    def forward_into(self, out: torch.Tensor, q, k, v, k_cache, v_cache, metadata: object, scale: float,
                     kv_stored: bool = False) -> None:
        """`forward` with its result written into `out` [N, heads, D] (a static buffer of the piecewise
        CUDA graphs, runtime/piecewise_graphs.py); a backend that can write there directly overrides it."""
        out.copy_(self.forward(q, k, v, k_cache, v_cache, metadata, scale, kv_stored))
