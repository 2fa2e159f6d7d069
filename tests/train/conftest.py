import pytest
import torch

from tests.train.fixtures import trained_eagle3_head  # noqa: F401  (session fixture, shared)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # Tiny models are dominated by per-op overhead; several threads only fight over a small CPU.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
