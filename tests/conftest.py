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
    """On xdist workers, the files that hold a test marked ``slow`` first, each file's tests kept
    together and in order: ``--dist loadfile --no-loadscope-reorder`` hands out whole files in
    this order, so the long ones start early and the run ends on short files (neither worker
    idles while the other finishes a long one). A plain run keeps pytest's order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: item.path not in slow)
