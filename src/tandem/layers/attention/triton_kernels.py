"""Triton kernels for paged attention: one kernel for every row shape (prefill/extend chunks, decodes,
verify trees, draft-tree rows), plus the reduction that merges split-KV partial results.

Each program takes one row b, one KV head and a block of that row's queries. The query heads that
share the KV head are packed into the M dimension (GQA: row r of the block is query r // GROUP,
head kv_head * GROUP + r % GROUP), so each K/V block is loaded once per group. K/V are gathered
straight from the cache through `kv_slots[b, j]` (no padded copy), and the softmax is computed
online over KV blocks in fp32, in base 2 (exp2 with log2(e) folded into the scale).

Under TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attention_kernel(
    Q, K, V, Out,  # q [N, H, D], k/v cache [slots, KVH, D], out [N, H, D]
    QueryIndex, QueryValid, KvSlots, Mask, QLens, KvLens,  # per-row metadata (see backend)
    PartAcc, PartMl,  # split-KV partials: [B*Lq, H, S, BLOCK_D] fp32 and [B*Lq, H, S, 2] fp32
    scale_log2,  # softmax scale * log2(e)
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_qib, stride_qij, stride_qvb, stride_qvj, stride_kvb, stride_kvj,  # [B, Lq] / [B, Lkv] metadata
    stride_mb, stride_mq, stride_mk,
    num_heads, Lq, Lkv, num_q_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, Q_PER_BLOCK: tl.constexpr,
    HAS_VALID: tl.constexpr,  # query_valid given: padded queries are not written
    CAUSAL: tl.constexpr,  # mask derived from q_lens/kv_lens; `Mask` is never read
    HAS_KV_LENS: tl.constexpr,  # KvLens bounds each row's KV loop (else every row runs to Lkv)
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 from the loaded values (the interpreter cannot do bf16 math)
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // num_q_blocks
    q_block = pid % num_q_blocks

    rows = tl.arange(0, BLOCK_M)
    q_local = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    qi = q_block * Q_PER_BLOCK + q_local  # query index within the row
    row_ok = (q_local < Q_PER_BLOCK) & (qi < Lq)
    qi = tl.where(row_ok, qi, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    tok = tl.load(QueryIndex + b * stride_qib + qi * stride_qij, mask=row_ok, other=0).to(tl.int64)  # flat token row
    q = tl.load(Q + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    if HAS_VALID:
        valid = row_ok & (tl.load(QueryValid + b * stride_qvb + qi * stride_qvj, mask=row_ok, other=0) != 0)
    else:
        valid = row_ok

    if HAS_KV_LENS:
        kv_len = tl.load(KvLens + b)
    else:
        kv_len = Lkv
    hi = kv_len
    if CAUSAL:
        q_len = tl.load(QLens + b)
        diag = kv_len - q_len  # query i sits at KV index diag + i
        first_q = q_block * Q_PER_BLOCK
        n_here = tl.minimum(first_q + Q_PER_BLOCK, q_len) - first_q
        # The block's last query sees up to diag + first_q + n_here - 1; a block of padding sees nothing.
        hi = tl.where(n_here > 0, diag + first_q + n_here, 0)
    # The splits share out the blocks this program visits (up to its row's length), not the whole
    # window: with CUDA graphs the window is as wide as the longest possible request.
    per_split = (hi + BLOCK_N * NUM_SPLITS - 1) // (BLOCK_N * NUM_SPLITS)  # blocks per split
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(hi, lo + per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: an all-masked block keeps alpha = 1
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        if CAUSAL:
            allowed = col_ok[None, :] & (cols[None, :] <= (diag + qi)[:, None])
            any_allowed = True
        else:
            allowed = tl.load(Mask + b * stride_mb + qi[:, None] * stride_mq + cols[None, :] * stride_mk,
                              mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            # Padded KV windows (speculative plans) leave whole blocks masked: skip their K/V loads.
            any_allowed = tl.max(allowed.to(tl.int32)) > 0
        if any_allowed:
            slots = tl.load(KvSlots + b * stride_kvb + cols * stride_kvj, mask=col_ok, other=0).to(tl.int64)
            k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    if NUM_SPLITS == 1:
        # A query that sees nothing (only padding can) gets zeros instead of SDPA's NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if HAS_VALID:
            out_row = tok
        else:
            out_row = b * Lq + qi
        tl.store(Out + out_row[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])
    else:
        part = ((b * Lq + qi).to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        # Padded queries too: the merge reads every (query, head) and must not see uninitialised memory.
        tl.store(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PartMl + part * 2, m_i, mask=row_ok)
        tl.store(PartMl + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    PartAcc, PartMl, Out, QueryIndex, QueryValid,
    stride_on, stride_oh, stride_od, stride_qib, stride_qij, stride_qvb, stride_qvj,
    num_heads, Lq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    """One (query, head) per program: rescale each split's partial sums to the global max and add."""
    row = tl.program_id(0)  # b * Lq + i
    head = tl.program_id(1)
    b = row // Lq
    qi = row % Lq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    part = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(PartMl + part * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(PartMl + part * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.math.exp2(m - tl.max(m, 0))  # [BLOCK_S]; empty splits have l = 0, acc = 0
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    d_ok = offs_d < HEAD_DIM
    if HAS_VALID:
        # Loaded as a vector (one address): triton's interpreter rejects a scalar & vector store mask.
        valid = tl.load(QueryValid + b * stride_qvb + qi * stride_qvj + offs_d * 0) != 0
        out_row = tl.load(QueryIndex + b * stride_qib + qi * stride_qij).to(tl.int64)
        tl.store(Out + out_row * stride_on + head * stride_oh + offs_d * stride_od,
                 out.to(Out.dtype.element_ty), mask=d_ok & valid)
    else:
        tl.store(Out + row.to(tl.int64) * stride_on + head * stride_oh + offs_d * stride_od,
                 out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def store_kv_kernel(K, V, KCache, VCache, SlotMapping, stride_slot, stride_kn, stride_kh, stride_vn, stride_vh,
                    stride_cn, stride_ch, stride_dn, stride_dh,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Writes token i's k and v (all KV heads) into cache slot SlotMapping[i]: one kernel for both."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + i * stride_slot).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(K + i * stride_kn + h * stride_kh + d, mask=ok)
    v = tl.load(V + i * stride_vn + h * stride_vh + d, mask=ok)
    tl.store(KCache + slot * stride_cn + h * stride_ch + d, k, mask=ok)
    tl.store(VCache + slot * stride_dn + h * stride_dh + d, v, mask=ok)
