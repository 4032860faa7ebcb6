"""Tensor, sequence and data parallelism for ``examples.llama``, as torchtitan applies them.

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model, inputs = build_llama(config, batch_size)
    parallelize_llama(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    # ... plan and apply_plan here (torchtitan's order: parallelize, then AC, then fully_shard)
    shard_llama(model, mesh["dp"])

The plan is torchtitan's ``apply_tp`` for Llama 3: the embedding row-wise (vocabulary-sharded),
attention's ``wq/wk/wv`` and the FFN's ``w1/w3`` column-wise, ``wo`` and ``w2`` row-wise; with
sequence parallelism the norms run on sequence shards (``SequenceParallel``) and the blocks'
attention and FFN gather their input (``PrepareModuleInput``); with ``loss_parallel`` the output
projection keeps the logits sharded over the vocabulary, and the loss must run inside
``torch.distributed.tensor.parallel.loss_parallel()`` (``TrainStep(context=loss_parallel)``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from examples.llama import Llama

__all__ = ["parallelize_llama", "shard_llama", "fsdp_unit_names"]


def parallelize_llama(model: Llama, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                      loss_parallel: bool = True) -> Llama:
    """Shard ``model`` over ``tp_mesh`` in place (torchtitan's Llama TP plan); returns it."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    # A pipeline stage (examples.pipeline_stages.LlamaStage) holds some of these (None: not on
    # this stage) and its layers by name, as torchtitan parallelizes each stage's module.
    root = {name: style for name, style in root.items() if getattr(model, name, None) is not None}
    if root:
        parallelize_module(model, tp_mesh, root)
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            # The rotary tables (cos, sin) stay plain tensors: None leaves them as they are.
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                   desired_input_layouts=(Replicate(), None, None))
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),))
        parallelize_module(layer, tp_mesh, plan)
    return model


def shard_llama(model: Llama, dp_mesh: DeviceMesh, **fully_shard_kwargs) -> list[str]:
    """``fully_shard`` every layer, then the root, over ``dp_mesh`` (torchtitan's units);
    returns their names as a plan names them (``PlanOptions.fsdp_units``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=dp_mesh, **fully_shard_kwargs)
    return fsdp_unit_names(model)


def fsdp_unit_names(model: Llama) -> list[str]:
    """The units :func:`shard_llama` shards, named as in a plan: the root and every layer."""
    root = "Llama"
    return [root, *(f"{root}.layers.{i}" for i in range(len(model.layers)))]
