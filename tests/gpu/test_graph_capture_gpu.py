"""Capture's eager warm-up runs on a stream of its own: it must see the static inputs the current
stream filled. Without the wait, a busy current stream left the fills queued and the warm-up read
recycled memory (an earlier engine's values): device-side index asserts at start-up on an H200."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tandem.runtime.cuda_graphs import GraphedFunction, GraphInput  # noqa: E402


def test_warm_up_sees_the_padded_inputs():
    device = torch.device("cuda")
    n = 1 << 20
    seen = torch.empty(n, dtype=torch.long, device=device)
    # Recycled memory full of a value that is no pad: the static input below is carved out of it.
    torch.empty(n, dtype=torch.long, device=device).fill_(7)

    def fn(x):
        seen.copy_(x)  # what the warm-up read
        return (x + 1,)

    graphed = GraphedFunction("probe", fn, [GraphInput((), torch.long, 3)], device)
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the current stream busy, so its fill is still queued
    graphed.capture(n, stream)
    torch.cuda.synchronize()
    assert bool((seen == 3).all()), f"the warm-up read {seen.unique()[:8].tolist()}, not the pad value 3"
    out, = graphed(torch.full((n,), 5, dtype=torch.long, device=device))
    assert bool((out == 6).all())
