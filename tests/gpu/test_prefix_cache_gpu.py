"""Prefix caching on the GPU: requests behind a shared prefix, then each one's next turn (its prompt,
its answer and more), must give the tokens plain eager decoding gives with the cache off, whatever runs
them: CUDA graphs, overlap, the plan stream, trees on the triton backend, stream delay injection, greedy
and seeded rows. Float32, where speculation's output is plain decoding's token for token."""

import pytest
import torch

from tests.gpu.test_overlap_gpu import outputs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DELAY = {"TANDEM_STREAM_DELAY_CYCLES": "20000000"}
TURNS = ("--shared-prefix",)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_prefix_models")


@pytest.fixture(scope="module", params=["greedy", "seeded"])
def case(request, root):
    sampling = ("--sampling", request.param)
    return sampling, outputs(root, "--plain", "--no-graph", "--no-prefix-cache", *TURNS, *sampling)


@pytest.mark.parametrize("flags", [["--plain"], [], ["--no-overlap"], ["--no-plan"], ["--triton", "--tree"],
                                   ["--no-graph"]],
                         ids=["plain-graphed", "chain", "chain-no-overlap", "chain-no-plan", "triton-tree", "eager"])
def test_hits_give_the_tokens_of_no_cache(root, case, flags):
    sampling, reference = case
    assert outputs(root, *flags, *TURNS, *sampling) == reference


def test_hits_under_delay_injection(root, case):
    sampling, reference = case
    assert outputs(root, *TURNS, *sampling, env=DELAY) == reference
