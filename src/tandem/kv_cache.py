"""The KV cache tensors: one [num_slots, kv_heads, head_dim] pair per layer, slot = page * page_size + offset.

Which request owns which page is the scheduler's business (scheduler/page_allocator.py); this module
only holds the memory.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize
