"""The sub-mesh executor's view of a stack of identical layers (``Task.stages``): what
each chunk runs, its rows of the stack (moved to the stage that runs it when a stage runs
``v`` > 1 chunks), and the gradients put back together (see :mod:`jaxpar.pipeline.mpmd`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.executor import advance_counts
from jaxpar.pipeline.views import STACKED, moved, stack_of, sum_over_stages
from jaxpar.task import Batch, StageSplit, checked_head, stage_output


@dataclass(frozen=True)
class ByStack:
    """A stack of identical layers (``Task.stages``): stage ``s`` holds the ``s``-th
    contiguous slab of the stack (the spmd executor's layout of it), and reads the other
    parameters (embedding, head) and the RNG streams in place; microbatch ``j`` draws with
    the step's RNG counts advanced by ``j``, as under the spmd executor.

    With ``v`` chunks a stage (``chunks`` holds ``p·v``), chunk ``c`` is layers
    ``[c·n, (c+1)·n)`` and runs on stage ``c mod p`` (as the spmd executor's interleaved
    view), but lies in stage ``c div v``'s slab: each step its rows move to the stage that
    runs them, and their gradients back."""

    split: StageSplit
    graphdef: nnx.GraphDef
    chunks: tuple[tuple[int, int], ...]
    rng_counts: Any

    def chunk_tree(self, shares: Sequence[Any], c: int) -> Any:
        """Chunk ``c``'s share: its stage's, with the stack's rows of chunk ``c`` (arrays
        moved there from the slab that holds them, abstract arrays shaped so, shardings
        as they are). Each entry of the stack gives the chunk its ``1/v`` of the slab's
        rows: an entry of every other layer (a mixture of experts' every second MLP) has
        half as many rows as the layers."""
        p = len(shares)
        here = shares[c % p]
        v = len(self.chunks) // p
        key = self.split.layers_key
        if v == 1 or not isinstance(here, dict) or key not in here:
            return here

        def rows(at: Any, there: Any) -> Any:
            if isinstance(at, jax.Array):
                n = there.shape[0] // v
                taken = _rows(there.sharding, (c % v) * n, n)(there)
                return moved(taken, at.sharding.mesh, at.sharding.spec)
            if isinstance(at, jax.ShapeDtypeStruct):
                shape = (at.shape[0] // v, *at.shape[1:])
                return jax.ShapeDtypeStruct(shape, at.dtype, sharding=at.sharding)
            return at

        return {**here, key: jax.tree.map(rows, here[key], shares[c // v][key])}

    def moves(self, trees: Sequence[Any], p: int) -> list[tuple[int, int, Any]]:
        """The chunks of ``trees`` (their parameters) run away from their slab: ``(slab's
        stage, running stage, the chunk's rows)``; a step moves the rows there and their
        gradients back."""
        v = len(self.chunks) // p
        key = self.split.layers_key
        return [(c // v, c % p, tree[key]) for c, tree in enumerate(trees) if c // v != c % p]

    def copied(self, trees: Sequence[Any], p: int) -> list[tuple[int, Any]]:
        """The rows each stage holds a copy of for the step: ``(running stage, the chunk's
        rows)`` for every chunk with ``v`` > 1 (:meth:`chunk_tree` copies its rows, moved
        or not); none with one chunk a stage (the slab itself)."""
        if len(self.chunks) == p:
            return []
        key = self.split.layers_key
        return [(c % p, tree[key]) for c, tree in enumerate(trees)]

    def forward(
        self, c: int, params: Any, state: Any, x: Any, mb: Batch, j: Any, train: bool, last: bool
    ) -> tuple[Any, Any]:
        model = nnx.merge(
            self.graphdef, params, advance_counts(state, self.rng_counts, j) if train else state
        )
        model.train() if train else model.eval()
        x = self.split.embed(model, mb) if c == 0 else x
        out = self.split.stage(model, x, mb, self.chunks[c][0])
        if not last:
            return out, state
        x, stage_loss, stage_metrics = stage_output(out)
        loss, metrics = checked_head(self.split, self.split.head(model, x, mb))
        return (
            loss + stage_loss,
            {
                **stage_metrics,
                **{
                    k: v + stage_metrics[k] if k in stage_metrics else v for k, v in metrics.items()
                },
            },
        ), state

    def collect(
        self, ex: Any, acc: list, states: list, model_state: Any, total: int
    ) -> tuple[Any, Any]:
        """Each stack's chunks side by side; the other parameters' gradients summed over the
        stages (a whole-mesh program); the RNG counts advanced by the step's microbatches."""

        p = len(ex.meshes)
        v = len(self.chunks) // p

        def one(home: int, *parts: jax.Array) -> jax.Array:
            if home == STACKED:  # each slab from its chunks, moved back to it
                return stack_of(
                    [_slab(ex, parts[s * v : (s + 1) * v], ex.meshes[s]) for s in range(p)],
                    ex.layout.mesh,
                )
            rows = stack_of(
                [ex.ordered(_row(part.sharding))(part) for part in _per_stage(ex, parts, p)],
                ex.layout.mesh,
            )
            return ex.ordered(
                sum_over_stages(NamedSharding(ex.layout.mesh, parts[0].sharding.spec))
            )(rows)

        grads = jax.tree.map(one, ex.homes.params, *acc)
        return grads, ex.ordered(self.advanced)(model_state, total)

    @functools.cached_property
    def advanced(self) -> Callable:
        return jax.jit(lambda state, by: advance_counts(state, self.rng_counts, by))


def _slab(ex: Any, parts: Sequence[jax.Array], mesh: Mesh) -> jax.Array:
    """A stage's slab of a stack's gradients from its chunks' (on the stages that ran
    them), in layer order, on the stage's sub-mesh ``mesh``."""
    if len(parts) == 1:
        return parts[0]
    spec = parts[0].sharding.spec
    here = [x if x.sharding.mesh == mesh else moved(x, mesh, spec) for x in parts]
    return ex.ordered(_joined(NamedSharding(mesh, spec)))(*here)


def _per_stage(ex: Any, parts: Sequence[jax.Array], p: int) -> list[jax.Array]:
    """The chunks' gradients of a leaf every stage reads, summed per stage (chunk ``c`` ran
    on stage ``c mod p``)."""
    sums = list(parts[:p])
    for c in range(p, len(parts)):
        sums[c % p] = ex.ordered(_added(parts[c].sharding))(sums[c % p], parts[c])
    return sums


@functools.cache
def _rows(sharding: NamedSharding, start: int, n: int) -> Callable:
    """Rows ``[start, start + n)`` of an array placed as ``sharding``."""
    return jax.jit(lambda x: x[start : start + n], out_shardings=sharding)


@functools.cache
def _joined(sharding: NamedSharding) -> Callable:
    """Arrays joined on their first dim, placed as ``sharding``."""
    return jax.jit(lambda *xs: jnp.concatenate(xs), out_shardings=sharding)


@functools.cache
def _added(sharding: NamedSharding) -> Callable:
    return jax.jit(jnp.add, out_shardings=sharding)


@functools.cache
def _row(sharding: NamedSharding) -> Callable:
    """``x`` as a row ``[1, …]`` (a stage's part of rows to sum over the stages)."""
    spec = P(None, *sharding.spec)
    return jax.jit(lambda x: x[None], out_shardings=NamedSharding(sharding.mesh, spec))
