"""Triton kernels that fuse the small element-wise steps of a decoder layer: RMSNorm (optionally with
the residual add before it), rotary embedding of q and k in place, and SiLU(gate) * up.

Why: in a CUDA-graphed decode step the GEMMs are near the bandwidth floor, and what is left is
hundreds of tiny kernels (an unfused RMSNorm is eight, rotary about eighteen per layer), each
costing a couple of microseconds however little it does (docs/performance.md has the profile).

Numerics follow the torch code in norm.py / rotary.py / llama.py (Hugging Face Llama): values are
rounded to the model dtype exactly where torch rounds them, so only the order of the RMSNorm sum
differs. Under TRITON_INTERPRET=1 (set before import) they run on a CPU, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, Residual, Weight, Out, ResidualOut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # torch: residual = x + residual in the model dtype (one rounding), then the norm of that.
        x = (x.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(Out.dtype.element_ty).to(tl.float32)  # torch: x.to(dtype) before the scale
    w = tl.load(Weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [N, H] -> weight * norm(x), or with `residual`: (weight * norm(x + residual), x + residual)."""
    n, h = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), "rows must be contiguous"
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if n:
        _rms_norm_kernel[(n,)](
            x, residual if residual is not None else x, weight, out, res_out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
            h, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(h),
            num_warps=4 if h <= 4096 else 8)
    return out if residual is None else (out, res_out)


@triton.jit
def _rotary_kernel(Q, K, V, KCache, VCache, SlotMapping, Positions, Cos, Sin, stride_pos, stride_qn, stride_qh,
                   stride_kn, stride_kh, stride_vn, stride_vh, stride_slot, stride_kcn, stride_kch, stride_vcn,
                   stride_vch, stride_cos, num_q_heads, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   STORE: tl.constexpr):
    """One program per (token, head). With STORE, the programs of k heads also write the rotated k
    and the token's v head into cache slot SlotMapping[token]: the separate KV-store kernel is saved."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_k = head >= num_q_heads
    if is_k:
        base = K + tok * stride_kn + (head - num_q_heads) * stride_kh
    else:
        base = Q + tok * stride_qn + head * stride_qh
    cols = tl.arange(0, BLOCK)
    ok = cols < HALF
    pos = tl.load(Positions + tok * stride_pos).to(tl.int64)
    x1 = tl.load(base + cols, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=ok, other=0.0)
    dt = x1.dtype
    # torch: cos/sin cast to the model dtype; x*cos and rotate_half(x)*sin rounded, then their sum.
    c = tl.load(Cos + pos * stride_cos + cols, mask=ok, other=0.0).to(dt).to(tl.float32)
    s = tl.load(Sin + pos * stride_cos + cols, mask=ok, other=0.0).to(dt).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (x1f * c).to(dt).to(tl.float32) + (-x2f * s).to(dt).to(tl.float32)
    out2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    tl.store(base + cols, out1.to(dt), mask=ok)
    tl.store(base + HALF + cols, out2.to(dt), mask=ok)
    if STORE:
        if is_k:
            kv_head = head - num_q_heads
            slot = tl.load(SlotMapping + tok * stride_slot).to(tl.int64)
            kc = KCache + slot * stride_kcn + kv_head * stride_kch
            tl.store(kc + cols, out1.to(dt), mask=ok)
            tl.store(kc + HALF + cols, out2.to(dt), mask=ok)
            v_row = V + tok * stride_vn + kv_head * stride_vh
            vc = VCache + slot * stride_vcn + kv_head * stride_vch
            tl.store(vc + cols, tl.load(v_row + cols, mask=ok), mask=ok)
            tl.store(vc + HALF + cols, tl.load(v_row + HALF + cols, mask=ok), mask=ok)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Rotates q [N, Hq, D] and k [N, Hk, D] in place (rotate-half layout); cos/sin [P, D/2] float32.
    positions [N] may be strided, even broadcast (stride 0: tree drafting's frontier nodes share one).
    `store` = (v, k_cache, v_cache, slot_mapping): also k_cache[slot_mapping] = rotated k and
    v_cache[slot_mapping] = v, in the same kernel (v and the caches with unit stride along D)."""
    n, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and positions.shape == (n,)
    if store is None:
        v = k_cache = v_cache = k  # unused: the kernel's STORE branch is compiled out
        slots = positions
    else:
        v, k_cache, v_cache, slots = store
        assert v.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and slots.shape == (n,)
    if n:
        _rotary_kernel[(n, hq + hk)](q, k, v, k_cache, v_cache, slots, positions, cos, sin, positions.stride(0),
                                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                     slots.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                                     v_cache.stride(1), cos.stride(0), hq, HALF=d // 2,
                                     BLOCK=triton.next_power_of_2(d // 2), STORE=store is not None, num_warps=1)
    return q, k


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_in, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(GateUp + row * stride_in + cols, mask=ok, other=0.0)
    u = tl.load(GateUp + row * stride_in + n_cols + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # torch rounds silu's output first
    tl.store(Out + row * stride_out + cols, (act * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate first) -> SiLU(gate) * up, [N, I]."""
    n, two_i = gate_up.shape
    assert gate_up.stride(1) == 1, "rows must be contiguous"
    i = two_i // 2
    out = torch.empty((n, i), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up, out, gate_up.stride(0), out.stride(0), i, BLOCK=block,
                                                     num_warps=4)
    return out
