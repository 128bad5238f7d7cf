"""What a model without an activation count of its own keeps for its backward: the
residuals JAX saves (``jax.vjp``'s), read from the traced program without compiling.

A family's lab module counts its activations from its shape (:mod:`jaxpar.lab.
activations`, measured against compiled programs); a model it does not know — the ResNet,
a user's :class:`~jaxpar.task.Task` — has none. For those the estimate traces the loss's
backward once, at one device's share of one microbatch (each batch entry's shard shape
under the plan's shardings, over ``train.grad_accum``), on one device, and sums the arrays
its pullback closes over, less the parameters themselves (the step's arguments, already
counted). Under ``fsdp`` a device also holds the weights it gathers (:func:`gathered_bytes`).
What a device of the layout holds differs where the layout splits more than the batch:
activations split by channel under ``tensor`` are counted whole (an upper bound), and a
model's own ``jax.checkpoint`` keeps only its inputs (the recompute's transient is not
counted). A pipelined layout is left unestimated (its stages hold microbatches in
flight). Checked against the compiled step (``tests/test_residuals.py``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.axes import Axis
from jaxpar.logical import LAYERS
from jaxpar.plan.abstract import global_batch_shapes
from jaxpar.run import Run
from jaxpar.task import loss_weights


def residual_bytes(run: Run) -> float | None:
    """Bytes of the residuals one device's backward of one microbatch keeps (the module
    docstring), or None for a pipelined layout."""
    plan = run.plan
    if plan.pipeline is not None:
        return None
    state = plan.abstract_state
    shapes = global_batch_shapes(run.data.batch(0, run.config.train.batch_size), plan.row_share[1])
    shardings = plan.batch_shardings(shapes)
    local = {}
    for k, v in shapes.items():
        rows, *rest = shardings[k].shard_shape(v.shape)
        local[k] = jax.ShapeDtypeStruct((rows // plan.grad_accum, *rest), v.dtype)

    def pullback(params: Any, model_state: Any, b: dict) -> Any:
        # the task's loss as the plan's ModelLoss calls it, but outside the layout's
        # activation rules: traced on one device, at one device's shapes
        def loss(p: Any) -> jax.Array:
            model = nnx.merge(plan.model.graphdef, p, model_state)
            model.train()
            return plan.task.loss_fn(model, loss_weights(b))[0]

        return jax.vjp(loss, params)[1]

    traced = jax.make_jaxpr(pullback)(state.params, state.model_state, local).jaxpr
    arguments = {id(v) for v in traced.invars}
    return float(
        sum(
            math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize
            for v in traced.outvars
            if hasattr(v, "aval") and id(v) not in arguments
        )
    )


def gathered_bytes(run: Run) -> float:
    """Bytes of the weights a device gathers over ``fsdp`` and holds beyond its shards:
    every weight outside a stack of layers (XLA gathers them for the forward and keeps
    them for the backward: the compiled ResNets hold them) and one layer of each stack
    (a scan gathers its layer's as it runs it)."""
    plan = run.plan
    params = plan.abstract_state.params
    names = jax.tree.leaves(plan.model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    total = 0.0
    for leaf, sharding, axes in zip(
        jax.tree.leaves(params), jax.tree.leaves(plan.state_shardings.params), names
    ):
        whole = NamedSharding(sharding.mesh, PartitionSpec(*map(_without_fsdp, sharding.spec)))
        size = np.dtype(leaf.dtype).itemsize
        more = size * (
            math.prod(whole.shard_shape(leaf.shape)) - math.prod(sharding.shard_shape(leaf.shape))
        )
        total += more / leaf.shape[axes.index(LAYERS)] if LAYERS in axes else more
    return total


def _without_fsdp(entry: Any) -> Any:
    """A spec entry with ``fsdp`` left out."""
    if entry is None or isinstance(entry, str):
        return None if entry == Axis.FSDP else entry
    kept = tuple(a for a in entry if a != Axis.FSDP)
    return kept or None
