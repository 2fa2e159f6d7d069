"""GPU checks of the overlapped speculative pipeline (DESIGN §3 rule 6): greedy equality across
overlap/plan-stream combinations, delay injection with a negative control, and PyTorch's CUDA
sanitizer. Each run is a subprocess so a broken configuration cannot poison this process."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DELAY = "20000000"  # ~10 ms of spinning before each cross-stream write
# These tests are about the eager pipeline's stream edges; with CUDA graphs a greedy iteration runs
# on one stream (test_cuda_graph_gpu.py covers that path and the phase graphs' edges).
EAGER = ("--no-graph",)


def run(tmp_root, *flags, env=None):
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.spec_run", str(tmp_root), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), **(env or {})})
    return proc


def outputs(tmp_root, *flags, env=None):
    proc = run(tmp_root, *flags, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_models")


@pytest.fixture(scope="module")
def reference(root):
    return outputs(root, *EAGER, "--plain")


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_four_combinations_equal_plain_greedy(root, reference, tree):
    extra = ["--tree"] if tree else []
    for flags in ([], ["--no-plan"], ["--no-overlap"], ["--no-overlap", "--no-plan"]):
        assert outputs(root, *EAGER, *flags, *extra) == reference, f"flags {flags + extra}"


def test_delay_injection_keeps_greedy_output(root, reference):
    env = {"TANDEM_STREAM_DELAY_CYCLES": DELAY}
    assert outputs(root, *EAGER, env=env) == reference
    assert outputs(root, *EAGER, "--tree", env=env) == reference


# edge removed -> the producer's write that the consumer then reads too early
NEGATIVE = {"seq_lens_ready": "seq_lens", "verify_plan": "verify_plan"}


@pytest.mark.parametrize("edge", sorted(NEGATIVE))
def test_delay_injection_without_a_wait_changes_output(root, reference, edge):
    """Negative control: with one wait removed, the delayed producer loses the race and the
    consumer reads stale or unwritten data (wrong tokens, or a device-side fault). Only that
    producer is delayed, so the consumer is not slowed down by delays of its own."""
    # Long enough (~100 ms) that the producer is still spinning when the host, which is itself
    # slow to launch eager kernels, has queued the consumer.
    env = {"TANDEM_STREAM_DELAY_CYCLES": "200000000", "TANDEM_STREAM_DELAY_BUFFERS": NEGATIVE[edge]}
    assert outputs(root, *EAGER, "--self-draft", env=env) == reference  # the same delays with every wait kept
    proc = run(root, *EAGER, "--drop", edge, "--self-draft", env=env)
    if proc.returncode == 0:
        assert json.loads(proc.stdout.strip().splitlines()[-1]) != reference, "the missing wait went unseen"


def test_cuda_sanitizer_reports_nothing(root, reference):
    proc = run(root, *EAGER, "--tree", env={"TORCH_CUDA_SANITIZER": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "CSAN" not in proc.stderr and "data race" not in proc.stderr.lower()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == reference
