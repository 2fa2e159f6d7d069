"""The sampling kernel compiled on a GPU, at a real vocabulary (128,256 tokens), against the torch
reference (a sort, and the noise written out): the same token on every row for temperature, top-p,
min-p, top-k and greedy rows, and inside a CUDA graph."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from tandem.layers.sampler import (  # noqa: E402
    SAMPLED_TOP_K,
    SamplingMetadata,
    choose_tokens,
    sample_reference,
)
from tandem.request import SamplingParams  # noqa: E402

VOCAB = 128_256
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9),
          SamplingParams(temperature=0.7, top_p=0.5, min_p=0.01), SamplingParams(temperature=1.0, top_k=50),
          SamplingParams(temperature=0.8, top_k=200, top_p=0.95), SamplingParams(temperature=0.0)]


def inputs(rows: int, seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=gen) * scale).cuda()
    params = [PARAMS[i % len(PARAMS)] for i in range(rows)]
    seeds = torch.randint(0, 2**62, (rows,), generator=gen).tolist()
    positions = torch.randint(0, 100_000, (rows,), generator=gen).tolist()
    return logits, SamplingMetadata.from_params(params, positions, device="cuda", seeds=seeds)


@pytest.mark.parametrize("rows", [6, 128])
@pytest.mark.parametrize("scale", [0.3, 4.0], ids=["flat", "peaked"])  # random-weight models are flat
def test_kernel_equals_reference(rows, scale):
    logits, meta = inputs(rows, seed=rows, scale=scale)
    got = choose_tokens(logits, meta, SAMPLED_TOP_K)
    want = sample_reference(logits, meta)
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()


def test_kernel_replays_in_a_cuda_graph():
    logits, meta = inputs(32, seed=5, scale=2.0)
    choose_tokens(logits, meta, SAMPLED_TOP_K)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = choose_tokens(logits, meta, SAMPLED_TOP_K)
    meta.position += 1  # new inputs in the same buffers
    graph.replay()
    assert torch.equal(out, sample_reference(logits, meta))
