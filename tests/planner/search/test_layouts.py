"""The launch advisor's layouts: the cluster, the enumeration, its refusals and the state bound."""

from __future__ import annotations

import pytest
import torch

from examples.llama import LlamaConfig, build_llama
from planner.errors import PlanningError
from planner.format import GiB
from planner.search.family import LlamaFamily, model_family
from planner.search.layouts import Cluster, Layout, SearchSpace, enumerate_layouts, state_bound_bytes

CONFIG = LlamaConfig(vocab_size=512, seq_len=64, n_layers=4, dim=128, n_heads=8, n_kv_heads=4, ffn_dim=256)


def small(*, seq_len: int = 64):
    return build_llama(LlamaConfig(**{**CONFIG.__dict__, "seq_len": seq_len}), batch_size=1, device="meta",
                       dtype=torch.bfloat16)


def family(seq_len: int = 64) -> LlamaFamily:
    return model_family(small, seq_len=seq_len)


def test_a_cluster_is_count_x_device():
    c = Cluster.parse("64xh100")
    assert (c.n_gpus, c.spec.name, c.budget_bytes) == (64, "h100", 80 * GiB)
    assert c.usable_bytes == 80 * GiB - (GiB + int(0.05 * 80 * GiB))
    assert Cluster.parse("4 x cpu", budget_gib=2).budget_bytes == 2 * GiB
    for bad in ("64", "h100x64", "x", "0xh100"):
        with pytest.raises(PlanningError):
            Cluster.parse(bad)


def test_a_group_within_a_node_runs_on_the_node_link():
    c = Cluster.parse("64xh100")
    assert c.link(8, 1).name == "nvlink4"  # TP 8: one node
    assert c.link(8, 8).name == "infiniband-ndr"  # FSDP 8 at stride TP 8: one rank per node
    assert c.link(2, 4).name == "nvlink4" and c.link(4, 4).name == "infiniband-ndr"
    assert c.link(1, 64).name == "nvlink4"  # a group of one moves nothing


def test_a_layout_says_what_it_is():
    t = Layout(tp=8, pp=4, dp_shard=2, micro_batch=1, accumulation=32, schedule="Interleaved1F1B")
    assert (t.world_size, t.fsdp_size, t.virtual_stages, t.n_stages) == (64, 2, 2, 8)
    assert t.family == "PP x TP x FSDP"
    assert t.describe() == "PP 4 Interleaved1F1B x TP 8 x FSDP 2, mb 1 x 32"
    assert Layout(cp=2, dp_shard=4, dp_replicate=2).family == "CP x HSDP"
    assert Layout(tp=4, dp_shard=2, dp_replicate=2).describe() == "TP 4 x HSDP 2x2, mb 1 x 1"


def test_every_layout_multiplies_to_the_cluster_and_the_global_batch():
    found = enumerate_layouts(family(), Cluster.parse("16xh100"), global_batch=64, seq_len=64)
    assert found.layouts and found.raw_count == len(found.layouts) + len(found.rejected)
    for t in found.layouts:
        assert t.world_size == 16
        assert t.dp * t.micro_batch * t.accumulation == 64
        assert t.dp_shard > 1 or t.dp_replicate == 1  # no DDP


def test_what_cannot_divide_is_rejected_with_its_reason():
    found = enumerate_layouts(family(), Cluster.parse("16xh100"), global_batch=64, seq_len=64,
                              space=SearchSpace(tp=(1, 8), cp=(1, 2), pp=(1, 8), micro_batches=(1, 3)))
    why = {r.layout: r.detail for r in found.rejected}
    assert any("TP 8 does not divide the 4 KV heads" in d for d in why.values())
    assert any("8 stages for 4 layers" in d or "16 stages for 4 layers" in d for d in why.values())
    assert any("micro-batch 3" in d for d in why.values())
    assert any("DDP" in d for d in why.values())
    kept = {(t.tp, t.pp) for t in found.layouts}
    assert (8, 1) not in kept and all(pp != 8 for _, pp in kept)


def test_context_parallel_needs_a_cuda_target_and_equal_chunks():
    cpu = enumerate_layouts(family(), Cluster.parse("4xcpu"), global_batch=8, seq_len=64,
                            space=SearchSpace(cp=(1, 2), pp=(1,)))
    assert all(t.cp == 1 for t in cpu.layouts)
    assert any("CUDA target" in r.detail for r in cpu.rejected if r.layout.cp == 2)
    odd = enumerate_layouts(family(seq_len=60), Cluster.parse("8xh100"), global_batch=8, seq_len=60,
                            space=SearchSpace(tp=(1,), cp=(1, 8), pp=(1,)))
    assert any("2 x CP = 16 equal chunks" in r.detail for r in odd.rejected)


def test_the_state_bound_is_the_sharded_parameters_gradients_and_adamw_state():
    fam = family()
    p_all = sum(p.numel() * p.element_size() for p in small()[0].parameters())
    assert fam.param_bytes(tp=1, layer_ids=range(4), first=True, last=True) == p_all
    assert state_bound_bytes(Layout(dp_shard=4), fam) == -(-4 * p_all // 4)  # p + grad + 2 AdamW moments
    # PP 2 x FSDP 2: the stage's parameters gathered and its gradients unsharded, beside its shards.
    p0 = fam.param_bytes(tp=1, layer_ids=range(2), first=True, last=False)
    p1 = fam.param_bytes(tp=1, layer_ids=range(2, 4), first=False, last=True)
    t = Layout(pp=2, dp_shard=2, schedule="1F1B", accumulation=2)
    assert state_bound_bytes(t, fam) == max(-(-4 * p // 2) + p + p - p // 2 for p in (p0, p1))


def test_layouts_whose_state_alone_is_over_the_budget_are_rejected():
    fam = family()
    p_all = fam.param_bytes(tp=1, layer_ids=range(4), first=True, last=True)
    budget = (4 * p_all // 2 + 4 * p_all // 4) / 2 / GiB  # between the 4- and the 2-way sharded state
    found = enumerate_layouts(fam, Cluster.parse("4xcpu", budget_gib=budget), global_batch=8, seq_len=64,
                              space=SearchSpace(tp=(1,), pp=(1,)))
    assert [t.dp_shard for t in found.layouts] == [4, 4]  # micro-batches 1 and 2
    assert {r.reason for r in found.rejected} == {"state bound", "does not divide"}


def test_tp_local_parameter_bytes_match_the_parallelized_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from planner.distributed.fake_world import fake_process_group

    fam = family()
    with fake_process_group(world_size=2):
        model = fam.build()
        fam.parallelize(model, init_device_mesh("cpu", (2,)))
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in model.parameters())
    assert fam.param_bytes(tp=2, layer_ids=range(4), first=True, last=True) == local


def test_a_model_the_search_cannot_lay_out_is_refused():
    with pytest.raises(PlanningError, match="Llama-style.*build_llama\\(LlamaConfig"):  # and what to do
        model_family(lambda *, seq_len: (torch.nn.Linear(2, 2), None), seq_len=8)
    with pytest.raises(PlanningError, match="seq_len="):
        model_family(lambda: None, seq_len=8)
