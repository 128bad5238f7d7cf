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
filling bubbles with NaN). The reduction is :mod:`jaxpar.pipeline.reduction`; the
forward-only pass of evaluation, :mod:`jaxpar.pipeline.forward`.

Layout of the stacked layers: ``[L, …]`` is viewed as ``[v, p, L/(p·v), …]``
with ``p`` over ``stage``, so device ``d`` holds chunks ``d, d+p, …``. For
``v = 1`` that is exactly the ``stage`` sharding of ``L`` (no data moves); for
interleaved schedules (``v > 1``) the view is a transpose of the stored layout,
which costs an all-to-all of the layer weights and of their gradients per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.axes import MANUAL_AXES, Axis
from jaxpar.pipeline.branches import (
    ADDS_LAYER_GRADS,
    ADDS_OTHER_GRADS,
    Parts,
    branch_functions,
    branch_table,
    zeros_like,
)
from jaxpar.pipeline.layout import Layout
from jaxpar.pipeline.reduction import Reduction, fsdp_dims
from jaxpar.pipeline.ticks import TickTable
from jaxpar.task import Batch, StageSplit, split_microbatches

#: The tick table's columns each device reads at every tick, in the order the scan unpacks.
_COLUMNS = ("chunk", "mb", "act_slot", "grad_slot", "recv_act", "recv_grad")


def advance_counts(state: Any, counts: Any, by: Any) -> Any:
    """``state`` with every RNG count (where ``counts`` is True) advanced by ``by``."""
    return jax.tree.map(lambda v, c: v + jnp.asarray(by).astype(v.dtype) if c else v, state, counts)


def pipeline_grads(
    split: StageSplit,
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Batch,
    layout: Layout,
    *,
    model_state: Any = None,
    rng_counts: Any = None,
    bubble_value: float = 0.0,
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
      layout: the mesh, the rules (activation constraints inside stages), the context
        settings, the schedule's tick table (p = mesh.stage) and the parameters' specs
        (gradients of parameters sharded over ``fsdp`` leave reduce-scattered over it;
        without specs all are all-reduced).
      model_state: the model's non-parameter state (pure dict; RNG streams).
      rng_counts: like ``model_state``, True for each RNG count.
      bubble_value: what bubble buffers and messages hold (NaN in tests).
    """
    table = layout.table
    model_state = {} if model_state is None else model_state
    rng_counts = jax.tree.map(lambda _: False, model_state) if rng_counts is None else rng_counts
    key = split.layers_key
    rest, layers = split_for_stages(split, params, table.p, table.v)
    scan = _Scan(
        Parts(split, graphdef),
        _Rows.of(table),
        rng_counts,
        scale=1.0 / (table.m * layout.batch_shards()),
        fill=bubble_value,
    )
    batch_axes = layout.batch_axes()
    reduction = Reduction(batch_axes, fsdp_dims(layout.param_specs, key, layers, rest, batch_axes))
    fn = stage_map(layout, table.m, scan, reduction, (P(), P(), *reduction.out_specs(layers, rest)))
    loss, metrics, g_layers, g_rest = fn(layers, rest, model_state, dict(batch))
    g_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[3:]), g_layers)
    return loss, metrics, {**g_rest, key: g_layers}


# ---- what the training and the evaluation pass share ----------------------------------------
def split_for_stages(split: StageSplit, params: Any, p: int, v: int) -> tuple[Any, Any]:
    """(the non-layer parameters, the layers as [v, p, L/(p·v), …])."""
    key = split.layers_key
    rest = {k: x for k, x in params.items() if k != key}
    layers = jax.tree.map(
        lambda w: w.reshape(v, p, w.shape[0] // (p * v), *w.shape[1:]), params[key]
    )
    return rest, layers


def stage_map(layout: Layout, m: int, run: Any, reduce: Any, out_specs: Any) -> Any:
    """``(layers, rest, model_state, batch) -> …`` under ``shard_map`` with the
    :data:`~jaxpar.axes.MANUAL_AXES` manual: each device runs ``run(layers, rest, state,
    micro)`` on its chunks of layers (``[v, Lc, …]``) and its rows cut into ``m``
    microbatches, with the layout's rules inside the stages; ``reduce`` then combines the
    devices' results."""

    def body(layers, rest, state, batch):
        layers = jax.tree.map(lambda w: w[:, 0], layers)  # [v, Lc, …]: this device's chunks
        micro = {k: split_microbatches(x, m) for k, x in batch.items()}
        with layout.manual(MANUAL_AXES).activation_rules():
            out = run(layers, rest, state, micro)
        return reduce(*out)

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(P(None, Axis.STAGE), P(), P(), P(layout.batch_axes() or None)),
        out_specs=out_specs,
        axis_names=set(MANUAL_AXES),
        check_vma=False,
    )


@dataclass(frozen=True)
class Shapes:
    """What a device's scan is built around, from the first microbatch: its first chunk of
    layers, the layers per chunk, the shape of a message between stages, and the shapes of
    the metrics (the head's and the chunks' own)."""

    chunk0: Any
    per_chunk: int
    message: jax.ShapeDtypeStruct
    metrics: Any


def message_shapes(parts: Parts, layers, rest, state, micro) -> Shapes:
    """The :class:`Shapes` of this device's scan."""
    first_mb = {k: x[0] for k, x in micro.items()}
    chunk0 = jax.tree.map(lambda w: w[0], layers)
    per_chunk = jax.tree.leaves(chunk0)[0].shape[0]
    x_shape = jax.eval_shape(parts.embed, rest, chunk0, state, first_mb)
    x0 = jnp.zeros(x_shape.shape, x_shape.dtype)
    _, _, stage_shape = jax.eval_shape(lambda: parts.stage(chunk0, rest, state, x0, first_mb, 0))
    _, head_shape = jax.eval_shape(lambda: parts.head(chunk0, rest, state, x0, first_mb))
    return Shapes(chunk0, per_chunk, x_shape, {**stage_shape, **head_shape})


# ---- the training scan ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Rows:
    """The tick table as the scan reads it. ``used``: the switch branches this schedule
    uses (only those are compiled); ``branches``: [ticks, p] indices into ``used``;
    ``columns``: the table's :data:`_COLUMNS`; ``adds_dw``/``adds_drest``: per used branch,
    whether it produces a layer gradient / another parameter's gradient."""

    table: TickTable
    used: np.ndarray
    branches: jax.Array
    columns: tuple[jax.Array, ...]
    adds_dw: jax.Array
    adds_drest: jax.Array

    @classmethod
    def of(cls, table: TickTable) -> _Rows:
        full = branch_table(table)
        used = np.unique(full)
        return cls(
            table=table,
            used=used,
            branches=jnp.asarray(np.searchsorted(used, full).astype(np.int32)),
            columns=tuple(jnp.asarray(getattr(table, c)) for c in _COLUMNS),
            adds_dw=jnp.asarray(np.isin(used, ADDS_LAYER_GRADS)),
            adds_drest=jnp.asarray(np.isin(used, ADDS_OTHER_GRADS)),
        )


@dataclass(frozen=True, eq=False)
class _Scan:
    """The per-device scan over the table (inside ``shard_map``); ``counts`` marks the
    model state's RNG counts; ``scale`` seeds each backward (1 / the loss terms summed);
    ``fill`` is what bubble buffers and messages hold.

    A gradient term is added into its accumulator only on the ticks that produce one (a
    two-way ``lax.cond`` after the switch, which XLA updates in place): layer gradients
    on B and W ticks, the other parameters' on chunk 0's B and I ticks (the embedding) and
    the last chunk's B and W ticks (the head). Every other tick leaves the accumulators
    untouched. (Passing them through the switch itself would not do: XLA copies what a
    conditional of more than two branches passes through, every tick.)
    """

    parts: Parts
    rows: _Rows
    counts: Any
    scale: float
    fill: float

    def __call__(self, layers, rest, state, micro):
        """(loss, metrics, layer gradients, other gradients) summed on this device."""
        shapes = message_shapes(self.parts, layers, rest, state, micro)
        message = jnp.full(shapes.message.shape, self.fill, shapes.message.dtype)
        carry = self._initial_carry(message, shapes, layers, rest)
        tick = _Tick(
            scan=self,
            fns=self._branch_functions(message, shapes, rest),
            layers=layers,
            rest=rest,
            state=state,
            micro=micro,
            per_chunk=shapes.per_chunk,
            d=jax.lax.axis_index(Axis.STAGE),
        )
        carry, _ = jax.lax.scan(tick, carry, (self.rows.branches, self.rows.columns))
        return carry["loss"], carry["metrics"], carry["g_layers"], carry["g_rest"]

    def _initial_carry(self, message, shapes: Shapes, layers, rest) -> dict:
        """Buffers full of ``fill`` (one slot more than the table uses: the trash slot),
        no message yet, and zero sums."""
        table = self.rows.table
        buffer = lambda slots: jnp.full((slots + 1, *message.shape), self.fill, message.dtype)
        return {
            "acts": buffer(table.act_slots),
            "grads": buffer(table.grad_slots),
            "in_act": message,
            "in_grad": message,
            "g_layers": zeros_like(layers),
            "g_rest": zeros_like(rest),
            "loss": jnp.zeros((), jnp.float32),
            "metrics": zeros_like(shapes.metrics),
        }

    def _branch_functions(self, message, shapes: Shapes, rest) -> list:
        """The switch branches of the used actions, in the order of ``rows.used``."""
        seed = jnp.asarray(self.scale, jnp.float32)
        fns = branch_functions(
            self.parts,
            message,
            seed,
            shapes.chunk0,
            rest,
            zeros_like(shapes.metrics),
        )
        return [fns[u] for u in self.rows.used]


@dataclass(frozen=True, kw_only=True, eq=False)
class _Tick:
    """One tick of :class:`_Scan` on device ``d`` (built while tracing inside the
    ``shard_map``): write the arrived messages into their slots, run this device's
    action, add its gradients, send its outputs on."""

    scan: _Scan
    fns: list
    layers: Any
    rest: Any
    state: Any
    micro: Any
    per_chunk: int
    d: jax.Array

    def __call__(self, c: dict, row: Any) -> tuple[dict, None]:
        p = self.scan.rows.table.p
        d = self.d
        branch = row[0][d]
        k, j, a_slot, g_slot, recv_a, recv_g = (r[d] for r in row[1])
        acts = c["acts"].at[recv_a].set(c["in_act"])
        grads = c["grads"].at[recv_g].set(c["in_grad"])
        w = jax.tree.map(lambda t: t[k], self.layers)
        mb = {name: x[j] for name, x in self.micro.items()}
        where = (advance_counts(self.state, self.scan.counts, j), (k * p + d) * self.per_chunk)
        send_act, send_grad, dw, drest, loss, aux = jax.lax.switch(
            branch, self.fns, w, self.rest, acts[a_slot], grads[g_slot], mb, where
        )
        new = {
            "acts": acts,
            "grads": grads,
            "in_act": jax.lax.ppermute(send_act, Axis.STAGE, _ring(p, +1)),
            "in_grad": jax.lax.ppermute(send_grad, Axis.STAGE, _ring(p, -1)),
            **self._accumulated(c, branch, k, dw, drest),
            "loss": c["loss"] + loss,
            "metrics": jax.tree.map(jnp.add, c["metrics"], aux),
        }
        return new, None

    def _accumulated(self, c: dict, branch, k, dw, drest) -> dict:
        """The gradient sums with this tick's terms added where its branch produces any."""
        rows = self.scan.rows
        g_layers = jax.lax.cond(
            rows.adds_dw[branch],
            lambda g: jax.tree.map(lambda g, u: g.at[k].add(u), g, dw),
            lambda g: g,
            c["g_layers"],
        )
        g_rest = jax.lax.cond(
            rows.adds_drest[branch],
            lambda g: jax.tree.map(jnp.add, g, drest),
            lambda g: g,
            c["g_rest"],
        )
        return {"g_layers": g_layers, "g_rest": g_rest}


def _ring(p: int, step: int) -> list[tuple[int, int]]:
    """``ppermute`` pairs sending each stage's message ``step`` stages on, round the ring."""
    return [(i, (i + step) % p) for i in range(p)]
