import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same torch RNG state, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny models: an intra-op pool only contends for the cores (steps ran 30x slower with it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
