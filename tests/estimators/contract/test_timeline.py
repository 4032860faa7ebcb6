"""The step timeline against hand-computed schedules (estimators/contract/timeline.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimators.contract.module_info import ModOrder, ModStats, ModuleInfo
from estimators.contract.timeline import (
    Segment, Stream, Transfer, UnitComm, copy_ms, simulate, step_layout,
)


def segs(*ms):
    return [Segment(name=f"s{i}", compute_ms=m) for i, m in enumerate(ms)]


def test_offload_chain_exposed_copy_exact():
    # A(2) B(3) | C(4) D(1); A offloads 5e6 B at 1e9 B/s = 5 ms each way.
    # D2H issued at the end of A (t=2): 2..7. H2D issued when C starts (t=5), after the D2H: 7..12.
    # D needs it: C ends at 9, D waits until 12 -> 3 ms exposed; step 12 + 1 = 13.
    ms = copy_ms(5e6, 1e9)
    assert ms == 5.0
    tl = simulate(segs(2, 3, 4, 1), [
        Transfer(name="d2h", stream=Stream.D2H, duration_ms=ms, release=1),
        Transfer(name="h2d", stream=Stream.H2D, duration_ms=ms, release=2, needed_by=3, after="d2h"),
    ])
    assert tl.segment_start_ms == (0, 2, 5, 12)
    assert tl.transfer_end_ms == {"d2h": 7, "h2d": 12}
    assert (tl.compute_ms, tl.exposed_copy_ms, tl.exposed_comm_ms, tl.step_ms) == (10, 3, 0, 13)
    assert tl.copy_ms == 10


def test_copy_hidden_when_the_window_covers_it():
    # Same chain with a 1 ms copy: D2H 2..3, H2D issued at 5 runs 5..6, D starts at 9: no wait.
    tl = simulate(segs(2, 3, 4, 1), [
        Transfer(name="d2h", stream=Stream.D2H, duration_ms=1, release=1),
        Transfer(name="h2d", stream=Stream.H2D, duration_ms=1, release=2, needed_by=3, after="d2h"),
    ])
    assert (tl.exposed_copy_ms, tl.step_ms) == (0, 10)


def test_prefetched_all_gathers_fifo_on_one_stream():
    # Segments 2, 2, 2. AG1 (3 ms) issued at 0, needed by s1: s1 waits 2 -> 3.
    # AG2 (1 ms) issued at the end of s0 (t=2) but the stream is busy until 3: 3..4; s2 at 5.
    tl = simulate(segs(2, 2, 2), [
        Transfer(name="ag1", stream=Stream.COMM, duration_ms=3, release=0, needed_by=1),
        Transfer(name="ag2", stream=Stream.COMM, duration_ms=1, release=1, needed_by=2),
    ])
    assert tl.segment_start_ms == (0, 3, 5)
    assert (tl.exposed_comm_ms, tl.exposed_copy_ms, tl.step_ms) == (1, 0, 7)


def test_tail_transfer_counts_at_the_step_end():
    # A reduce-scatter issued after the last segment (release == n): all of it is exposed.
    tl = simulate(segs(1, 1), [Transfer(name="rs", stream=Stream.COMM, duration_ms=0.5, release=2)])
    assert (tl.step_ms, tl.exposed_comm_ms) == (2.5, 0.5)


def test_wait_is_charged_to_the_transfer_that_binds():
    # s1 needs a 4 ms all-gather and a 6 ms H2D, both issued at 0: 6 ms wait, all of it copy.
    tl = simulate(segs(0, 1), [
        Transfer(name="ag", stream=Stream.COMM, duration_ms=4, release=0, needed_by=1),
        Transfer(name="h2d", stream=Stream.H2D, duration_ms=6, release=0, needed_by=1),
    ])
    assert (tl.exposed_copy_ms, tl.exposed_comm_ms, tl.step_ms) == (6, 0, 7)


def test_recompute_runs_on_the_compute_stream():
    tl = simulate([Segment(name="a", compute_ms=1, recompute_ms=2)])
    assert (tl.recompute_ms, tl.step_ms) == (2, 3)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="cannot wait"):
        Transfer(name="x", stream=Stream.COMM, duration_ms=1, release=2, needed_by=1)
    with pytest.raises(ValueError, match=">= 0"):
        Segment(name="a", compute_ms=-1)
    with pytest.raises(ValueError, match="host link"):
        copy_ms(10, 0.0)
    with pytest.raises(ValueError, match="unknown transfer"):
        simulate(segs(1), [Transfer(name="x", stream=Stream.H2D, duration_ms=1, release=0, after="y")])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=2, max_size=6), st.data())
def test_parts_add_up_to_the_step(ms, data):
    n = len(ms)
    transfers = []
    for k in range(data.draw(st.integers(0, 5))):
        rel = data.draw(st.integers(0, n))
        need = data.draw(st.one_of(st.none(), st.integers(min(rel, n - 1), n - 1)))
        if need is not None and need < rel:
            need = None
        transfers.append(Transfer(name=f"t{k}", stream=data.draw(st.sampled_from(list(Stream))),
                                  duration_ms=data.draw(st.floats(0, 10)), release=rel, needed_by=need))
    tl = simulate(segs(*ms), transfers)
    parts = tl.compute_ms + tl.recompute_ms + tl.exposed_comm_ms + tl.exposed_copy_ms
    assert tl.step_ms == pytest.approx(parts, abs=1e-9)
    assert tl.step_ms >= tl.compute_ms - 1e-12
    zero = simulate(segs(*ms), [Transfer(name=t.name, stream=t.stream, duration_ms=0.0,
                                         release=t.release, needed_by=t.needed_by) for t in transfers])
    assert zero.step_ms == pytest.approx(sum(ms))


# ----------------------------------------------------------------------------- a traced step
def _info():
    """M: emb (ops 0-1), blocks b.0 (2-4) and b.1 (5-7), head (8-9); backward mirrored."""
    def mod(fqn, fw, bw, fpre, fpost, bpre, bpost, leaf=False):
        return ModStats(fqn=fqn, is_leaf=leaf, fw_runtime_ms=fw, bw_runtime_ms=bw, fw_pre_op=fpre,
                        fw_post_op=fpost, bw_pre_op=bpre, bw_post_op=bpost)
    stats = (
        mod("M", 12, 24, 0, 11, 11, 22),
        mod("M.emb", 1, 2, 0, 2, 20, 21, leaf=True),
        mod("M.b.0", 4, 8, 2, 5, 17, 19),
        mod("M.b.1", 4, 8, 5, 8, 14, 16),
        mod("M.head", 2, 4, 8, 10, 11, 13, leaf=True),
    )
    names = tuple(s.fqn for s in stats)
    order = ModOrder(fw_pre_order=names, fw_post_order=names, bw_pre_order=names, bw_post_order=names)
    return ModuleInfo(mod_order=order, mod_stats=stats, fw_runtime_ms=12, bw_runtime_ms=24,
                      optimizer_runtime_ms=3)


def test_layout_segments_and_prefetch():
    lay = step_layout(_info(), ["M.b.1", "M.b.0"])
    names = [s.name for s in lay.segments]
    assert names == ["fw:before blocks", "fw:M.b.0", "fw:M.b.1", "fw:after blocks",
                     "bw:before blocks", "bw:M.b.1", "bw:M.b.0", "bw:after blocks", "optimizer"]
    assert [s.compute_ms for s in lay.segments] == [1, 4, 4, 3, 4, 8, 8, 4, 3]
    assert lay.prefetch_segment == {"M.b.0": 5, "M.b.1": 5}
    # b.0 offloads 6 ms of copy each way: D2H 5..11 (forward ends at 12); H2D issued at the start
    # of bw:b.1 (t=16) runs 16..22, bw:b.0 could start at 24: hidden. Step 12 + 24 + 3 = 39.
    tl = lay.timeline(offload_bytes={"M.b.0": 6e6}, copy_bytes_per_s=1e9)
    assert (tl.step_ms, tl.exposed_copy_ms) == (39, 0)
    # 10 ms each way: D2H 5..15, H2D 16..26: bw:b.0 waits 2 ms.
    tl = lay.timeline(offload_bytes={"M.b.0": 10e6}, copy_bytes_per_s=1e9)
    assert (tl.step_ms, tl.exposed_copy_ms) == (41, 2)
    # The same 6 MB in 1,000 copies of 5 us each: 6 + 5 = 11 ms each way: D2H 5..16, H2D 16..27,
    # bw:b.0 waits 27 - 24 = 3 ms. In one copy the latency is 5 us: hidden.
    tl = lay.timeline(offload_bytes={"M.b.0": 6e6}, copy_bytes_per_s=1e9,
                      offload_copies={"M.b.0": 1000}, copy_latency_s=5e-6)
    assert (tl.step_ms, tl.exposed_copy_ms) == pytest.approx((42, 3))
    tl = lay.timeline(offload_bytes={"M.b.0": 6e6}, copy_bytes_per_s=1e9, copy_latency_s=5e-6)
    assert (tl.step_ms, tl.exposed_copy_ms) == (39, 0)


def test_layout_fsdp_collectives():
    comm = [UnitComm(fqn="M", all_gather_ms=0.5, all_gathers=1, reduce_scatter_ms=0.5),
            UnitComm(fqn="M.b.0", all_gather_ms=2, all_gathers=2, reduce_scatter_ms=1),
            UnitComm(fqn="M.b.1", all_gather_ms=2, all_gathers=2, reduce_scatter_ms=1)]
    lay = step_layout(_info(), ["M.b.0", "M.b.1"], comm=comm)
    tl = lay.timeline()
    # FIFO on the comm stream: root AG, b.0 fw AG, b.1 fw AG, b.1 bw AG, b.0 bw AG, RS b.1, b.0, root.
    # Forward: root AG 0..0.5 (0.5 exposed); b.0's AG 0.5..2.5, fw:before ends 1.5 (1 exposed);
    # b.1's AG 2.5..4.5, fw:b.0 ends 6.5 (hidden). fw:after 10.5..13.5, bw:before 13.5..17.5.
    # Backward AGs issued one segment ahead: hidden. RS b.1 25.5..26.5, RS b.0 33.5..34.5, the
    # root's RS issued when bw:after ends (37.5) 37.5..38: the optimizer waits 0.5 -> 38..41.
    assert tl.segment_start_ms == (0.5, 2.5, 6.5, 10.5, 13.5, 17.5, 25.5, 33.5, 38.0)
    assert tl.exposed_comm_ms == 2.0
    assert tl.step_ms == 41.0
    assert tl.comm_ms == 0.5 + 0.5 + 2 * (2 + 2 + 1)


def test_recompute_lands_in_the_segment_its_backward_starts_in():
    info = _info()
    lay = step_layout(info, ["M.b.0", "M.b.1"])
    seg = {f: lay.segments[lay.segment_of_backward(info.stats(f))].name for f in ("M.b.0", "M.b.1", "M.head", "M.emb")}
    assert seg == {"M.b.0": "bw:M.b.0", "M.b.1": "bw:M.b.1", "M.head": "bw:before blocks",
                   "M.emb": "bw:after blocks"}
    inner = ModStats(fqn="M.b.0.mlp", is_leaf=True, bw_pre_op=18)
    assert lay.segments[lay.segment_of_backward(inner)].name == "bw:M.b.0"
    # 2 ms of recompute at the start of bw:b.0 delays the step by 2 ms.
    assert lay.timeline(recompute_ms_by_segment={lay.bw_segment["M.b.0"]: 2.0}).step_ms == 41
