"""The optimizer state in the host's pinned memory between steps
(``train.optimizer_offload``, MaxText's ``optimizer_memory_host_offload``).

Its shardings carry ``memory_kind="pinned_host"``: the init program writes it there, the
train step takes it from there, moves it to the devices for the update
(:class:`jaxpar.update.Update`) and writes the new state back, and checkpoints restore
onto the same shardings. A device then holds the parameters, the gradients and the
activations; each step moves the optimizer state host → device → host (twice its bytes
over the host link).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxpar.errors import ConfigError
from jaxpar.state import TrainState

#: Where an offloaded optimizer state lives between steps.
HOST = "pinned_host"


def on_host(shardings: Any) -> Any:
    """``shardings`` (a tree of ``NamedSharding``) in pinned host memory."""
    return jax.tree.map(
        lambda s: s.with_memory_kind(HOST),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def check_executor(offload: bool, executor: str | None) -> None:
    """The offloaded state is moved inside the one program of a step; the sub-mesh
    executor runs a program per stage on shares of the state it places itself.

    Raises:
      ConfigError: for ``train.optimizer_offload`` with ``pipeline.executor=mpmd``.
    """
    if offload and executor == "mpmd":
        raise ConfigError(
            "train.optimizer_offload=true needs one program over the whole mesh, and "
            "pipeline.executor=mpmd runs one per stage: set pipeline.executor=spmd or "
            "train.optimizer_offload=false"
        )


def device_part(state: TrainState, offload: bool) -> TrainState:
    """The part of a train state tree (abstract or shardings) held in device memory:
    without the optimizer state when it is offloaded."""
    return replace(state, opt_state={}) if offload else state
