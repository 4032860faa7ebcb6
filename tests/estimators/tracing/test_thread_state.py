"""estimators/tracing/thread_state.py: what a trace changes of the process, it changes for its own
thread, and the last thread out puts back what the first one found."""

from __future__ import annotations

import gc
import threading
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from estimators.tracing.thread_state import (
    eager_in_this_thread,
    gc_paused,
    original,
    patched_in_this_thread,
    restored_by_last_out,
)


def _counting_backend(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # reported in the calling thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.slow  # dynamo compiles three functions
def test_compiled_code_runs_eagerly_in_this_thread_and_compiles_in_others():
    from torch._dynamo import eval_frame

    stance = eval_frame._stance
    mine, theirs = [], []
    f = torch.compile(lambda x: torch.sin(x) + 1, backend=_counting_backend(mine))
    g = torch.compile(lambda x: torch.cos(x) * 3, backend=_counting_backend(theirs))
    full = torch.compile(lambda x: torch.tanh(x) - 1, backend=_counting_backend(mine), fullgraph=True)
    x = torch.randn(4)
    with eager_in_this_thread():
        with _Passthrough():  # under a trace's dispatch mode: dynamo would mark f never to compile
            assert torch.equal(f(x), torch.sin(x) + 1)
            assert torch.equal(full(x), torch.tanh(x) - 1)  # fullgraph: no "found no compiled frames"
        assert not mine
        assert torch.compiler.is_compiling() is False
        _in_thread(lambda: g(x))  # another thread meanwhile: compiles
        assert len(theirs) == 1 and eval_frame._stance is stance
    assert eval_frame._stance is stance and type(stance) is eval_frame.DynamoStance and stance.stance == "default"
    f(x), full(x)  # after: both compile (neither was marked to skip)
    assert len(mine) == 2
    torch._dynamo.reset()


def test_two_threads_in_and_out_in_any_order_leave_the_stance_as_found():
    from torch._dynamo import eval_frame

    stance = eval_frame._stance
    inside, leave = threading.Barrier(3), [threading.Event(), threading.Event()]

    def planner(i):
        with eager_in_this_thread():
            seen = eval_frame._stance.stance
            inside.wait(30)
            leave[i].wait(30)
        return seen

    threads = [threading.Thread(target=planner, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    inside.wait(30)
    assert eval_frame._stance.stance == "default"  # this thread, while both plan
    leave[1].set()  # the second one in leaves first
    threads[1].join(30)
    assert eval_frame._stance.stance == "default"
    leave[0].set()
    threads[0].join(30)
    assert eval_frame._stance is stance and type(stance) is eval_frame.DynamoStance


def test_a_stance_set_by_another_thread_while_tracing_is_left_to_it():
    from torch._dynamo import eval_frame

    before = eval_frame._stance
    with eager_in_this_thread():
        _in_thread(lambda: torch.compiler.set_stance("eager_on_recompile").__enter__())
        other = eval_frame._stance
        with eager_in_this_thread():  # a second trace meanwhile: eager in this thread under it too
            assert eval_frame._stance.stance == "force_eager"
        assert _in_thread(lambda: eval_frame._stance.stance) == "eager_on_recompile"
    assert type(other) is eval_frame.DynamoStance and other.stance == "eager_on_recompile"
    torch.compiler.set_stance("default")
    assert type(before) is eval_frame.DynamoStance


def test_a_patch_is_seen_by_its_own_thread_only():
    owner = types.SimpleNamespace(fn=lambda: "original")
    first = owner.fn
    with patched_in_this_thread(owner, "fn", lambda: "mine"):
        assert owner.fn() == "mine" and original(owner, "fn") is first
        assert _in_thread(lambda: owner.fn()) == "original"
        with patched_in_this_thread(owner, "fn", lambda: "inner"):
            assert owner.fn() == "inner"
        assert owner.fn() == "mine"
    assert owner.fn is first


def test_two_threads_patching_restore_the_original_in_any_order():
    owner = types.SimpleNamespace(fn=lambda: "original")
    first = owner.fn
    inside, leave = threading.Barrier(3), [threading.Event(), threading.Event()]
    seen = {}

    def patcher(i):
        with patched_in_this_thread(owner, "fn", lambda: f"thread {i}"):
            inside.wait(30)
            seen[i] = owner.fn()
            leave[i].wait(30)

    threads = [threading.Thread(target=patcher, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    inside.wait(30)
    assert owner.fn() == "original"
    leave[0].set()
    threads[0].join(30)
    leave[1].set()
    threads[1].join(30)
    assert seen == {0: "thread 0", 1: "thread 1"} and owner.fn is first


def test_the_collector_is_back_as_found_whatever_the_order():
    assert gc.isenabled()
    a, b = gc_paused(), gc_paused()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert not gc.isenabled()  # b is still inside
    b.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # found off: left off
    finally:
        gc.enable()


def test_the_last_thread_out_puts_back_what_the_first_one_found():
    state = {"v": 0}
    get, put = (lambda: state["v"]), (lambda v: state.update(v=v))
    a, b = restored_by_last_out("k", get, put), restored_by_last_out("k", get, put)
    a.__enter__()
    state["v"] = 1  # the first one draws
    b.__enter__()  # the second one starts after that draw
    state["v"] = 2
    a.__exit__(None, None, None)
    assert state["v"] == 2  # not put back while b is inside
    b.__exit__(None, None, None)
    assert state["v"] == 0
