import os
import sys

import pytest

# Tests import the package from the source tree, so the suite runs without installing it.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def pytest_addoption(parser):
    # tests/real_model runs the pulled SmolLM2-135M-Instruct against transformers; CI keeps these small.
    parser.addoption("--real-model-prompts", type=int, default=3, help="prompts in the real-model greedy test (max 20)")
    parser.addoption("--real-model-tokens", type=int, default=32, help="new tokens per prompt in that test")


def pytest_configure(config):
    import torch

    # Test models are tiny: one thread is fastest, and several test processes (or a 2-core CI
    # machine) would otherwise oversubscribe the cores and slow every matmul by 10-30x.
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
