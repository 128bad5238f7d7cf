"""The train state: everything a step updates, as one pytree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step updates. ``skipped`` counts non-finite steps not applied;
    ``model_state`` holds the model's variables other than ``nnx.Param`` (BatchNorm
    statistics, the RNG streams of dropout, …) as a pure dict — empty for most models.

    The same class holds the abstract state (``ShapeDtypeStruct`` leaves) and the state's
    shardings (``NamedSharding`` leaves) in a :class:`jaxpar.plan.Plan`."""

    step: jax.Array
    params: Any
    opt_state: Any
    skipped: jax.Array
    model_state: Any = field(default_factory=dict)


class FromGradient(nnx.Variable):
    """A model variable whose next value is its gradient: the function that reads it is a
    ``custom_vjp`` that returns the variable's updated value as its cotangent, because
    what updates it is known only in the backward pass (an FP8 gradient's amax:
    :class:`jaxpar.models.fp8.Fp8History`). It is model state, not a parameter: the step
    differentiates the loss with respect to it too and keeps the result as its value (the
    optimizer never sees it), and evaluation leaves it unchanged. Each must be read once
    per forward pass: two reads would sum their updates."""
