"""Built-in example models, used by the tests, the benchmarks and the CLI (``--model MODULE:FACTORY``).

The factory contract
--------------------
A factory is a callable that takes no required arguments and returns ``(model, inputs)``::

    model, inputs = factory()            # model: nn.Module, inputs: tuple of forward arguments
    output = model(*inputs)

* Factories are deterministic: they seed a forked CPU RNG, so two calls give equal weights and
  inputs and the caller's global RNG is untouched.
* Optional keyword-only arguments (``device=``, ``attn_impl=``...) may follow; every built-in
  factory accepts ``device="meta"`` to build without allocating (``llama3_70b`` defaults to it).
* The model exposes ``model.loss_fn(output, inputs) -> Tensor`` (a scalar), where ``inputs`` is the
  same tuple passed as ``model(*inputs)``; each module also has it as a plain function
  (``gpt_loss``, ``llama_loss``, ``convnet_loss``). A model without ``loss_fn`` is trained on
  ``output.sum()``, the planner's default.
* ``model.example_inputs(batch_size=None)`` rebuilds inputs for another batch size.

    from examples import EXAMPLES, loss_fn_of
    model, inputs = EXAMPLES["gpt_tiny"]()
    loss = loss_fn_of(model)(model(*inputs), inputs)
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from examples.convnet import convnet_demo, convnet_tiny
from examples.gpt import gpt_bench, gpt_demo, gpt_small, gpt_tiny
from examples.llama import llama3_8b, llama3_70b, llama3_405b, llama_tiny

__all__ = ["EXAMPLES", "Factory", "LossFn", "get_example", "loss_fn_of"]

Factory = Callable[[], tuple[nn.Module, tuple]]
"""Zero-argument callable returning ``(model, inputs)``; see the module docstring."""
LossFn = Callable[[Tensor, tuple], Tensor]
"""``loss_fn(output, inputs) -> scalar``: ``output = model(*inputs)``."""

EXAMPLES: dict[str, Factory] = {
    "gpt_tiny": gpt_tiny,
    "gpt_small": gpt_small,
    "gpt_demo": gpt_demo,
    "gpt_bench": gpt_bench,
    "convnet_tiny": convnet_tiny,
    "convnet_demo": convnet_demo,
    "llama_tiny": llama_tiny,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_405b": llama3_405b,
}
"""Name -> factory. The ``*_tiny``/``*_small`` ones run a training step on CPU in well under a second;
``*_demo`` ones are sized so activations dominate the step's memory (the CLI default is
``gpt_demo``); ``gpt_bench`` is the benchmark decoder; ``llama3_*`` build on the meta device."""


def get_example(name: str) -> Factory:
    """The factory registered as ``name``; a KeyError that lists the known names otherwise."""
    try:
        return EXAMPLES[name]
    except KeyError:
        raise KeyError(f"unknown example {name!r}; known examples: {', '.join(sorted(EXAMPLES))}") from None


def _sum_loss(output: Tensor, inputs: tuple) -> Tensor:
    return output.sum()


def loss_fn_of(model: nn.Module) -> LossFn:
    """``model.loss_fn`` when the model defines one, else ``output.sum()`` (the planner's default)."""
    loss_fn = getattr(model, "loss_fn", None)
    return loss_fn if callable(loss_fn) else _sum_loss
