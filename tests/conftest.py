"""The suite's two tiers, and what every test shares.

``pytest -m "not slow"`` is the developer's quick loop (under 2 minutes on 2 cores); CI runs
everything. The quick tier holds pure-Python, CPU-light tests: the solver, the architecture and
README checks, a gradient-bitwise and a predicted-equals-measured check on a tiny model, the CLI's
argument errors, plan files. ``slow`` holds any test over ~3 s and, whatever their time, every test
that builds a Hugging Face model (``hf``), every test that starts a process (``multiproc``) and
every whole-model test (``tests/integration/``). The tiers hold by structure, not by a clock:

- a test marked ``hf`` or ``multiproc``, or under ``tests/integration/``, is marked ``slow`` here;
- a test not marked ``multiproc`` that starts a process (``subprocess``, ``multiprocessing``, a
  fork), or not marked ``hf`` that builds a transformers model, fails and says which mark it needs;
- a test that traces the same model as its neighbours shares the trace (a module- or
  session-scoped fixture, ``tests/planner/conftest.py``).
"""

import os

# One intra-op thread for the whole suite, and for the processes it starts (CLI runs, notebook
# kernels, gloo ranks): the models under test are tiny, so an OpenMP pool only spins against the
# other cores' work (on a loaded 2-core machine a step took 2.5x the CPU time with two threads).
# Every comparison a test makes (planned against unplanned, predicted against measured) runs in
# one process, under one setting. An OMP_NUM_THREADS already set (CI, a developer) wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The search screens in one process (SearchOptions.workers): the suite's own workers fill the
# cores; the test of the workers asks for them by name.
os.environ.setdefault("SAC_SEARCH_WORKERS", "1")

import ast  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.abc  # noqa: E402
import multiprocessing.process  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

WHOLE_MODEL_TESTS = Path(__file__).parent / "integration"
"""Whole-model tests (HF families, trainers' loops, the notebook, parallel layouts): ``slow``."""
IMPLIES_SLOW = ("hf", "multiproc")


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


# --- the heap -------------------------------------------------------------------------------

def pytest_collection_finish(session):
    """What collection imported (torch, the packages, every test module) is frozen out of the
    collector: a fake trace ends with a ``gc.collect`` when its mode outlives it, and over the
    suite's heap that collect was most of a tiny model's trace. Objects made by tests are
    collected as before."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    """Unfrozen for the interpreter's exit, which collects what it can (extension modules
    report objects still alive then as leaks)."""
    gc.unfreeze()


@pytest.fixture(scope="module")
def whole_heap():
    """The collector sees every object again, for code that scans the heap (``gc.get_objects``,
    ``gc.get_referrers``: a frozen holder is invisible to them): the fake-leak search."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


# --- tiers ----------------------------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks ``slow`` what the tiers put there (before ``-m`` deselects). Then, on xdist workers,
    the files that hold a test marked ``slow`` first, each file's tests kept together and in
    order: ``--dist loadfile --no-loadscope-reorder`` hands out whole files in this order, so the
    long ones start early and the run ends on short files (neither worker idles while the other
    finishes a long one). A plain run keeps pytest's order."""
    for item in items:
        if item.path.is_relative_to(WHOLE_MODEL_TESTS) or any(item.get_closest_marker(m) for m in IMPLIES_SLOW):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: item.path not in slow)


def pytest_ignore_collect(collection_path, config):
    """The quick loop (``-m "not slow"``, as typed) does not import the files whose every test is
    slow (under tests/integration/, or a module ``pytestmark`` naming slow, hf or multiproc):
    their imports (lightning, torchtitan, transformers) were a third of its collection time.
    Deselection would have dropped their tests; ignoring them drops the same tests."""
    if config.getoption("markexpr", "").strip() != "not slow":
        return None
    if collection_path == WHOLE_MODEL_TESTS:
        return True
    if collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        return True if _module_marks(collection_path) & {"slow", *IMPLIES_SLOW} else None
    return None


def _module_marks(path: Path) -> set[str]:
    """The ``pytest.mark.<name>`` names in a test file's top-level ``pytestmark``, read from its
    source without importing it."""
    text = path.read_text()
    if "pytestmark" not in text:
        return set()
    names = set()
    for node in ast.parse(text, str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            names |= {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return names


# --- guards: a test that starts a process or builds an HF model carries the mark ----------------
# What an unmarked test does is noted, not refused where it happens: an error raised inside
# ``subprocess.Popen`` or a model's ``__init__`` would be caught by the code under test (the
# solver falls back when CBC cannot start) and change what the test checks. The test fails after
# it ran, saying which mark it needs.

_RUNNING: list = [None]
"""The test running now (setup, call and teardown), or None between tests."""
_UNMARKED: list[str] = []
"""What the running test did that its marks do not say."""


def _note(mark: str, what: str) -> None:
    item = _RUNNING[0]
    if item is not None and item.get_closest_marker(mark) is None:
        _UNMARKED.append(f"{item.nodeid} {what} but is not marked {mark}: add @pytest.mark.{mark} "
                         f"(it then runs in the slow tier; tests/conftest.py)")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING[0] = item
    _UNMARKED.clear()
    try:
        yield
    finally:
        _RUNNING[0] = None


@pytest.fixture(autouse=True)
def _marks_say_what_the_test_does():
    yield
    if _UNMARKED:
        message = _UNMARKED[0]
        _UNMARKED.clear()
        pytest.fail(message, pytrace=False)


def _audit(event: str, args: tuple) -> None:
    if event in ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn"):
        if event == "subprocess.Popen" and os.path.basename(str(args[0])).startswith("cbc"):
            return  # the solver's CBC backend: a short solve, not a test that runs processes
        _note("multiproc", f"starts a process ({event})")


def _guarded_start(start):
    @functools.wraps(start)
    def guarded(self):
        _note("multiproc", f"starts a process ({type(self).__name__})")
        return start(self)
    return guarded


def _guard_hf_models(modeling_utils) -> None:
    init = modeling_utils.PreTrainedModel.__init__

    @functools.wraps(init)
    def guarded(self, *args, **kwargs):
        _note("hf", f"builds a transformers model ({type(self).__name__})")
        init(self, *args, **kwargs)

    modeling_utils.PreTrainedModel.__init__ = guarded


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards ``PreTrainedModel`` when ``transformers.modeling_utils`` is imported, by whom and
    whenever it is (a test, a helper, planning code), without importing transformers itself."""

    NAME = "transformers.modeling_utils"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.NAME:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_guard(module):
                    exec_module(module)
                    _guard_hf_models(module)

                spec.loader.exec_module = exec_and_guard
                return spec
        return None


sys.addaudithook(_audit)
multiprocessing.process.BaseProcess.start = _guarded_start(multiprocessing.process.BaseProcess.start)
if _GuardOnImport.NAME in sys.modules:
    _guard_hf_models(sys.modules[_GuardOnImport.NAME])
else:
    sys.meta_path.insert(0, _GuardOnImport())
