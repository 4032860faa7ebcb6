import os

# One intra-op thread for the whole suite, and for the processes it starts (CLI runs, notebook
# kernels, gloo ranks): the models under test are tiny, so an OpenMP pool only spins against the
# other cores' work (on a loaded 2-core machine a step took 2.5x the CPU time with two threads).
# Every comparison a test makes (planned against unplanned, predicted against measured) runs in
# one process, under one setting. An OMP_NUM_THREADS already set (CI, a developer) wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


def pytest_collection_modifyitems(config, items):
    """On xdist workers, the tests marked ``slow`` first (otherwise in collection order): with
    ``--dist loadgroup`` the groups go out first, then one test at a time in this order, so the
    run ends on short tests and neither worker idles while the other finishes a long one. A
    plain run keeps pytest's order (each module's tests together)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
