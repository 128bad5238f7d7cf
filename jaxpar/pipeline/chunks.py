"""The sub-mesh executor's programs per chunk, and one step's play of the tick table
(see :mod:`jaxpar.pipeline.mpmd`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.logical import BATCH, activation_rules, split_over
from jaxpar.pipeline.cut import LayerCut
from jaxpar.pipeline.views import (
    get_path,
    moved,
    put_path,
    view_of,
)
from jaxpar.task import (
    Batch,
    Layers,
    split_microbatches,
)


def chunk_program(ex: Any, kind: str, c: int) -> Callable:
    """Chunk ``c``'s jitted program ``kind``: ``F`` (forward: the activation it sends, its
    model state after, and with ``ex.residuals`` the backward's residuals and the last
    chunk's loss), ``B`` (backward: the gradient it sends, its gradient sums and the last
    chunk's loss — recomputed from the stashed input, or from the residuals), ``I`` / ``W``
    (the input and the weight halves of the backward, zero-bubble), ``eval`` (forward in
    evaluation mode), ``zeros`` (zeros placed as its parameters: a gradient sum's start).
    A backward takes what :func:`kept` stashed of its forward, then ``dy`` (and the sums)."""
    last = c == len(ex.cut.chunks) - 1
    mesh = ex.meshes[c % len(ex.meshes)]
    total = ex.layout.grad_accum * ex.layout.table.m
    seed = 1.0 / total  # each microbatch's loss (a mean) seeds the backward with 1/total

    def run(params, state, x, batch, j, train=True, count=total):
        with activation_rules(mesh, ex.layout.rules, ex.layout.context, ex.layout.tensor):
            mb = {
                k: jax.lax.dynamic_index_in_dim(split_microbatches(v, count), j, 0, False)
                for k, v in batch.items()
            }
            return ex.cut.forward(c, params, state, x, mb, j, train, last)

    def seeded(back, out, dy):
        if last:
            return back(_seed(out, seed))
        return back((dy, _seed(out[1], seed)) if isinstance(out, tuple) else dy)

    if kind == "eval":
        return jax.jit(lambda p, s, x, b, j: run(p, s, x, b, j, False, ex.layout.table.m)[0])
    if kind == "F" and ex.residuals:

        def forward_keeping(p, s, x, b, j):
            out, back, new_state = jax.vjp(lambda p, x: run(p, s, x, b, j), p, x, has_aux=True)
            send, counted = sent_and_counted(out, last)
            return send, new_state, back, out, counted

        return jax.jit(forward_keeping)
    if kind == "F":
        return jax.jit(lambda p, s, x, b, j: _forward_out(run(p, s, x, b, j), last))

    def grads(*args):  # (parameter and input gradients, the last chunk's loss or None)
        if ex.residuals:
            back, out, dy = args
            return seeded(back, out, dy), None
        p, s, x, b, j, dy = args
        out, back = jax.vjp(lambda p, x: run(p, s, x, b, j)[0], p, x)
        return seeded(back, out, dy), (out if last else None)

    placed = ex.param_shardings(c)
    if kind == "zeros":
        return jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=placed)

    def accumulate(acc, dp):  # a gradient sum placed as its parameters
        return jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, acc, dp), placed)

    n = 3 if ex.residuals else 6  # the backward's arguments before the sums
    if kind == "B":
        return jax.jit(lambda *a: _backward(grads(*a[:n]), a[n], accumulate), donate_argnums=n)
    if kind == "I":
        return jax.jit(lambda *a: _input_grad(grads(*a)))
    return jax.jit(lambda *a: accumulate(a[n], grads(*a[:n])[0][0]), donate_argnums=n)


def sent_and_counted(out: Any, last: bool) -> tuple[Any, Any]:
    """What a chunk's forward output sends on (the last chunk: nothing) and what it adds
    to the loss and metrics — the last chunk's (loss, metrics), another chunk's own loss
    term (see :attr:`~jaxpar.task.StageSplit.stage`), or None."""
    if last:
        return None, out
    return out if not isinstance(out, tuple) else out[0], (
        out[1] if isinstance(out, tuple) else None
    )


def kept(ex: Any, args: tuple, result: tuple) -> tuple[Any, Any, tuple, Any]:
    """A forward's activation to send, its model state after, what its backward reads
    (its residuals and output, or its arguments to recompute from) and the loss and
    metrics the forward adds (:func:`sent_and_counted`)."""
    if ex.residuals:
        y, new_state, back, out, counted = result
        return y, new_state, (back, out), counted
    y, new_state = result
    return y, new_state, args, None


def _seed(out: tuple, seed: float) -> tuple:
    loss, aux = out
    return jnp.full_like(loss, seed), jax.tree.map(jnp.zeros_like, aux)


def _forward_out(result: tuple, last: bool) -> tuple:
    """What a forward sends on (nothing from the last chunk; a chunk's own loss term too,
    counted by :meth:`Run._F`) and its model state after."""
    out, new_state = result
    return (None if last else out), new_state


def _backward(result: Any, acc: Any, accumulate: Callable) -> tuple:
    (dp, dx), out = result
    return dx, accumulate(acc, dp), out


def _input_grad(result: Any) -> tuple:
    (_, dx), out = result
    return dx, out


@dataclass(frozen=True)
class ByLayer:
    """A model given by its layers (``Task.layers``) cut into chunks of any shapes: a
    chunk's parameters and model state by layer index, each on its stage."""

    cut: LayerCut
    spec: Layers

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        return self.cut.chunks

    def chunk_tree(self, shares: Sequence[Any], c: int) -> dict:
        """Chunk ``c``'s variables of its stage's share (of the stages' ``shares``), by
        layer index."""
        share = shares[c % len(shares)]
        start, stop = self.cut.chunks[c]
        return {
            i: get_path(share, self.cut.layers[i].path)
            for i in range(start, stop)
            if self.cut.layers[i].path is not None
        }

    def forward(
        self, c: int, params: dict, state: dict, x: Any, mb: Batch, j: Any, train: bool, last: bool
    ) -> tuple[Any, dict]:
        """Chunk ``c``'s layers in order (the first reads the batch, the last gives the
        loss), and the model state each layer ends with (BatchNorm statistics, RNG counts)."""
        x = self.spec.input_of(mb) if c == 0 else x
        new_state = {}
        for idx in range(*self.cut.chunks[c]):
            layer = self.cut.layers[idx]
            if layer.graphdef is None:
                x = layer.fn(x)
                continue
            module = nnx.merge(layer.graphdef, params[idx], state.get(idx, {}))
            module.train() if train else module.eval()
            x = module(x)
            new_state[idx] = nnx.to_pure_dict(nnx.state(module, nnx.Not(nnx.Param)))
        return (self.spec.loss_of(x, mb) if last else x), new_state

    def moves(self, trees: Sequence[Any], p: int) -> list[tuple[int, int, Any]]:
        """The chunks run away from the stage that holds them: none (each layer runs on
        its stage)."""
        return []

    def copied(self, trees: Sequence[Any], p: int) -> list[tuple[int, Any]]:
        """The rows a stage copies for the step: none (its layers are its own)."""
        return []

    def collect(
        self, ex: Any, acc: list, states: list, model_state: Any, total: int
    ) -> tuple[Any, Any]:
        """The gradients and the model state as trees like the state's (each leaf on its
        stage)."""
        grads, model_state = {}, {}
        for c in range(len(self.cut.chunks)):
            for idx, tree in acc[c].items():
                put_path(grads, self.cut.layers[idx].path, tree)
            for idx, tree in states[c].items():
                if jax.tree.leaves(tree):
                    put_path(model_state, self.cut.layers[idx].path, tree)
        return _ordered(grads, ex.homes.params), _ordered(model_state, ex.homes.model_state)


class Run:
    """One step's play of the table: inboxes of activations and gradients between chunks,
    the stash of each chunk's inputs and model state, the gradient sums."""

    def __init__(self, ex: Any, params: Any, model_state: Any, batch: Batch, train: bool):
        self.ex = ex
        self.train = train
        p = len(ex.meshes)
        chunks = len(ex.cut.chunks)
        params = [ex.share(params, ex.homes.params, s) for s in range(p)]
        shares = [ex.share(model_state, ex.homes.model_state, s) for s in range(p)]
        self.batch = [{k: view_of(v, m) for k, v in batch.items()} for m in ex.meshes]
        self.params = [ex.cut.chunk_tree(params, c) for c in range(chunks)]
        self.state = [ex.cut.chunk_tree(shares, c) for c in range(chunks)]
        self.model_state = model_state
        self.acc = [ex.program("zeros", c)(self.params[c]) for c in range(chunks)] if train else []
        self.loss: Any = None
        self.aux: Any = None
        #: where the loss and metrics add up: the last chunk's stage
        self.home = NamedSharding(ex.meshes[(chunks - 1) % p], P())
        self.acts = {}
        self.grads = {}
        self.stash = {}
        self.dys = {}

    def _send(self, value: Any, c: int) -> Any:
        """``value`` moved to chunk ``c``'s stage, its rows split as the batch's."""
        mesh = self.ex.meshes[c % len(self.ex.meshes)]
        spec = _batch_spec(self.ex, mesh)
        return jax.tree.map(
            lambda v: moved(_laid_out(v, spec), mesh, P(spec, *[None] * (v.ndim - 1))), value
        )

    def play(self, r: int) -> None:
        """The table once: microbatches ``r·m … r·m + m − 1`` of the step."""
        table = self.ex.layout.table
        last = len(self.ex.cut.chunks) - 1
        for action in sorted(table.tick, key=table.tick.get):
            c = action.chunk
            mb = action.mb
            j = r * table.m + mb
            getattr(self, f"_{action.kind}")(c, mb, jnp.int32(j), c == last)

    def _F(self, c: int, mb: int, j: Any, last: bool) -> None:
        args = (
            self.params[c],
            self.state[c],
            self.acts.pop((c, mb), None),
            self.batch[c % len(self.ex.meshes)],
            j,
        )
        y, self.state[c], self.stash[(c, mb)], out = kept(
            self.ex, args, self.ex.program("F", c)(*args)
        )
        if not self.ex.residuals and not last:
            y, out = sent_and_counted(y, last)
        self._received(0, mb, None, out)
        if not last:
            self.acts[(c + 1, mb)] = self._send(y, c + 1)

    def _B(self, c: int, mb: int, j: Any, last: bool) -> None:
        dy = self.grads.pop((c, mb), None)
        dx, self.acc[c], out = self.ex.program("B", c)(*self.stash.pop((c, mb)), dy, self.acc[c])
        self._received(c, mb, dx, out)

    def _I(self, c: int, mb: int, j: Any, last: bool) -> None:
        dy = self.dys[(c, mb)] = self.grads.pop((c, mb), None)
        dx, out = self.ex.program("I", c)(*self.stash[(c, mb)], dy)
        self._received(c, mb, dx, out)

    def _W(self, c: int, mb: int, j: Any, last: bool) -> None:
        self.acc[c] = self.ex.program("W", c)(
            *self.stash.pop((c, mb)), self.dys.pop((c, mb)), self.acc[c]
        )

    def _received(self, c: int, mb: int, dx: Any, out: Any) -> None:
        if c > 0:
            self.grads[(c - 1, mb)] = self._send(dx, c - 1)
        if out is not None:  # a microbatch's loss and metrics (or a chunk's own term)
            out = jax.tree.map(lambda v: jax.device_put(v, self.home), out)
            self.loss = out[0] if self.loss is None else self.loss + out[0]
            self.aux = (
                out[1]
                if self.aux is None
                else {
                    k: self.aux[k] + out[1][k]
                    if k in self.aux and k in out[1]
                    else self.aux.get(k, out[1].get(k))
                    for k in {**self.aux, **out[1]}
                }
            )

    def results(self) -> tuple[jax.Array, dict, Any, Any]:
        """Mean loss and metrics, gradients and the model state, as trees like the
        parameters and the model state."""
        total = self.ex.layout.grad_accum * self.ex.layout.table.m
        grads, model_state = self.ex.cut.collect(
            self.ex, self.acc, self.state, self.model_state, total
        )
        return (self.loss / total, jax.tree.map(lambda a: a / total, self.aux), grads, model_state)

    def forward_only(self) -> tuple[jax.Array, dict]:
        m = self.ex.layout.table.m
        chunks = len(self.ex.cut.chunks)
        p = len(self.ex.meshes)
        for j in range(m):
            x = None
            for c in range(chunks):
                x = self.ex.program("eval", c)(
                    self.params[c], self.state[c], x, self.batch[c % p], jnp.int32(j)
                )
                if c < chunks - 1:
                    x, counted = sent_and_counted(x, False)
                    self._received(0, j, None, counted)
                    x = self._send(x, c + 1)
            self._received(0, j, None, x)
        return self.loss / m, jax.tree.map(lambda a: a / m, self.aux)


def _ordered(tree: dict, like: Any) -> Any:
    """``tree`` (nested dicts) with the key order of ``like`` (the state's pure dicts)."""
    if not isinstance(like, dict):
        return tree
    return {k: _ordered(tree[k], v) for k, v in like.items()}


def _laid_out(v: jax.Array, spec: Any) -> jax.Array:
    """``v`` with its rows split as ``spec`` on its own sub-mesh (as a program left it, or
    moved there)."""
    sharding = NamedSharding(v.sharding.mesh, P(spec, *[None] * (v.ndim - 1)))
    return v if v.sharding == sharding else jax.device_put(v, sharding)


def _batch_spec(ex: Any, mesh: Mesh) -> Any:
    """The mesh axes a batch's rows are split over on a stage's sub-mesh."""
    axes = split_over(ex.layout.rules, mesh.shape, BATCH)
    return axes[0] if len(axes) == 1 else (axes or None)
