"""The pipeline executor's switch branches: which one a device runs at each tick, and what
each computes.

A device's action at a tick (:data:`~jaxpar.pipeline.schedule.KINDS`: forward, backward,
input- or weight-gradient) becomes one ``lax.switch`` branch, specialised for where the
chunk sits in the model: chunk 0 also runs the embedding, the last chunk the head and
loss. :func:`branch_table` maps a tick table to branches; :func:`forward_table` is the
forward-only table of an evaluation pass; :func:`branch_functions` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import LayoutError
from jaxpar.pipeline.schedule import KINDS
from jaxpar.pipeline.ticks import TickTable
from jaxpar.task import StageSplit

# lax.switch branches. The forward of the last chunk is folded into its backward (which
# recomputes it with the head), so it is idle in training. Chunk 0 has branches of its own:
# the embedding runs there and nowhere else (its backward recomputes the embedding, a
# lookup, instead of stashing it). The forward-only evaluation table
# (:func:`forward_table`) uses F_FIRST, F and F_LAST.
(IDLE, F, F_FIRST, F_LAST, B, B_FIRST, B_LAST, I, I_FIRST, I_LAST, W, W_FIRST,
 W_LAST) = range(13)
#: the branches that produce a layer gradient, and those that produce other parameters'
ADDS_LAYER_GRADS = (B, B_FIRST, B_LAST, W, W_FIRST, W_LAST)
ADDS_OTHER_GRADS = (B_FIRST, B_LAST, I_FIRST, W_LAST)


def _chunk_ends(table_chunk: np.ndarray, p: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Masks [ticks, p] of the ticks that run chunk 0 and the last chunk."""
    chunk = table_chunk * p + np.arange(p)[None, :]
    return chunk == 0, chunk == p * v - 1


def branch_table(table: TickTable) -> np.ndarray:
    """[ticks, p] switch branch per device and tick (what to run, where in the model)."""
    first, last = _chunk_ends(table.chunk, table.p, table.v)
    kind = np.asarray(KINDS)[table.kind]
    out = np.full(table.kind.shape, IDLE, np.int32)
    for k, mid, start, end in (("F", F, F_FIRST, IDLE), ("B", B, B_FIRST, B_LAST),
                               ("I", I, I_FIRST, I_LAST), ("W", W, W_FIRST, W_LAST)):
        out[kind == k] = np.select([first, last], [start, end], mid)[kind == k]
    return out


def forward_table(p: int, m: int, v: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(switch branch, device-local chunk, microbatch), each [ticks, p], of a forward-only
    pass (evaluation): ``m·v + p − 1`` ticks, bubble ``(p−1)/(v·m+p−1)``.

    Device ``d`` runs its ``u``-th forward at tick ``u + d``: microbatches in groups of
    ``p``, each group through the device's chunks ``k = 0 … v−1`` in turn (microbatch
    ``g·p + r`` of chunk ``k`` is its forward ``u = g·p·v + k·p + r``). The input of
    every forward but chunk 0's is the left neighbour's output of the tick before, so it
    arrives the very tick it is used: no buffers. ``v > 1`` needs ``m`` divisible by
    ``p`` (as the interleaved schedule does).
    """
    if v > 1 and m % p:
        raise LayoutError(f"a forward pass over {v} chunks per device runs microbatches in "
                          f"groups of mesh.stage={p}: {m} microbatches is not a multiple of {p}")
    ticks = m * v + p - 1
    u = np.arange(ticks)[:, None] - np.arange(p)[None, :]
    active = (u >= 0) & (u < m * v)
    group, rest = np.divmod(np.clip(u, 0, m * v - 1), p * v)
    chunk = np.where(active, rest // p, 0).astype(np.int32)
    mb = np.where(active, group * p + rest % p, 0).astype(np.int32)
    first, last = _chunk_ends(chunk, p, v)
    branch = np.select([~active, first, last], [IDLE, F_FIRST, F_LAST], F).astype(np.int32)
    return branch, chunk, mb


@dataclass(frozen=True)
class Parts:
    """The model's stage functions as pure functions of parameter trees and the model
    state of one microbatch (its RNG counts advanced to that microbatch's), in NNX's
    training mode or (``train`` False) its evaluation mode."""

    split: StageSplit
    graphdef: nnx.GraphDef
    train: bool = True

    def _model(self, rest: Any, chunk: Any, state: Any) -> nnx.Module:
        model = nnx.merge(self.graphdef, {**rest, self.split.layers_key: chunk}, state)
        model.train() if self.train else model.eval()
        return model

    def embed(self, rest, chunk, state, mb):
        return self.split.embed(self._model(rest, chunk, state), mb)

    def stage(self, chunk, rest, state, x, mb, first_layer):
        return self.split.stage(self._model(rest, chunk, state), x, mb, first_layer)

    def head(self, chunk, rest, state, x, mb):
        return self.split.head(self._model(rest, chunk, state), x, mb)


def branch_functions(parts: Parts, message, seed, no_dw, no_drest, no_aux):
    """The switch branches, keyed by ``IDLE … W_LAST``. Each takes (chunk params, other
    params, stashed input, incoming gradient, microbatch, (the microbatch's model state,
    the chunk's first layer)) and returns (send right, send left, d chunk, d other params,
    loss, metrics), zeros where it produces none. Chunk 0's branches recompute the
    embedding (a lookup) rather than read a stashed copy."""
    no_loss = jnp.zeros((), jnp.float32)

    def result(send_act=message, send_grad=message, dw=no_dw, drest=no_drest, loss=no_loss,
               aux=no_aux):
        cast = lambda x: x.astype(message.dtype)
        return cast(send_act), cast(send_grad), dw, drest, loss, aux

    def stage(w, r, x, mb, where):
        return parts.stage(w, r, where[0], x, mb, where[1])

    def embed(w, r, mb, where):
        return parts.embed(r, w, where[0], mb).astype(message.dtype)

    def loss_of(w, r, x, mb, where):
        loss, aux = parts.head(w, r, where[0], stage(w, r, x, mb, where), mb)
        return loss * seed, jax.tree.map(lambda a: a * seed, aux)

    def seed_of(loss, aux):
        return jnp.ones_like(loss), jax.tree.map(jnp.zeros_like, aux)

    def idle(w, r, x, dy, mb, where):
        return result()

    def forward(w, r, x, dy, mb, where):
        return result(send_act=stage(w, r, x, mb, where))

    def forward_first(w, r, x, dy, mb, where):
        return result(send_act=stage(w, r, embed(w, r, mb, where), mb, where))

    def backward(w, r, x, dy, mb, where):
        _, vjp = jax.vjp(lambda w, x: stage(w, r, x, mb, where), w, x)
        dw, dx = vjp(dy)
        return result(send_grad=dx, dw=dw)

    def backward_first(w, r, x, dy, mb, where):
        """Chunk 0: the stage's and the embedding's vector-Jacobian products in one."""
        _, vjp = jax.vjp(lambda w, r: stage(w, r, embed(w, r, mb, where), mb, where), w, r)
        dw, drest = vjp(dy)
        return result(dw=dw, drest=drest)

    def backward_last(w, r, x, dy, mb, where):
        (loss, aux), vjp = jax.vjp(lambda w, r, x: loss_of(w, r, x, mb, where), w, r, x)
        dw, drest, dx = vjp(seed_of(loss, aux))
        return result(send_grad=dx, dw=dw, drest=drest, loss=loss, aux=aux)

    def input_grad(w, r, x, dy, mb, where):
        _, vjp = jax.vjp(lambda x: stage(w, r, x, mb, where), x)
        (dx,) = vjp(dy)
        return result(send_grad=dx)

    def input_grad_first(w, r, x, dy, mb, where):
        _, vjp = jax.vjp(lambda r: stage(w, r, embed(w, r, mb, where), mb, where), r)
        return result(drest=vjp(dy)[0])

    def input_grad_last(w, r, x, dy, mb, where):
        (loss, aux), vjp = jax.vjp(lambda x: loss_of(w, r, x, mb, where), x)
        (dx,) = vjp(seed_of(loss, aux))
        return result(send_grad=dx, loss=loss, aux=aux)

    def weight_grad(w, r, x, dy, mb, where):
        _, vjp = jax.vjp(lambda w: stage(w, r, x, mb, where), w)
        return result(dw=vjp(dy)[0])

    def weight_grad_first(w, r, x, dy, mb, where):
        _, vjp = jax.vjp(lambda w: stage(w, r, embed(w, r, mb, where), mb, where), w)
        return result(dw=vjp(dy)[0])

    def weight_grad_last(w, r, x, dy, mb, where):
        (loss, aux), vjp = jax.vjp(lambda w, r: loss_of(w, r, x, mb, where), w, r)
        dw, drest = vjp(seed_of(loss, aux))
        return result(dw=dw, drest=drest)

    return {IDLE: idle, F: forward, F_FIRST: forward_first, B: backward,
            B_FIRST: backward_first, B_LAST: backward_last, I: input_grad,
            I_FIRST: input_grad_first, I_LAST: input_grad_last, W: weight_grad,
            W_FIRST: weight_grad_first, W_LAST: weight_grad_last}
