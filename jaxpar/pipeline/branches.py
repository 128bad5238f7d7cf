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
from jaxpar.task import StageSplit, checked_head, stage_output

# lax.switch branches. The forward of the last chunk is folded into its backward (which
# recomputes it with the head), so it is idle in training. Chunk 0 has branches of its own:
# the embedding runs there and nowhere else (its backward recomputes the embedding, a
# lookup, instead of stashing it). The forward-only evaluation table
# (:func:`forward_table`) uses F_FIRST, F and F_LAST.
IDLE = 0
F = 1
F_FIRST = 2
F_LAST = 3
B = 4
B_FIRST = 5
B_LAST = 6
I = 7  # noqa: E741 (the schedule's letter for an input-gradient action, beside F, B and W)
I_FIRST = 8
I_LAST = 9
W = 10
W_FIRST = 11
W_LAST = 12
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
    for k, mid, start, end in (
        ("F", F, F_FIRST, IDLE),
        ("B", B, B_FIRST, B_LAST),
        ("I", I, I_FIRST, I_LAST),
        ("W", W, W_FIRST, W_LAST),
    ):
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
        raise LayoutError(
            f"a forward pass over {v} chunks per device runs microbatches in "
            f"groups of mesh.stage={p}: {m} microbatches is not a multiple of {p}"
        )
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
        """(x, the chunk's loss term, its metrics): see :attr:`StageSplit.stage`."""
        return stage_output(self.split.stage(self._model(rest, chunk, state), x, mb, first_layer))

    def head(self, chunk, rest, state, x, mb):
        return checked_head(self.split, self.split.head(self._model(rest, chunk, state), x, mb))


def merged(template: dict, *metrics: dict) -> dict:
    """Metrics dicts summed key by key into the keys of ``template`` (zeros where none
    gives one): every branch returns the same structure."""
    out = dict(template)
    for given in metrics:
        for k, v in given.items():
            out[k] = out[k] + v.astype(out[k].dtype)
    return out


def zeros_like(tree: Any) -> Any:
    """Zeros of the shapes and dtypes of ``tree``'s leaves (arrays or shape structs)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def branch_functions(
    parts: Parts, message: Any, seed: Any, dw_like: Any, drest_like: Any, no_aux: Any
) -> dict[int, Any]:
    """The switch branches, keyed by ``IDLE … W_LAST``. Each takes (chunk params, other
    params, stashed input, incoming gradient, microbatch, (the microbatch's model state,
    the chunk's first layer)) and returns (send right, send left, d chunk, d other params,
    loss, metrics), zeros where it produces none. A branch makes its zero gradients itself
    (shaped as ``dw_like``, ``drest_like``): zeros captured from outside the scan would
    stay live through the whole loop, beside the gradient sums, and XLA would copy the
    sums' initial zeros rather than update them in place (a 4-layer stage of a tiny GPT
    held 2.8 MiB more). Chunk 0's branches recompute the
    embedding (a lookup) rather than read a stashed copy. A chunk's own loss term (see
    :attr:`StageSplit.stage`) is counted by its forward (the last chunk's: by the branch
    its forward is folded into) and seeds its backward."""
    b = _Branches(
        parts,
        message,
        seed,
        (message, message, dw_like, drest_like, jnp.zeros((), jnp.float32), no_aux),
    )
    return {
        IDLE: b.idle,
        F: b.forward,
        F_FIRST: b.forward_first,
        B: b.backward,
        B_FIRST: b.backward_first,
        B_LAST: b.backward_last,
        I: b.input_grad,
        I_FIRST: b.input_grad_first,
        I_LAST: b.input_grad_last,
        W: b.weight_grad,
        W_FIRST: b.weight_grad_first,
        W_LAST: b.weight_grad_last,
    }


#: what :meth:`_Branches.result` makes where a branch gives none (the others it is given)
_MADE = ("dw", "drest")


@dataclass(frozen=True)
class _Branches:
    """The branch functions of :func:`branch_functions` (``w`` the chunk's parameters,
    ``r`` the others, ``x`` the stashed input, ``dy`` the incoming gradient, ``mb`` the
    microbatch, ``where`` its model state and the chunk's first layer)."""

    parts: Parts
    message: Any
    seed: Any
    #: what a branch sends right and left, its d chunk and d others (shapes: made where
    #: returned), loss and metrics, where it produces none
    zeros: tuple

    def result(self, **given: Any) -> tuple:
        names = ("send_act", "send_grad", "dw", "drest", "loss", "aux")
        out = [
            given[n] if n in given else zeros_like(z) if n in _MADE else z
            for n, z in zip(names, self.zeros)
        ]
        out[0], out[1] = (x.astype(self.message.dtype) for x in out[:2])
        out[5] = merged(self.zeros[5], given.get("aux", {}))
        return tuple(out)

    def stage(self, w, r, x, mb, where):
        """(x, the chunk's loss term and metrics, scaled as the loss is)."""
        y, loss, aux = self.parts.stage(w, r, where[0], x, mb, where[1])
        return y, loss * self.seed, jax.tree.map(lambda a: a * self.seed, aux)

    def embed(self, w, r, mb, where):
        return self.parts.embed(r, w, where[0], mb).astype(self.message.dtype)

    def first(self, w, r, mb, where):
        return self.stage(w, r, self.embed(w, r, mb, where), mb, where)

    def loss_of(self, w, r, x, mb, where):
        y, stage_loss, stage_aux = self.stage(w, r, x, mb, where)
        loss, aux = self.parts.head(w, r, where[0], y, mb)
        return loss * self.seed + stage_loss, merged(
            self.zeros[5], jax.tree.map(lambda a: a * self.seed, aux), stage_aux
        )

    @staticmethod
    def seed_of(loss, aux):
        return jnp.ones_like(loss), jax.tree.map(jnp.zeros_like, aux)

    @staticmethod
    def seeded(out, dy):
        """The cotangent of a chunk's (x, loss term, metrics): ``dy``, and its loss seeded."""
        y, loss, aux = out
        return dy.astype(y.dtype), jnp.ones_like(loss), jax.tree.map(jnp.zeros_like, aux)

    def idle(self, w, r, x, dy, mb, where):
        return self.result()

    def forward(self, w, r, x, dy, mb, where):
        y, loss, aux = self.stage(w, r, x, mb, where)
        return self.result(send_act=y, loss=loss, aux=aux)

    def forward_first(self, w, r, x, dy, mb, where):
        y, loss, aux = self.first(w, r, mb, where)
        return self.result(send_act=y, loss=loss, aux=aux)

    def backward(self, w, r, x, dy, mb, where):
        out, vjp = jax.vjp(lambda w, x: self.stage(w, r, x, mb, where), w, x)
        dw, dx = vjp(self.seeded(out, dy))
        return self.result(send_grad=dx, dw=dw)

    def backward_first(self, w, r, x, dy, mb, where):
        """Chunk 0: the stage's and the embedding's vector-Jacobian products in one."""
        out, vjp = jax.vjp(lambda w, r: self.first(w, r, mb, where), w, r)
        dw, drest = vjp(self.seeded(out, dy))
        return self.result(dw=dw, drest=drest)

    def backward_last(self, w, r, x, dy, mb, where):
        (loss, aux), vjp = jax.vjp(lambda w, r, x: self.loss_of(w, r, x, mb, where), w, r, x)
        dw, drest, dx = vjp(self.seed_of(loss, aux))
        return self.result(send_grad=dx, dw=dw, drest=drest, loss=loss, aux=aux)

    def input_grad(self, w, r, x, dy, mb, where):
        out, vjp = jax.vjp(lambda x: self.stage(w, r, x, mb, where), x)
        (dx,) = vjp(self.seeded(out, dy))
        return self.result(send_grad=dx)

    def input_grad_first(self, w, r, x, dy, mb, where):
        out, vjp = jax.vjp(lambda r: self.first(w, r, mb, where), r)
        return self.result(drest=vjp(self.seeded(out, dy))[0])

    def input_grad_last(self, w, r, x, dy, mb, where):
        (loss, aux), vjp = jax.vjp(lambda x: self.loss_of(w, r, x, mb, where), x)
        (dx,) = vjp(self.seed_of(loss, aux))
        return self.result(send_grad=dx, loss=loss, aux=aux)

    def weight_grad(self, w, r, x, dy, mb, where):
        out, vjp = jax.vjp(lambda w: self.stage(w, r, x, mb, where), w)
        return self.result(dw=vjp(self.seeded(out, dy))[0])

    def weight_grad_first(self, w, r, x, dy, mb, where):
        out, vjp = jax.vjp(lambda w: self.first(w, r, mb, where), w)
        return self.result(dw=vjp(self.seeded(out, dy))[0])

    def weight_grad_last(self, w, r, x, dy, mb, where):
        (loss, aux), vjp = jax.vjp(lambda w, r: self.loss_of(w, r, x, mb, where), w, r)
        dw, drest = vjp(self.seed_of(loss, aux))
        return self.result(dw=dw, drest=drest)
