"""CUDA graphs and fused kernels on the GPU: captured plain decode and captured speculative phases
(draft tree, verify, draft extend) give the eager, unfused plain greedy output in float32, with both attention backends, with
and without overlap, and under stream delay injection (where removing an edge still shows)."""

import json

import pytest
import torch

from tests.gpu.test_overlap_gpu import NEGATIVE, outputs, run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_graph_models")


@pytest.fixture(scope="module")
def eager_plain(root):
    """The reference: plain decoding, eager, plain torch ops (no fused kernels)."""
    return outputs(root, "--plain", "--no-graph", env={"TANDEM_DISABLE_FUSED_KERNELS": "1"})


def test_fused_kernels_keep_eager_output(root, eager_plain):
    assert outputs(root, "--plain", "--no-graph") == eager_plain


@pytest.mark.parametrize("backend", [[], ["--triton"]], ids=["torch", "triton"])
def test_graphed_plain_decode_equals_eager(root, eager_plain, backend):
    assert outputs(root, "--plain", *backend) == eager_plain


@pytest.mark.parametrize("backend", [[], ["--triton"]], ids=["torch", "triton"])
@pytest.mark.parametrize("tree", [[], ["--tree"]], ids=["chain", "tree"])
def test_graphed_speculation_equals_eager_plain(root, eager_plain, backend, tree):
    for flags in ([], ["--no-overlap"]):
        assert outputs(root, *flags, *backend, *tree) == eager_plain, f"flags {flags + backend + tree}"


def test_self_draft_with_graphs(root, eager_plain):
    assert outputs(root, "--self-draft", "--triton") == eager_plain


@pytest.mark.parametrize("tree", [[], ["--tree"]], ids=["chain", "tree"])
def test_logprob_steps_with_graphs(root, eager_plain, tree):
    """Logprob requests replay the whole-iteration graph with every sampling stage (GENERAL)."""
    assert outputs(root, "--triton", "--logprobs", *tree) == eager_plain
    assert outputs(root, "--plain", "--logprobs") == eager_plain


@pytest.mark.parametrize("edge", sorted(NEGATIVE))
def test_delay_injection_with_graphs(root, eager_plain, edge):
    """The overlap test's negative control with the phase graphs replayed (the whole-iteration graphs
    dropped: they run on one stream and have no cross-stream edge to remove): the same delays keep
    the output with every wait in place, and removing the wait lets the consumer read too early."""
    env = {"TANDEM_STREAM_DELAY_CYCLES": "200000000", "TANDEM_STREAM_DELAY_BUFFERS": NEGATIVE[edge]}
    assert outputs(root, "--self-draft", "--triton", "--phase-graphs", env=env) == eager_plain
    proc = run(root, "--drop", edge, "--self-draft", "--triton", "--phase-graphs", env=env)
    if proc.returncode == 0:
        assert json.loads(proc.stdout.strip().splitlines()[-1]) != eager_plain, "the missing wait went unseen"
