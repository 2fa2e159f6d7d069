"""Seeded sampling on the GPU: plain eager decoding is the reference, and every other way of running
the same seeded requests must give its tokens: graphed plain decoding (the decode graphs sample inside),
speculation through the sampled whole-iteration graphs (chain and tree, both attention backends,
overlap on and off), the eager pipeline with and without the plan stream, penalties (eager steps), and
stream delay injection. Also PyTorch's CUDA sanitizer on the sampled eager pipeline, and the same guarantee on
the demo pair, whose trained head gets drafts accepted in sampled rows as a random head's rarely are.

All of it in float32, where speculation's output is plain decoding's token for token. In bf16 and fp16 a
verify over k+1 tokens rounds differently from a decode over one, and at a near-tie of the target's two
best tokens the two can differ (bench/precision_equality.py measures how often)."""

import json

import pytest
import torch

from tests.gpu.test_overlap_gpu import outputs, run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DELAY = {"TANDEM_STREAM_DELAY_CYCLES": "20000000"}
SEEDED = ("--sampling", "seeded")  # temperature, top-p, top-k, min-p and greedy rows
PENALTIES = ("--sampling", "seeded-penalties")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_seeded_models")


@pytest.fixture(scope="module")
def plain_eager(root):
    return outputs(root, "--plain", "--no-graph", *SEEDED)


@pytest.fixture(scope="module")
def plain_eager_penalties(root):
    return outputs(root, "--plain", "--no-graph", *PENALTIES)


def test_graphed_plain_decode(root, plain_eager):
    assert outputs(root, "--plain", *SEEDED) == plain_eager


@pytest.mark.parametrize("flags", [[], ["--no-overlap"], ["--triton", "--tree"], ["--triton", "--tree", "--no-overlap"]],
                         ids=["torch-chain", "torch-chain-no-overlap", "triton-tree", "triton-tree-no-overlap"])
def test_graphed_speculation(root, plain_eager, flags):
    assert outputs(root, *flags, *SEEDED) == plain_eager


@pytest.mark.parametrize("flags", [[], ["--no-overlap"], ["--triton", "--logprobs"], ["--no-graph"]],
                         ids=["graphed", "graphed-no-overlap", "triton-logprobs", "eager"])
def test_dormant_rows_decode_as_plain(root, plain_eager, flags):
    """Every request admitted dormant: plain decoding's step on the speculative pool (its graphs)."""
    assert outputs(root, "--dormant", *flags, *SEEDED) == plain_eager


def test_dormant_rows_with_penalties(root, plain_eager_penalties):
    assert outputs(root, "--dormant", *PENALTIES) == plain_eager_penalties


@pytest.mark.parametrize("flags", [[], ["--no-plan"], ["--tree"]], ids=["chain", "no-plan", "tree"])
def test_eager_pipeline(root, plain_eager, flags):
    assert outputs(root, "--no-graph", *flags, *SEEDED) == plain_eager


def test_self_draft_accepts_sampled_drafts(root, plain_eager):
    assert outputs(root, "--self-draft", "--tree", *SEEDED) == plain_eager


def test_delay_injection(root, plain_eager):
    assert outputs(root, "--tree", *SEEDED, env=DELAY) == plain_eager
    assert outputs(root, "--no-graph", "--tree", *SEEDED, env=DELAY) == plain_eager


@pytest.mark.parametrize("flags", [["--tree"], ["--no-graph"], ["--plain"]], ids=["spec-tree", "spec-eager", "plain-graphed"])
def test_penalties(root, plain_eager_penalties, flags):
    assert outputs(root, *flags, *PENALTIES) == plain_eager_penalties


@pytest.fixture(scope="module")
def demo_plain_eager(root):
    return outputs(root, "--demo", "--plain", "--no-graph", *SEEDED)


# Each a configuration of the speculative engine: graphs or eager steps, overlap, the plan stream, a tree,
# and stream delay injection on the eager pipeline and on the phase graphs (where the plan stream's edges
# are live). 32 staggered requests, seeded and greedy mixed.
DEMO_CONFIGS = {
    "graphed": ([], None), "graphed-no-overlap": (["--no-overlap"], None), "graphed-tree": (["--tree"], None),
    "eager": (["--no-graph"], None), "eager-no-plan": (["--no-graph", "--no-plan"], None),
    "eager-no-overlap-no-plan": (["--no-graph", "--no-overlap", "--no-plan"], None),
    "eager-delays": (["--no-graph"], DELAY), "eager-no-plan-delays": (["--no-graph", "--no-plan"], DELAY),
    "phase-graphs-delays": (["--phase-graphs"], DELAY),
}


@pytest.mark.parametrize("config", sorted(DEMO_CONFIGS))
def test_demo_pair_float32_equals_plain(root, demo_plain_eager, config):
    flags, env = DEMO_CONFIGS[config]
    got = outputs(root, "--demo", *flags, *SEEDED, env=env)
    diverged = [i for i, (a, b) in enumerate(zip(got, demo_plain_eager)) if a != b]
    assert not diverged, f"{config}: requests {diverged} differ from plain decoding"


def test_cuda_sanitizer_on_sampled_pipeline(root, plain_eager):
    proc = run(root, "--no-graph", "--tree", *SEEDED, env={"TORCH_CUDA_SANITIZER": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "CSAN" not in proc.stderr and "data race" not in proc.stderr.lower()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == plain_eager
