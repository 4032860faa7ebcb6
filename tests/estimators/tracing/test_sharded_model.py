"""estimators/tracing/sharded_model.py (+ fake_copy): a model already sharded with fully_shard is
traced as it ran before fully_shard (fake process group, 2 x 2 mesh, one process)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
from estimators.tracing.sharded_model import fsdp_layout, fsdp_units_of, original_class_name
from examples.llama import LlamaConfig, build_llama
from examples.tensor_parallel import fsdp_unit_names, parallelize_llama, shard_llama
from planner import TrainStep
from planner.distributed.fake_world import fake_process_group

TINY = LlamaConfig(vocab_size=256, seq_len=32, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


def test_a_plain_model_has_no_layout():
    assert fsdp_layout(torch.nn.Linear(2, 2)) is None
    assert original_class_name(torch.nn.Linear(2, 2)) == "Linear"


@pytest.mark.slow
def test_units_sharded_over_groups_of_different_sizes_are_refused_with_what_to_do():
    """As transformers' FSDP x EP lays them out: the experts over efsdp, the rest over fsdp."""
    from torch.distributed.fsdp import fully_shard

    from estimators.tracing.sharded_model import ShardedModelError

    with fake_process_group(world_size=4, rank=0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fully_shard(model[0], mesh=mesh["efsdp"])
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
        with pytest.raises(ShardedModelError, match=r"sizes \[2, 4\].*shard every unit over one group"):
            fsdp_layout(model)


@pytest.mark.slow
def test_a_sharded_tp_model_traces_as_before_fully_shard(one_intra_op_thread):
    with fake_process_group(world_size=4, rank=3):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, inputs = build_llama(TINY, batch_size=2)
        parallelize_llama(model, mesh["tp"])
        step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw", context=loss_parallel)
        before = estimate(model, step)
        units = shard_llama(model, mesh["dp"])
        layout = fsdp_layout(model)
        after = estimate(model, step)
        with pytest.raises(TraceError, match="fully_shard"):
            estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL))
        assert type(model).__name__ == "FSDPLlama"  # the user's model is left sharded
    assert units == fsdp_units_of(model) == fsdp_unit_names(model) == list(layout.units)
    assert layout.shard_world_size == 2 and layout.replicate_world_size == 1
    assert layout.param_dtype is None and layout.reduce_dtype is None
    assert after.module_info.peak_bytes == before.module_info.peak_bytes
    assert after.first_step_peak_bytes == before.first_step_peak_bytes
    assert [s.fqn for s in after.module_info.mod_stats] == [s.fqn for s in before.module_info.mod_stats]
