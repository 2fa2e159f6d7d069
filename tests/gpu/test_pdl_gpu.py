"""Programmatic dependent launch (layers/pdl.py) inside a CUDA graph: a decoder layer's chain of cuBLAS
GEMMs and tandem's Triton kernels (RMSNorm with the residual add, KV store and split-KV attention with its
merge, SiLU-and-mul), replayed with new inputs each time, gives bit for bit what the same graph captured
without PDL gives. A kernel that read before its wait would see the previous replay's values."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("programmatic dependent launch needs sm90 or later", allow_module_level=True)

from tandem.layers import fused_kernels, pdl  # noqa: E402
from tandem.layers.attention.triton_backend import TritonAttentionBackend, interpreting  # noqa: E402
from tandem.speculative import plan as spec_plan  # noqa: E402
from tandem.speculative.tree import ancestor_mask  # noqa: E402

if interpreting():
    pytest.skip("TRITON_INTERPRET=1 is set: these tests need the compiled kernels", allow_module_level=True)

DEVICE = torch.device("cuda")
H, HEADS, KV_HEADS, D, INTER = 1024, 8, 2, 128, 2816
PAGE_SIZE, KV_BOUND, ROWS = 16, 1024, 2  # two rows of a long prefix: split-KV attention and its merge


def layer(x, w, cache, meta, backend):
    """attention block and MLP of one decoder layer, on bf16 activations [ROWS, H]."""
    normed, residual = fused_kernels.rms_norm(x, w["ln1"], 1e-5, residual=w["res_in"])
    q, k, v = (normed @ w["qkv"].T).split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1)
    attn = backend.forward(q.reshape(ROWS, HEADS, D), k.reshape(ROWS, KV_HEADS, D), v.reshape(ROWS, KV_HEADS, D),
                           cache[0], cache[1], meta, D ** -0.5)
    normed, residual = fused_kernels.rms_norm(attn.reshape(ROWS, -1) @ w["o"].T, w["ln2"], 1e-5, residual=residual)
    out = fused_kernels.silu_mul(normed @ w["gate_up"].T) @ w["down"].T
    return out + residual


def captured(use_pdl: bool, w, meta, x_static, cache):
    os.environ["TANDEM_DISABLE_PDL"] = "0" if use_pdl else "1"
    try:
        backend = TritonAttentionBackend()
        layer(x_static, w, cache, meta, backend)  # compile this PDL variant outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x_static, w, cache, meta, backend)
        return graph, out
    finally:
        os.environ.pop("TANDEM_DISABLE_PDL", None)


def test_a_layer_graphed_with_pdl_equals_the_same_graph_without():
    assert pdl.enabled(torch.empty(1, device=DEVICE)), "PDL should be on for an sm90 tensor"
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(torch.bfloat16)

    w = {"ln1": 1 + rand(H), "ln2": 1 + rand(H), "res_in": rand(ROWS, H, scale=1.0),
         "qkv": rand((HEADS + 2 * KV_HEADS) * D, H), "o": rand(H, HEADS * D),
         "gate_up": rand(2 * INTER, H), "down": rand(H, INTER)}
    pages = torch.arange(ROWS * KV_BOUND // PAGE_SIZE, device=DEVICE).view(ROWS, -1)
    seq_lens = torch.full((ROWS,), 900, device=DEVICE)
    meta = spec_plan.verify_metadata(spec_plan.plan_verify(pages, seq_lens, 1, KV_BOUND, PAGE_SIZE),
                                     ancestor_mask(torch.full((ROWS, 1), -1, device=DEVICE)))
    cache0 = [rand(ROWS * KV_BOUND, KV_HEADS, D, scale=1.0) for _ in range(2)]
    runs = {}
    for use_pdl in (False, True):
        x_static = torch.zeros(ROWS, H, dtype=torch.bfloat16, device=DEVICE)
        cache = [c.clone() for c in cache0]
        graph, out = captured(use_pdl, w, meta, x_static, cache)
        outs = []
        for i in range(20):
            x_static.copy_(torch.randn(ROWS, H, generator=torch.Generator(device=DEVICE).manual_seed(100 + i),
                                       device=DEVICE).to(torch.bfloat16))
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        runs[use_pdl] = torch.stack(outs)
    assert runs[False].abs().sum() > 0 and not torch.equal(runs[False][0], runs[False][1])  # inputs changed
    assert torch.equal(runs[True], runs[False])
