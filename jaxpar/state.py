"""The train state: everything a step updates, as one pytree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax


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
