"""Seeded sampling on the GPU: plain eager decoding is the reference, and every other way of running
the same seeded requests must give its tokens: graphed plain decoding (the decode graphs sample inside),
speculation through the sampled whole-iteration graphs (chain and tree, both attention backends,
overlap on and off), the eager pipeline with and without the plan stream, penalties (eager steps), and
stream delay injection. Also PyTorch's CUDA sanitizer on the sampled eager pipeline."""

import json

import pytest
import torch

from tests.gpu.test_overlap_gpu import outputs, run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DELAY = {"TANDEM_STREAM_DELAY_CYCLES": "20000000"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_seeded_models")


@pytest.fixture(scope="module", params=["seeded", "seeded-penalties"])
def sampling(request):
    return request.param


@pytest.fixture(scope="module")
def plain_eager(root, sampling):
    return outputs(root, "--plain", "--no-graph", "--sampling", sampling)


def test_graphed_plain_decode(root, plain_eager, sampling):
    assert outputs(root, "--plain", "--sampling", sampling) == plain_eager


@pytest.mark.parametrize("backend", [[], ["--triton"]], ids=["torch", "triton"])
@pytest.mark.parametrize("tree", [[], ["--tree"]], ids=["chain", "tree"])
def test_graphed_speculation(root, plain_eager, sampling, backend, tree):
    for flags in ([], ["--no-overlap"]):
        got = outputs(root, *flags, *backend, *tree, "--sampling", sampling)
        assert got == plain_eager, f"flags {flags + backend + tree}"


def test_eager_pipeline_with_and_without_plan_stream(root, plain_eager, sampling):
    for flags in ([], ["--no-plan"], ["--tree"]):
        assert outputs(root, "--no-graph", *flags, "--sampling", sampling) == plain_eager, f"flags {flags}"


def test_self_draft_accepts_sampled_drafts(root, plain_eager, sampling):
    assert outputs(root, "--self-draft", "--tree", "--sampling", sampling) == plain_eager


def test_delay_injection(root, plain_eager, sampling):
    assert outputs(root, "--tree", "--sampling", sampling, env=DELAY) == plain_eager
    assert outputs(root, "--no-graph", "--tree", "--sampling", sampling, env=DELAY) == plain_eager


def test_cuda_sanitizer_on_sampled_pipeline(root, plain_eager, sampling):
    proc = run(root, "--no-graph", "--tree", "--sampling", sampling, env={"TORCH_CUDA_SANITIZER": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "CSAN" not in proc.stderr and "data race" not in proc.stderr.lower()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == plain_eager
