"""examples/expert_parallel.py: torchtitan's DeepSeek-V3 at the TINY dims, parallelized by its own
``Module.parallelize`` with EP 2 on torch's fake process group: the routed experts' weights are
DTensors sharded on the expert dim over ``ep``, the routing knobs ``route`` sets are torchtitan's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan is not installed")

from examples.expert_parallel import (TINY, build, fsdp_unit_names, moe_layers, parallel_dims_of, route,  # noqa: E402
                                      trainer_config)
from planner.distributed.fake_world import fake_process_group  # noqa: E402

pytestmark = [pytest.mark.slow]


def test_tiny_is_torchtitan_s_model_under_ep():
    from torch.distributed.tensor import DTensor, Shard

    with fake_process_group(world_size=2, rank=1):
        config = trainer_config(TINY, world=2, ep=2, seq_len=16, batch=2)
        model = build(config, parallel_dims_of(config, 2), meta=True)
        (w1,) = [p for n, p in model.named_parameters() if n == "layers.1.moe.routed_experts.inner_experts.w1_EFD"]
        assert isinstance(w1, DTensor) and w1.placements == (Shard(0),) and w1.device_mesh.mesh_dim_names == ("ep",)
        assert w1.to_local().shape == (TINY.num_experts // 2, TINY.moe_hidden_dim, TINY.dim)
        assert len(moe_layers(model)) == TINY.n_layers - TINY.n_dense_layers
        assert fsdp_unit_names(model, "M") == ["M", "M.layers.0", "M.layers.1", "M.layers.2",
                                               "M.layers.1.moe.routed_experts", "M.layers.2.moe.routed_experts"]
        route(model, None)
        assert all(m.router._debug_force_load_balance for m in moe_layers(model))
        model.to_empty(device="cpu")
        route(model, (0, 4))
        moe = moe_layers(model)[0]
        assert not moe.router._debug_force_load_balance
        assert torch.equal(moe.expert_bias_E.nonzero().view(-1), torch.tensor([0, 4]))
        with pytest.raises(ValueError, match="give 2 experts"):
            route(model, (0,))
