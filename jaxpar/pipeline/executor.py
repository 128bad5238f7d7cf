"""Runs a pipeline schedule table as one SPMD program: loss and gradients of a step.

``shard_map`` makes the ``stage`` axis (and the batch axes ``data``/``fsdp``)
manual; ``tensor`` stays automatic, so tensor parallelism inside a stage comes
from the same rules as without a pipeline. Inside, a ``lax.scan`` runs one
tick of :class:`~jaxpar.pipeline.ticks.TickTable` per iteration on every
device:

1. the activation arriving from the left neighbour and the gradient arriving
   from the right one are written into their buffer slots (or a trash slot);
2. ``lax.switch`` runs this device's action — forward, backward (a
   ``jax.vjp`` recomputed from the stashed stage input), input- or
   weight-gradient — on its microbatch and chunk of layers;
3. the outputs move one stage right (activations) and left (gradients) with
   ``ppermute``; every device runs the same two collectives every tick.

The embedding runs on the device holding chunk 0, head and loss on the one
holding the last chunk. Gradients accumulate per device and are reduced once,
after the scan: summed over ``stage`` for the parameters outside the stacked
layers; all-reduced over ``data`` and reduce-scattered over ``fsdp`` (for
parameters sharded over it). Under ``fsdp`` the weights enter the shard_map
gathered, once per step (ZeRO-1/2-like inside the pipeline: not per
microbatch). A bubble tick computes nothing, and
nothing computed from a bubble's buffers reaches the results (tested by
filling bubbles with NaN).

Layout of the stacked layers: ``[L, …]`` is viewed as ``[v, p, L/(p·v), …]``
with ``p`` over ``stage``, so device ``d`` holds chunks ``d, d+p, …``. For
``v = 1`` that is exactly the ``stage`` sharding of ``L`` (no data moves); for
interleaved schedules (``v > 1``) the view is a transpose of the stored layout,
which costs an all-to-all of the layer weights and of their gradients per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.logical import BATCH_AXES, Rules, activation_rules
from jaxpar.pipeline.branches import (
    ADDS_LAYER_GRADS,
    ADDS_OTHER_GRADS,
    F_FIRST,
    F_LAST,
    IDLE,
    F,
    Parts,
    branch_functions,
    branch_table,
    forward_table,
    merged,
)
from jaxpar.pipeline.ticks import TickTable
from jaxpar.task import Batch, StageSplit, split_microbatches

#: Axes the executor makes manual: the pipeline axis and the batch axes.
MANUAL_AXES = ("stage", "data", "fsdp")


def advance_counts(state: Any, counts: Any, by: Any) -> Any:
    """``state`` with every RNG count (where ``counts`` is True) advanced by ``by``."""
    return jax.tree.map(lambda v, c: v + jnp.asarray(by).astype(v.dtype) if c else v, state, counts)


def pipeline_grads(
    split: StageSplit,
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Batch,
    *,
    table: TickTable,
    mesh: Mesh,
    rules: Rules,
    param_specs: Any = None,
    bubble_value: float = 0.0,
    model_state: Any = None,
    rng_counts: Any = None,
    context: Any = None,
) -> tuple[jax.Array, dict, Any]:
    """Loss, metrics and gradients of ``params`` on ``batch`` through the pipeline.

    Traceable (called inside the jitted train step). The result equals
    ``jax.value_and_grad`` of the task's loss on the whole batch, run as ``m``
    microbatches in order.

    Model state (RNG streams only: BatchNorm statistics cannot be split into stages) is
    read, not updated: microbatch ``j`` sees every RNG count (``rng_counts`` True) advanced
    by ``j`` — what a model whose forward advances its counts by one would see run
    microbatch after microbatch — whatever tick runs it; the caller advances the counts by
    ``m`` for the step.

    Args:
      split: how the model cuts into stages.
      graphdef: the model's graph definition.
      params: pure-dict parameters; ``params[split.layers_key]`` stacked on ``L``.
      batch: the global batch (batch dim sharded over data/fsdp).
      table: the schedule's tick table (p = mesh.stage).
      mesh, rules: the mesh and the rules (activation constraints inside stages).
      param_specs: the parameters' PartitionSpecs; gradients of parameters sharded
        over ``fsdp`` leave reduce-scattered over it (default: all-reduced).
      bubble_value: what bubble buffers and messages hold (NaN in tests).
      model_state: the model's non-parameter state (pure dict; RNG streams).
      rng_counts: like ``model_state``, True for each RNG count.
      context: how attention runs across a split sequence (:mod:`jaxpar.context`).
    """
    p, v, m = table.p, table.v, table.m
    model_state = {} if model_state is None else model_state
    rng_counts = jax.tree.map(lambda _: False, model_state) if rng_counts is None else rng_counts
    key = split.layers_key
    rest, layers, batch_axes, shards, inner_rules = _split_for_stages(
        split, params, p, v, mesh, rules
    )
    parts = Parts(split, graphdef)
    # only the branches this schedule uses are compiled
    full = branch_table(table)
    used = np.unique(full)
    branches = jnp.asarray(np.searchsorted(used, full).astype(np.int32))
    columns = [
        jnp.asarray(a)
        for a in (
            table.chunk,
            table.mb,
            table.act_slot,
            table.grad_slot,
            table.recv_act,
            table.recv_grad,
        )
    ]

    def body(layers, rest, state, batch):
        layers = jax.tree.map(lambda w: w[:, 0], layers)  # [v, Lc, …]: this device's chunks
        micro = {k: split_microbatches(x, m) for k, x in batch.items()}
        with activation_rules(jax.sharding.get_abstract_mesh(), inner_rules, context):
            return _run(
                parts,
                table,
                layers,
                rest,
                (state, rng_counts),
                micro,
                branches,
                used,
                columns,
                scale=1.0 / (m * shards),
                fill=bubble_value,
            )

    reduction = _Reduction(batch_axes, _fsdp_dims(param_specs, key, layers, rest, batch_axes))
    fn = jax.shard_map(
        lambda w, r, s, b: reduction(*body(w, r, s, b)),
        mesh=mesh,
        in_specs=(P(None, "stage"), P(), P(), P(batch_axes or None)),
        out_specs=(P(), P(), *reduction.out_specs(layers, rest)),
        axis_names=set(MANUAL_AXES),
        check_vma=False,
    )
    loss, metrics, g_layers, g_rest = fn(layers, rest, model_state, dict(batch))
    g_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[3:]), g_layers)
    return loss, metrics, {**g_rest, key: g_layers}


def _split_for_stages(
    split: StageSplit, params: Any, p: int, v: int, mesh: Mesh, rules: Rules
) -> tuple[Any, Any, tuple[str, ...], int, Rules]:
    """(the non-layer parameters, the layers as [v, p, L/(p·v), …], the batch axes in use,
    how many batch shards they make, the rules inside the stages' manual axes)."""
    key = split.layers_key
    rest = {k: x for k, x in params.items() if k != key}
    layers = jax.tree.map(
        lambda w: w.reshape(v, p, w.shape[0] // (p * v), *w.shape[1:]), params[key]
    )
    batch_axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    inner_rules = {n: tuple(a for a in axes if a not in MANUAL_AXES) for n, axes in rules.items()}
    return rest, layers, batch_axes, shards, inner_rules


def pipeline_eval(
    split: StageSplit,
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Batch,
    *,
    p: int,
    m: int,
    v: int,
    mesh: Mesh,
    rules: Rules,
    model_state: Any = None,
    context: Any = None,
) -> tuple[jax.Array, dict]:
    """Loss and metrics of ``params`` on ``batch`` in evaluation mode, through the stages.

    A forward-only pass (:func:`forward_table`): each device holds only its chunks of
    layers (no device gathers the whole model), and the result equals the task's loss on
    the whole batch in evaluation mode, as a mean over ``m`` equal microbatches. The model
    state is read as it is by every microbatch (evaluation advances no RNG count).
    Traceable; ``p, m, v`` as in the training table.
    """
    model_state = {} if model_state is None else model_state
    rest, layers, batch_axes, shards, inner_rules = _split_for_stages(
        split, params, p, v, mesh, rules
    )
    parts = Parts(split, graphdef, train=False)
    full, chunk, mb = forward_table(p, m, v)
    used = np.unique(full)
    rows = (
        jnp.asarray(np.searchsorted(used, full).astype(np.int32)),
        jnp.asarray(chunk),
        jnp.asarray(mb),
    )

    def body(layers, rest, state, batch):
        layers = jax.tree.map(lambda w: w[:, 0], layers)  # [v, Lc, …]: this device's chunks
        micro = {k: split_microbatches(x, m) for k, x in batch.items()}
        with activation_rules(jax.sharding.get_abstract_mesh(), inner_rules, context):
            loss, metrics = _run_forward(parts, p, layers, rest, state, micro, rows, used)
        scale = 1.0 / (m * shards)
        return jax.lax.psum(
            (loss * scale, jax.tree.map(lambda a: a * scale, metrics)), ("stage", *batch_axes)
        )

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(None, "stage"), P(), P(), P(batch_axes or None)),
        out_specs=(P(), P()),
        axis_names=set(MANUAL_AXES),
        check_vma=False,
    )
    return fn(layers, rest, model_state, dict(batch))


def _message_shapes(parts: Parts, layers, rest, state, micro):
    """(this device's first chunk, layers per chunk, the shape of a message between stages,
    the shapes of the metrics: the head's and the chunks' own), from the first
    microbatch."""
    first_mb = {k: x[0] for k, x in micro.items()}
    chunk0 = jax.tree.map(lambda w: w[0], layers)
    per_chunk = jax.tree.leaves(chunk0)[0].shape[0]
    x_shape = jax.eval_shape(parts.embed, rest, chunk0, state, first_mb)
    x0 = jnp.zeros(x_shape.shape, x_shape.dtype)
    _, _, stage_shape = jax.eval_shape(lambda: parts.stage(chunk0, rest, state, x0, first_mb, 0))
    _, head_shape = jax.eval_shape(lambda: parts.head(chunk0, rest, state, x0, first_mb))
    return chunk0, per_chunk, x_shape, {**stage_shape, **head_shape}


def _run_forward(parts: Parts, p: int, layers, rest, state, micro, rows, used):
    """The per-device scan of a forward-only pass: the input arriving from the left
    neighbour is used the tick it arrives (see :func:`forward_table`); the device holding
    the last chunk adds each microbatch's loss and metrics."""
    d = jax.lax.axis_index("stage")
    _chunk0, per_chunk, x_shape, aux_shape = _message_shapes(parts, layers, rest, state, micro)
    message = jnp.zeros(x_shape.shape, x_shape.dtype)
    aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape)
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
            branch, [fns[u] for u in used], w, c["in"], mb, (k * p + d) * per_chunk
        )
        return {
            "in": jax.lax.ppermute(send, "stage", right),
            "loss": c["loss"] + loss,
            "metrics": jax.tree.map(jnp.add, c["metrics"], metrics),
        }, None

    carry = {"in": message, "loss": jnp.zeros((), jnp.float32), "metrics": aux}
    carry, _ = jax.lax.scan(tick, carry, rows)
    return carry["loss"], carry["metrics"]


@dataclass(frozen=True)
class _Reduction:
    """How results leave the shard_map, once per step after the scan.

    ``dims``: per gradient leaf of (other params, stacked layers as [v, 1, Lc, …]),
    the dim to reduce-scatter over ``fsdp``, or −1 to all-reduce over the batch axes.
    """

    batch_axes: tuple[str, ...]
    dims: tuple[Any, Any]

    def grad(self, g: jax.Array, dim: int) -> jax.Array:
        if dim < 0:
            return jax.lax.psum(g, self.batch_axes) if self.batch_axes else g
        # Scatter first, then all-reduce the 1/fsdp shard over data: the textbook order,
        # which moves (n−1)/n·S + 2(d−1)/d·S/n instead of 2(d−1)/d·S + (n−1)/n·S.
        g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
        data_axes = tuple(a for a in self.batch_axes if a != "fsdp")
        return jax.lax.psum(g, data_axes) if data_axes else g

    def __call__(self, loss, metrics, g_layers, g_rest):
        loss, metrics = jax.lax.psum((loss, metrics), ("stage", *self.batch_axes))
        g_rest = jax.tree.map(self.grad, jax.lax.psum(g_rest, "stage"), self.dims[0])
        g_layers = jax.tree.map(lambda g, dim: self.grad(g[:, None], dim), g_layers, self.dims[1])
        return loss, metrics, g_layers, g_rest

    def out_specs(self, layers: Any, rest: Any) -> tuple[Any, Any]:
        """Specs of the (stacked-layer, other) gradients: 'stage' on the chunk dim of the
        layers, 'fsdp' where reduce-scattered."""

        def spec(dim, rank, lead=()):
            entries = [*lead, *[None] * (rank - len(lead))]
            if dim >= 0:
                entries[dim] = "fsdp"
            return P(*entries)

        return (
            jax.tree.map(lambda w, d: spec(d, w.ndim, (None, "stage")), layers, self.dims[1]),
            jax.tree.map(lambda w, d: spec(d, w.ndim), rest, self.dims[0]),
        )


def _fsdp_dims(
    specs: Any, key: str, layers: Any, rest: Any, batch_axes: tuple[str, ...]
) -> tuple[Any, Any]:
    """Reduce-scatter dims for :class:`_Reduction` from the parameters' specs.

    Without specs or without an ``fsdp`` axis every gradient is all-reduced (−1). A
    stored dim i of a stacked layer is dim i + 2 of its [v, 1, Lc, …] view.
    """
    if specs is None or "fsdp" not in batch_axes:
        return jax.tree.map(lambda _: -1, rest), jax.tree.map(lambda _: -1, layers)

    def dim_of(spec, shift):
        for i, entry in enumerate(spec):
            if entry == "fsdp" and (i > 0 or shift == 0):
                return i + shift
        return -1

    is_spec = lambda x: isinstance(x, P)
    rest_dims = {
        k: jax.tree.map(lambda s: dim_of(s, 0), v, is_leaf=is_spec)
        for k, v in specs.items()
        if k != key
    }
    return rest_dims, jax.tree.map(lambda s: dim_of(s, 2), specs[key], is_leaf=is_spec)


def _run(
    parts: Parts,
    table: TickTable,
    layers,
    rest,
    state,
    micro,
    branches,
    used,
    columns,
    *,
    scale: float,
    fill: float,
):
    """The per-device scan over the table (inside ``shard_map``); ``state`` is the model
    state and its RNG-count mask.

    A gradient term is added into its accumulator only on the ticks that produce one (a
    two-way ``lax.cond`` after the switch, which XLA updates in place): layer gradients
    on B and W ticks, the other parameters' on chunk 0's B and I ticks (the embedding) and
    the last chunk's B and W ticks (the head). Every other tick leaves the accumulators
    untouched. (Passing them through the switch itself would not do: XLA copies what a
    conditional of more than two branches passes through, every tick.)
    """
    p = table.p
    d = jax.lax.axis_index("stage")
    state, counts = state
    chunk0, per_chunk, x_shape, aux_shape = _message_shapes(parts, layers, rest, state, micro)
    message = jnp.full(x_shape.shape, fill, x_shape.dtype)
    zeros_like = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)
    carry = {
        "acts": jnp.full((table.act_slots + 1, *x_shape.shape), fill, x_shape.dtype),
        "grads": jnp.full((table.grad_slots + 1, *x_shape.shape), fill, x_shape.dtype),
        "in_act": message,
        "in_grad": message,
        "g_layers": zeros_like(layers),
        "g_rest": zeros_like(rest),
        "loss": jnp.zeros((), jnp.float32),
        "metrics": zeros_like(aux_shape),
    }
    seed = jnp.asarray(scale, jnp.float32)
    right = [(i, (i + 1) % p) for i in range(p)]
    left = [(i, (i - 1) % p) for i in range(p)]
    fns = branch_functions(
        parts, message, seed, zeros_like(chunk0), zeros_like(rest), zeros_like(aux_shape)
    )
    adds_dw = jnp.asarray(np.isin(used, ADDS_LAYER_GRADS))
    adds_drest = jnp.asarray(np.isin(used, ADDS_OTHER_GRADS))

    def tick(c, row):
        branch, (k, j, a_slot, g_slot, recv_a, recv_g) = row[0][d], [r[d] for r in row[1]]
        acts = c["acts"].at[recv_a].set(c["in_act"])
        grads = c["grads"].at[recv_g].set(c["in_grad"])
        w = jax.tree.map(lambda t: t[k], layers)
        mb = {name: x[j] for name, x in micro.items()}
        where = (advance_counts(state, counts, j), (k * p + d) * per_chunk)
        send_act, send_grad, dw, drest, loss, aux = jax.lax.switch(
            branch, [fns[u] for u in used], w, rest, acts[a_slot], grads[g_slot], mb, where
        )
        g_layers = jax.lax.cond(
            adds_dw[branch],
            lambda g: jax.tree.map(lambda g, u: g.at[k].add(u), g, dw),
            lambda g: g,
            c["g_layers"],
        )
        g_rest = jax.lax.cond(
            adds_drest[branch], lambda g: jax.tree.map(jnp.add, g, drest), lambda g: g, c["g_rest"]
        )
        new = {
            "acts": acts,
            "grads": grads,
            "in_act": jax.lax.ppermute(send_act, "stage", right),
            "in_grad": jax.lax.ppermute(send_grad, "stage", left),
            "g_layers": g_layers,
            "g_rest": g_rest,
            "loss": c["loss"] + loss,
            "metrics": jax.tree.map(jnp.add, c["metrics"], aux),
        }
        return new, None

    carry, _ = jax.lax.scan(tick, carry, (branches, columns))
    return carry["loss"], carry["metrics"], carry["g_layers"], carry["g_rest"]
