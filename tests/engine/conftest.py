import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # The tiny models are dominated by per-op overhead: one thread is ~10x faster than several
    # fighting over a small CPU. Restored afterwards so other test directories are unaffected.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
