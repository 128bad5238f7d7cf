"""A task's model as shapes and logical names, and a batch's global shapes (nothing is
allocated: ``nnx.eval_shape``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from jaxpar import sharding as shd
from jaxpar.errors import TaskError
from jaxpar.state import FromGradient
from jaxpar.task import Task


@dataclass(frozen=True)
class AbstractModel:
    """A task's model without any array: its graph, its variables' shapes and their
    logical names (pure dicts), split into trainable ``params`` and the other ``state``.

    ``unnamed`` lists the parameters without logical names (replicated); ``state_kinds``
    the variable types of the state (``BatchStat``, ``RngKey``, …); ``rng_counts`` is True
    for each ``RngCount`` of the state (like ``state``); ``from_gradient`` names the types
    among them whose next value is their gradient (:class:`jaxpar.state.FromGradient`)."""

    graphdef: nnx.GraphDef
    params: Any
    state: Any
    param_axes: Any
    state_axes: Any
    unnamed: tuple[str, ...]
    state_kinds: tuple[str, ...]
    rng_counts: Any
    from_gradient: tuple[str, ...] = ()

    @property
    def stateful(self) -> bool:
        """Whether the model has variables besides its parameters."""
        return bool(jax.tree.leaves(self.state))

    @property
    def beyond_rngs(self) -> tuple[str, ...]:
        """The kinds of state besides RNG streams (whose counts every shard of a batch
        advances alike): BatchNorm statistics, FP8 histories, a user's own."""
        return tuple(k for k in self.state_kinds if k not in ("RngKey", "RngCount"))


def state_per_shard(task: Task, model: AbstractModel) -> bool:
    """Whether a data shard's step would make the model's state its own (so the step may
    not accumulate per data shard): state besides RNG streams, or RNG streams that draw
    over the batch's shape rather than by example (``Task.draws_by_example``)."""
    return bool(model.beyond_rngs) or (model.stateful and not task.draws_by_example)


def abstract_model(task: Task, seed: int = 0) -> AbstractModel:
    """The task's model as shapes and names (``nnx.eval_shape``: nothing is allocated)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: _checked_model(task, task.model_fn(nnx.Rngs(seed))))
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    param_axes, unnamed = shd.logical_axes(params, task.path_rules)
    state_axes, _ = shd.logical_axes(state)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kinds = sorted({type(v).__name__ for v in variables})
    pure = nnx.to_pure_dict(state)
    counts = jax.tree.unflatten(
        jax.tree.structure(pure), [isinstance(v, nnx.RngCount) for v in variables]
    )
    return AbstractModel(
        graphdef,
        nnx.to_pure_dict(params),
        pure,
        param_axes,
        state_axes,
        tuple(unnamed),
        tuple(kinds),
        counts,
        tuple(sorted({type(v).__name__ for v in variables if isinstance(v, FromGradient)})),
    )


def _checked_model(task: Task, model: Any) -> nnx.Module:
    """``model`` if it is an NNX module; else one line saying what ``model_fn`` must return
    (a Linen module goes through :class:`jaxpar.Linen`)."""
    if isinstance(model, nnx.Module):
        return model
    kind = type(model).__name__
    linen = type(model).__module__.startswith("flax.linen") or any(
        c.__module__.startswith("flax.linen") for c in type(model).__mro__
    )
    fix = (
        f"wrap the Linen module: jaxpar.Linen({kind}(...), example_input, rngs=rngs)"
        if linen
        else "return the model built with the given rngs"
    )
    raise TaskError(f"task '{task.name}': model_fn returned a {kind}, not a flax.nnx.Module; {fix}")


def global_batch_shapes(
    host_batch: Mapping[str, Any], count: int
) -> dict[str, jax.ShapeDtypeStruct]:
    """The global shapes of a batch of which this process holds ``host_batch``, one of
    ``count`` equal shares of the rows (:attr:`jaxpar.plan.Plan.row_share`)."""
    return {
        k: jax.ShapeDtypeStruct((v.shape[0] * count, *v.shape[1:]), v.dtype)
        for k, v in host_batch.items()
    }


def warn_unnamed(paths: tuple[str, ...]) -> None:
    """Says which parameters carry no logical names (they are replicated on every device)."""
    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
    warnings.warn(
        f"{len(paths)} parameter{'s carry' if len(paths) != 1 else ' carries'} no logical axes "
        f"and {'are' if len(paths) != 1 else 'is'} "
        f"replicated on every device: {shown}; to shard them, annotate them "
        "(kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')) or nnx.Param(value, "
        "out_sharding=(...))) or give the Task path_rules",
        stacklevel=4,
    )
