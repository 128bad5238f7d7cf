"""The SPMD pipeline executor's forward-only pass: loss and metrics in evaluation mode.

Each device holds only its chunks of layers (no device gathers the whole model) and runs
the forward-only table of :func:`~jaxpar.pipeline.branches.forward_table`: the input
arriving from the left neighbour is used the tick it arrives, so no buffers are kept. The
layout of the stacked layers is the training pass's (:mod:`jaxpar.pipeline.executor`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.axes import Axis
from jaxpar.pipeline.branches import (
    F_FIRST,
    F_LAST,
    IDLE,
    F,
    Parts,
    forward_table,
    merged,
    zeros_like,
)
from jaxpar.pipeline.executor import message_shapes, split_for_stages, stage_map
from jaxpar.pipeline.layout import Layout
from jaxpar.task import Batch, StageSplit


def pipeline_eval(
    split: StageSplit,
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Batch,
    layout: Layout,
    *,
    model_state: Any = None,
) -> tuple[jax.Array, dict]:
    """Loss and metrics of ``params`` on ``batch`` in evaluation mode, through the stages.

    A forward-only pass (:func:`forward_table`) of the ``m`` microbatches and ``v`` chunks
    per device of ``layout.table``: the result equals the task's loss on the whole batch
    in evaluation mode, as a mean over ``m`` equal microbatches. The model state is read
    as it is by every microbatch (evaluation advances no RNG count). Traceable.
    """
    p, m, v = layout.table.p, layout.table.m, layout.table.v
    model_state = {} if model_state is None else model_state
    rest, layers = split_for_stages(split, params, p, v)
    parts = Parts(split, graphdef, train=False)
    full, chunk, mb = forward_table(p, m, v)
    used = np.unique(full)
    rows = (
        jnp.asarray(np.searchsorted(used, full).astype(np.int32)),
        jnp.asarray(chunk),
        jnp.asarray(mb),
    )
    scale = 1.0 / (m * layout.batch_shards())
    axes = (Axis.STAGE, *layout.batch_axes())

    def run(layers, rest, state, micro):
        return _run_forward(parts, p, layers, rest, state, micro, rows, used)

    def reduce(loss, metrics):
        return jax.lax.psum((loss * scale, jax.tree.map(lambda a: a * scale, metrics)), axes)

    fn = stage_map(layout, m, run, reduce, (P(), P()))
    return fn(layers, rest, model_state, dict(batch))


def _run_forward(parts: Parts, p: int, layers, rest, state, micro, rows, used):
    """The per-device scan of a forward-only pass: the input arriving from the left
    neighbour is used the tick it arrives (see :func:`forward_table`); the device holding
    the last chunk adds each microbatch's loss and metrics."""
    d = jax.lax.axis_index(Axis.STAGE)
    shapes = message_shapes(parts, layers, rest, state, micro)
    message = jnp.zeros(shapes.message.shape, shapes.message.dtype)
    aux = zeros_like(shapes.metrics)
    right = [(i, (i + 1) % p) for i in range(p)]

    def stage(w, x, mb, first_layer):
        y, loss, metrics = parts.stage(w, rest, state, x, mb, first_layer)
        return y.astype(message.dtype), loss, merged(aux, metrics)

    def idle(w, x, mb, first_layer):
        return message, jnp.zeros((), jnp.float32), aux

    def forward(w, x, mb, first_layer):
        return stage(w, x, mb, first_layer)

    def forward_first(w, x, mb, first_layer):
        x = parts.embed(rest, w, state, mb).astype(message.dtype)
        return forward(w, x, mb, first_layer)

    def forward_last(w, x, mb, first_layer):
        y, stage_loss, stage_metrics = stage(w, x, mb, first_layer)
        loss, metrics = parts.head(w, rest, state, y, mb)
        return message, loss.astype(jnp.float32) + stage_loss, merged(stage_metrics, metrics)

    fns = {IDLE: idle, F: forward, F_FIRST: forward_first, F_LAST: forward_last}

    def tick(c, row):
        branch, k, j = (r[d] for r in row)
        w = jax.tree.map(lambda t: t[k], layers)
        mb = {name: x[j] for name, x in micro.items()}
        send, loss, metrics = jax.lax.switch(
            branch, [fns[u] for u in used], w, c["in"], mb, (k * p + d) * shapes.per_chunk
        )
        return {
            "in": jax.lax.ppermute(send, Axis.STAGE, right),
            "loss": c["loss"] + loss,
            "metrics": jax.tree.map(jnp.add, c["metrics"], metrics),
        }, None

    carry = {"in": message, "loss": jnp.zeros((), jnp.float32), "metrics": aux}
    carry, _ = jax.lax.scan(tick, carry, rows)
    return carry["loss"], carry["metrics"]
