"""The sampling kernel (layers/sampling_kernels.py: the race, top-p and min-p by pivot rounds, greedy
rows) against `sample_reference` (a sort and the noise written out in torch). Without a GPU the kernel
runs in triton's CPU interpreter (TRITON_INTERPRET=1, set here before it is imported); with one, compiled."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "tandem.layers.sampling_kernels" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.2,<4')")

from tandem.layers.sampler import (  # noqa: E402
    SamplingMetadata,
    inverse_temperature,
    sample_reference,
    top_k_threshold,
)
from tandem.layers.sampling_kernels import sample_triton  # noqa: E402
from tandem.request import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, top_p=0.5, top_k=3),  # filters on a greedy row change nothing
    SamplingParams(temperature=1.0, top_p=0.05),  # usually just the most likely token
]


def kernel(logits, meta, pivot_rounds=None):
    inv_t = inverse_temperature(meta)
    kth = top_k_threshold(logits * inv_t[:, None], meta)
    return sample_triton(logits, inv_t, kth, meta.temperature, meta.top_p, meta.min_p, meta.seed, meta.position,
                         pivot_rounds=pivot_rounds)


def rows(vocab: int, copies: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = PARAMS * copies
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    positions = torch.randint(0, 10_000, (len(params),), generator=gen).tolist()
    seeds = torch.randint(0, 2**62, (len(params),), generator=gen).tolist()
    meta = SamplingMetadata.from_params(params, positions, seeds=seeds)
    return logits, meta


@pytest.mark.parametrize("vocab,copies", [(37, 6), (3000, 6), (40_000, 1)])  # 40k: round 1 in two slices
def test_kernel_draws_the_reference_token(vocab, copies):
    from tandem.layers.sampling_kernels import _num_parts

    logits, meta = rows(vocab, copies=copies, seed=vocab)
    assert _num_parts(logits.shape[0], vocab) == (2 if vocab == 40_000 else 1)
    move = lambda t: t.to(DEVICE)  # noqa: E731
    meta_dev = SamplingMetadata(*(move(getattr(meta, f)) for f in (
        "temperature", "top_k", "top_p", "min_p", "seed", "position", "repetition_penalty", "frequency_penalty",
        "presence_penalty")))
    got = kernel(move(logits), meta_dev).cpu()
    want = sample_reference(logits, meta)
    assert torch.equal(got, want), [(i, PARAMS[i % len(PARAMS)]) for i in (got != want).nonzero().flatten().tolist()]


@pytest.mark.parametrize("pivot_rounds", [0, 1, 3])  # 0: the per-row settle alone; 1: most rows reach it
def test_kernel_needs_several_rounds_and_stays_exact(pivot_rounds):
    """A flat row and top-p 0.3: the first drawn token is often outside the nucleus, so the pivot
    rounds run, over all slices at once and then per row; every row must still give the reference's token."""
    vocab, n = 200, 60
    logits = torch.linspace(0, 2, vocab).repeat(n, 1)
    params = [SamplingParams(temperature=1.0, top_p=0.3)] * n
    meta = SamplingMetadata.from_params(params, list(range(n)), seeds=[7] * n)
    want = sample_reference(logits, meta)
    assert len(set(want.tolist())) > 5
    got = kernel(logits.to(DEVICE), SamplingMetadata(*(getattr(meta, f).to(DEVICE) for f in (
        "temperature", "top_k", "top_p", "min_p", "seed", "position", "repetition_penalty", "frequency_penalty",
        "presence_penalty"))), pivot_rounds).cpu()
    assert torch.equal(got, want)


def test_ties_and_masked_tokens():
    """Tied logits at the top-p cut stay together (the reference's rule); -inf tokens never win."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, float("-inf"), 0.5]] * 40)
    params = [SamplingParams(temperature=1.0, top_p=0.4)] * 20 + [SamplingParams(temperature=1.0)] * 20
    meta = SamplingMetadata.from_params(params, list(range(40)), seeds=list(range(40)))
    want = sample_reference(logits, meta)
    got = kernel(logits.to(DEVICE), SamplingMetadata(*(getattr(meta, f).to(DEVICE) for f in (
        "temperature", "top_k", "top_p", "min_p", "seed", "position", "repetition_penalty", "frequency_penalty",
        "presence_penalty")))).cpu()
    assert torch.equal(got, want)
    assert set(got[:20].tolist()) == {0, 1, 2}  # the tie group, and only it
    assert 4 not in got.tolist()
