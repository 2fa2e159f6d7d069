"""Paged attention with Triton kernels (kernels in triton_kernels.py).

It reads the same metadata as the torch backend (`TorchAttentionMetadata`), so the speculative
planners in speculative/plan.py, which build that metadata on the device, work unchanged: the kernel
gathers K/V through `kv_slots` and applies the boolean `mask`, skipping KV blocks the mask hides
entirely (the padded windows of those plans). `plan()` adds per-row lengths; when every row is
causal it builds no mask at all and the kernel derives the causal rule from the lengths, visiting
only the KV blocks a query block can see.

On a CPU the kernels run only under TRITON_INTERPRET=1 (set before triton_kernels is imported).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from tandem.layers.attention.base import AttentionBackend, AttentionBatch, page_slots
from tandem.layers.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from tandem.layers.attention.triton_kernels import attention_kernel, merge_splits_kernel, store_kv_kernel
from tandem.runtime.uploads import to_device

LOG2E = 1.4426950408889634


# The shared metadata type carries the per-row lengths this backend reads (q_lens, kv_lens, causal).
TritonAttentionMetadata = TorchAttentionMetadata


def interpreting() -> bool:
    """Whether the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(attention_kernel).__name__ == "InterpretedFunction"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per program: Q_PER_BLOCK queries x GROUP heads, padded
    block_n: int  # KV entries per inner step
    q_per_block: int
    num_splits: int  # KV splits per (row, query block, KV head), merged by a second kernel; they
    # share out each row's KV blocks up to its length at run time
    num_warps: int = 4
    num_stages: int = 2


def launch_config(num_rows: int, lq: int, lkv: int, group: int, kv_heads: int, block_d: int, causal: bool,
                  dtype: torch.dtype, device: torch.device, num_kv_splits: int | None) -> LaunchConfig:
    """Depends on shapes only (never on values), so a captured CUDA graph replays the same launch.

    Tile sizes were chosen from sm_90 compiles (ptxas resource usage: no register spills for 16-bit
    dtypes at head_dim 64/128), not from timings; the fp32 path (tests) favours small tiles.
    """
    block_m = min(32 if dtype == torch.float32 else 64, max(16, triton.next_power_of_2(lq * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    q_per_block = block_m // group
    wide = block_d >= 128
    # The mask tile adds registers on top of the gathered K/V addresses: narrower KV steps there.
    block_n = 32 if dtype == torch.float32 or (wide and block_m >= 64 and not causal) else 64
    num_warps = 8 if wide else 4
    num_q_blocks = -(-lq // q_per_block)
    kv_blocks = max(1, -(-lkv // block_n))
    if num_kv_splits is None:
        num_kv_splits = 1
        programs = num_rows * num_q_blocks * kv_heads
        if device.type == "cuda" and kv_blocks >= 4:
            # Decode-like batches launch few programs: split the KV walk (flash-decoding) to fill the SMs.
            sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
            if programs < sms:
                num_kv_splits = min(-(-2 * sms // programs), kv_blocks // 2, 32)
    num_kv_splits = max(1, min(num_kv_splits, kv_blocks))
    return LaunchConfig(block_m, block_n, q_per_block, num_kv_splits, num_warps)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: TorchAttentionMetadata, scale: float, num_kv_splits: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [N, H, D] over the cache entries `metadata.kv_slots`; returns [N, H, D] (in `out`
    when given)."""
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError("the triton attention backend runs on a CPU only under TRITON_INTERPRET=1 "
                           "(set before tandem.layers.attention.triton_kernels is imported)")
    n, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    num_rows, lq = metadata.query_index.shape
    lkv = metadata.kv_slots.shape[1]
    group = num_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    causal = metadata.causal
    cfg = launch_config(num_rows, lq, lkv, group, kv_heads, block_d, causal, q.dtype, q.device, num_kv_splits)
    kv_lens, q_lens = metadata.kv_lens, metadata.q_lens
    # uint8 views: the kernels read bytes, whatever triton makes of a bool pointer.
    query_valid = metadata.query_valid.view(torch.uint8) if metadata.query_valid is not None else None
    mask = None if causal else metadata.mask.view(torch.uint8)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cfg.num_splits > 1:
        part_acc = torch.empty(num_rows * lq, num_heads, cfg.num_splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_rows * lq, num_heads, cfg.num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    dummy = metadata.kv_slots  # stands in for absent optional tensors (never read)
    num_q_blocks = -(-lq // cfg.q_per_block)

    grid = (num_rows * num_q_blocks, kv_heads, cfg.num_splits)
    attention_kernel[grid](
        q, k_cache, v_cache, out,
        metadata.query_index, query_valid if query_valid is not None else dummy, metadata.kv_slots,
        mask if mask is not None else dummy, q_lens if q_lens is not None else dummy,
        kv_lens if kv_lens is not None else dummy,
        part_acc, part_ml,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *metadata.query_index.stride(), *(query_valid.stride() if query_valid is not None else (0, 0)),
        *metadata.kv_slots.stride(),
        *((mask.stride(0), mask.stride(2), mask.stride(3)) if mask is not None else (0, 0, 0)),
        num_heads, lq, lkv, num_q_blocks,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP=group, Q_PER_BLOCK=cfg.q_per_block,
        HAS_VALID=query_valid is not None, CAUSAL=causal, HAS_KV_LENS=kv_lens is not None,
        NUM_SPLITS=cfg.num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        merge_splits_kernel[(num_rows * lq, num_heads)](
            part_acc, part_ml, out, metadata.query_index, query_valid if query_valid is not None else dummy,
            *out.stride(), *metadata.query_index.stride(), *(query_valid.stride() if query_valid is not None else (0, 0)),
            num_heads, lq,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=cfg.num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(cfg.num_splits)), HAS_VALID=query_valid is not None,
            num_warps=1 if block_d <= 64 else 2,
        )
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping] = k and v_cache[slot_mapping] = v in one kernel (k/v [N, KVH, D], any
    token and head strides, unit stride along D)."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        k_cache[slot_mapping] = k
        v_cache[slot_mapping] = v
        return
    store_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, slot_mapping.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                          KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
                          BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if kv_heads * head_dim <= 512 else 4)


class TritonAttentionBackend(AttentionBackend):
    derives_causal_mask = True
    accepts_stored_kv = True  # attention reads k/v from the cache only

    def __init__(self, num_kv_splits: int | None = None):
        # None: split the KV walk only when a batch launches too few programs to fill the GPU.
        self.num_kv_splits = num_kv_splits
        self._reference = TorchAttentionBackend()

    def plan(self, batch: AttentionBatch, device: torch.device) -> TritonAttentionMetadata:
        q_lens = torch.tensor(batch.query_lens, dtype=torch.int32)
        kv_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        lengths = dict(q_lens=to_device(q_lens, device), kv_lens=to_device(kv_lens, device))
        if batch.custom_masks is not None and any(m is not None for m in batch.custom_masks):
            base = self._reference.plan(batch, device)  # (lists a paged batch's slots)
            return TritonAttentionMetadata(base.slot_mapping, base.query_index, base.query_valid, base.kv_slots,
                                           base.mask, **lengths, causal=False)
        # All rows causal: the same index tensors as the torch plan, but no [B, Lq, Lkv] mask.
        q_range = torch.arange(int(q_lens.max()))
        query_valid = q_range[None, :] < q_lens[:, None]  # [B, Lq]
        starts = torch.cumsum(q_lens, 0) - q_lens
        query_index = torch.where(query_valid, starts[:, None] + q_range[None, :], 0).long()
        max_kv = int(kv_lens.max())
        if batch.kv_slots is None:  # paged: slots from the page tables, on the device
            page_rows = to_device(batch.page_rows(), device, torch.long)
            kv_pos = torch.arange(max_kv, device=device)[None, :].expand(page_rows.shape[0], -1)
            kv_slots = page_slots(page_rows, kv_pos, batch.page_size)  # (past a row's kv_len: never read)
        else:
            kv_valid = torch.arange(max_kv)[None, :] < kv_lens[:, None]  # [B, Lkv]
            kv_slots = torch.zeros(kv_valid.shape, dtype=torch.long)
            kv_slots[kv_valid] = torch.tensor([s for row in batch.kv_slots for s in row], dtype=torch.long)
            kv_slots = to_device(kv_slots, device)
        return TritonAttentionMetadata(
            slot_mapping=to_device(batch.slot_mapping, device, torch.long),
            query_index=to_device(query_index, device), query_valid=to_device(query_valid, device),
            kv_slots=kv_slots, mask=None, **lengths, causal=True,
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float,
                kv_stored: bool = False):
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return paged_attention(q, k_cache, v_cache, metadata, scale, self.num_kv_splits)

    def forward_into(self, out, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float,
                     kv_stored: bool = False) -> None:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        paged_attention(q, k_cache, v_cache, metadata, scale, self.num_kv_splits, out=out)
