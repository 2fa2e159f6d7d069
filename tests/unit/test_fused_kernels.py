"""The fused triton kernels (RMSNorm with and without the residual add, in-place rotary, SiLU-and-mul)
against the layers' torch code. Without a GPU they run in triton's CPU interpreter (float32); with
one, compiled, in float32 and bfloat16."""

import os
import sys

import pytest
import torch
from torch.nn import functional as F

if not torch.cuda.is_available() and "tandem.layers.fused_kernels" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from tandem.layers import fused_kernels  # noqa: E402
from tandem.layers.norm import RMSNorm  # noqa: E402
from tandem.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 4096])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    norm = norm.to(DEVICE, dtype)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(DEVICE, dtype)
    res = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(fused_kernels.rms_norm(x, norm.weight, 1e-5), norm._norm(x), **tol(dtype))
    out, new_res = fused_kernels.rms_norm(x, norm.weight, 1e-5, residual=res)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)  # one rounding, as torch
    torch.testing.assert_close(out, norm._norm(x + res), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 128])
def test_rotary_in_place_on_strided_views(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, n = 4, 2, 9
    rope = RotaryEmbedding(head_dim, 512, 500000.0, {"rope_type": "llama3", "factor": 8.0}).to(DEVICE)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)  # views of the projection output, as in the model
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.randint(0, 512, (n,), generator=gen).to(DEVICE)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    fused_kernels.rotary_(positions, q, k, rope.cos, rope.sin)
    # float32: exact up to the last bit; bfloat16: at most one unit in the last place (the compiled
    # kernel's fp32 -> bf16 conversions and torch's may round a tie differently).
    exact = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(q, want_q, **exact)
    torch.testing.assert_close(k, want_k, **exact)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_stores_rotated_k_and_v_into_the_cache(dtype):
    """With `store`, the kernel also writes the rotated k and the untouched v into the cache at
    slot_mapping (the attention layer's separate KV store, fused); other slots keep their contents."""
    gen = torch.Generator().manual_seed(11)
    head_dim, heads, kv_heads, n, num_slots = 64, 4, 2, 5, 32
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([3, 17, 0, 31, 8], device=DEVICE)
    positions = torch.randint(0, 512, (n,), generator=gen).to(DEVICE)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_k_cache[slots], want_v_cache[slots] = want_k, v
    fused_kernels.rotary_(positions, q, k, rope.cos, rope.sin, store=(v, k_cache, v_cache, slots))
    exact = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(q, want_q, **exact)
    torch.testing.assert_close(k_cache, want_k_cache, **exact)
    assert torch.equal(v_cache, want_v_cache)


def test_rotary_with_broadcast_positions():
    """Tree drafting gives every frontier node of a request the same position: one value expanded
    (stride 0). The kernel must read position i at its stride, not at i (it read past the tensor)."""
    gen = torch.Generator().manual_seed(7)
    head_dim, heads, kv_heads, k = 64, 2, 1, 4
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    q = torch.randn(k, heads, head_dim, generator=gen).to(DEVICE)
    kk = torch.randn(k, kv_heads, head_dim, generator=gen).to(DEVICE)
    base = torch.tensor([300], device=DEVICE)
    positions = base[:, None].expand(1, k).reshape(-1)  # as plan.draft_step_metadata builds them
    assert positions.stride(0) == 0
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(kk, cos, sin)
    fused_kernels.rotary_(positions, q, kk, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kk, want_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 4).to(DEVICE, dtype)
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(fused_kernels.silu_mul(gate_up), F.silu(gate) * up, **tol(dtype))
