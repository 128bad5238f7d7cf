"""Gradient strategies: how a train step turns a batch into loss, metrics and gradients.

A strategy is a small frozen object, chosen once by the :class:`~jaxpar.plan.Plan`
(:func:`jaxpar.plan.make_plan`), and called by the step with no branch on the layout:
``strategy(params, model_state, batch) -> (loss, metrics, grads, model_state)``; its
``evaluate(params, model_state, batch) -> (loss, metrics)`` runs the same layout in
evaluation mode.

* :class:`Plain` — one ``value_and_grad`` over the whole batch.
* :class:`Accumulated` — ``k`` microbatches in a ``lax.scan``, each through an inner
  strategy (plain or pipelined), gradients and metrics averaged; the model state
  (BatchNorm statistics, RNG counts) is carried from one microbatch to the next.
* :class:`AccumulatedPerDataShard` — the same under ``shard_map`` with ``data``
  manual: each data shard sums its microbatches locally and the sums are all-reduced
  once per step instead of once per microbatch.
* :class:`Pipelined` — the pipeline executor (``jaxpar/pipeline/executor.py``).

``model_state`` is the pure dict of the model's non-``Param`` variables; a strategy
returns its new value, and ``grads`` are taken with respect to ``params`` only — but for
:class:`jaxpar.state.FromGradient` variables (FP8 amax histories), which :class:`Plain`
differentiates too and whose gradient it returns as their next value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.axes import Axis
from jaxpar.buckets import psum_in_buckets
from jaxpar.context import degree as context_degree
from jaxpar.context import split_attention_calls
from jaxpar.errors import JaxparError, TaskError, UserCodeFailed, code_name, is_own
from jaxpar.logical import ACT_SEQ, split_over, stream_constraints
from jaxpar.pipeline.executor import advance_counts, pipeline_grads
from jaxpar.pipeline.forward import pipeline_eval
from jaxpar.pipeline.layout import Layout
from jaxpar.sharding import named
from jaxpar.state import FromGradient, TrainState
from jaxpar.task import (
    Batch,
    LossFn,
    StageSplit,
    checked_loss,
    loss_weights,
    split_microbatches,
)
from jaxpar.tensor_parallel import compiler_options


class Strategy(Protocol):
    """What the trainer builds its programs from (see the module docstring)."""

    def __call__(
        self, params: Any, model_state: Any, batch: Batch
    ) -> tuple[jax.Array, dict, Any, Any]: ...

    def evaluate(self, params: Any, model_state: Any, batch: Batch) -> tuple[jax.Array, dict]: ...

    def build_step(self, update: Any, shardings: TrainState) -> Callable: ...

    def build_eval(self, shardings: TrainState) -> Callable: ...

    def build_grads(self, shardings: TrainState) -> Callable: ...

    def build_init(self, create: Callable[[], TrainState], shardings: TrainState) -> Callable: ...


class Traced:
    """A strategy that runs inside one jitted program over the whole mesh — every one
    here: the train step is ``update`` composed with its loss and gradients, in one
    ``jit`` whose in/out shardings are the state's (the state donated). Each program
    first weighs a ``loss_mask`` over the whole batch (:func:`jaxpar.task.loss_weights`),
    before the strategy splits it."""

    def build_step(self, update: Any, shardings: TrainState) -> Callable:
        """``(state, batch) -> (state, metrics)``: ``update`` (:class:`jaxpar.update.Update`)
        after this strategy's loss and gradients."""
        return jax.jit(
            lambda s, b: update(s, *self(s.params, s.model_state, loss_weights(b))),
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
            donate_argnums=0,
            compiler_options=compiler_options(self.layout.tensor),
        )

    def build_eval(self, shardings: TrainState) -> Callable:
        """``(params, model_state, batch) -> {"loss": …, **metrics}`` in evaluation mode."""

        def evaluate(params, model_state, batch):
            loss, aux = self.evaluate(params, model_state, loss_weights(batch))
            return {"loss": loss, **aux}

        return jax.jit(evaluate, in_shardings=(shardings.params, shardings.model_state, None))

    def build_grads(self, shardings: TrainState) -> Callable:
        """``(params, batch, model_state) -> (loss, metrics, grads)`` as the step has them."""
        return jax.jit(
            lambda p, b, s: self(p, s, loss_weights(b))[:3],
            in_shardings=(shardings.params, None, shardings.model_state),
        )

    def build_init(self, create: Callable[[], TrainState], shardings: TrainState) -> Callable:
        """``() -> state``, born sharded."""
        return jax.jit(create, out_shardings=shardings)


@dataclass(frozen=True)
class ModelLoss:
    """The task's loss of the model given as its graph and pure-dict variables."""

    graphdef: nnx.GraphDef
    loss_fn: LossFn

    def __call__(
        self, params: Any, model_state: Any, batch: Batch, *, train: bool, layout: Layout
    ) -> tuple[jax.Array, dict, Any]:
        """Loss, metrics and the model's new state (traceable).

        The model runs in NNX's training mode (``model.train()``: dropout on, BatchNorm on
        batch statistics, updating its running averages) or evaluation mode
        (``model.eval()``), with the activation rules (and context settings) of ``layout``.
        """
        batch = loss_weights(batch)  # a whole batch (the programs weigh theirs first)
        model = nnx.merge(self.graphdef, params, model_state)
        model.train() if train else model.eval()
        with layout.activation_rules():
            before = split_attention_calls()
            streams = stream_constraints()
            loss, metrics = _checked(_call_loss(self.loss_fn, model, batch), self.loss_fn)
            _attended(before, self.loss_fn, self.graphdef)
            what = f"loss_fn ({code_name(self.loss_fn)})"
            _named_stream(streams, what, layout, self.graphdef)
        return loss, metrics, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def _call_loss(loss_fn: LossFn, model: Any, batch: Batch) -> Any:
    """``loss_fn(model, batch)``; an exception of the user's loss names it."""
    if is_own(loss_fn):
        return loss_fn(model, batch)
    try:
        return loss_fn(model, batch)
    except JaxparError:
        raise
    except Exception as err:
        raise UserCodeFailed(f"loss_fn ({code_name(loss_fn)})", err) from err


def _checked(out: Any, loss_fn: LossFn) -> tuple[jax.Array, dict]:
    return checked_loss(out, f"loss_fn ({code_name(loss_fn)})")


#: the (check, code, model) whose trace has been seen to do what the check asks: a later
#: trace of the same code and model may run no Python where JAX serves a ``lax.scan`` or
#: ``jax.checkpoint`` body of a module-level function from its trace cache (measured), so
#: a count that did not move then is no evidence
_SEEN: set[tuple[str, str, nnx.GraphDef]] = set()


def _seen(check: str, what: str, graphdef: nnx.GraphDef, moved: bool) -> bool:
    """Whether ``what`` running the model ``graphdef`` does what ``check`` asks: in this
    trace (``moved``) or an earlier one."""
    if moved:
        _SEEN.add((check, what, graphdef))
    return (check, what, graphdef) in _SEEN


def _attended(before: int, loss_fn: LossFn, graphdef: nnx.GraphDef) -> None:
    """Refuses a loss whose attention never ran across a split sequence (see
    ``jaxpar.context.split_attention_calls``): plain attention would read each device's
    shard, or the balanced order, as the whole sequence in order — a wrong loss.

    Raises:
      TaskError: naming the loss function and the fix.
    """
    ways = context_degree()
    what = code_name(loss_fn)
    if ways > 1 and not _seen("attend", what, graphdef, split_attention_calls() > before):
        raise TaskError(
            f"loss_fn ({code_name(loss_fn)}) ran with each sequence split over {ways} "
            "devices (mesh.context), but its model never called jaxpar.attend, so its "
            "attention would not see the whole sequence in order; compute attention with "
            "jaxpar.attend(q, k, v, positions) (docs/context.md; or call "
            "jaxpar.context.masks_by_position() where it masks by position), or set "
            "mesh.context=1"
        )


def _named_stream(before: int, what: str, layout: Layout, graphdef: nnx.GraphDef) -> None:
    """Refuses a model that never named its residual stream ``act_seq`` (see
    ``jaxpar.logical.stream_constraints``) when the layout splits ``act_seq`` over
    ``tensor`` (sequence parallelism): the split would change nothing, silently.
    ``what``: the user's function that ran the model, as messages name it.

    Raises:
      TaskError: naming ``what`` and the fix.
    """
    if Axis.TENSOR not in split_over(layout.rules, layout.mesh.shape, ACT_SEQ):
        return
    if _seen("act_seq", what, graphdef, stream_constraints() > before):
        return
    key, off = (
        ("tensor.sequence=true", "set tensor.sequence=false")
        if layout.tensor.sequence
        else ("rules.act_seq names tensor", "drop tensor from rules.act_seq")
    )
    raise TaskError(
        f"{what} ran with sequence parallelism ({key}, mesh.tensor="
        f"{layout.mesh.shape[Axis.TENSOR]}), but its model never constrained an activation "
        "with the logical axis act_seq, so nothing would be split; name its residual stream "
        'with jaxpar.constrain(x, ("batch", "act_seq", "act_embed")) (docs/concepts.md, '
        f"Sequence parallelism), or {off}"
    )


@dataclass(frozen=True)
class Plain(Traced):
    """One ``value_and_grad`` of the loss over the whole batch."""

    loss: ModelLoss
    layout: Layout

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        over = from_gradient(self.loss.graphdef, params, model_state)

        def value(p, o):
            loss, metrics, new_state = self.loss(
                p, _replaced(model_state, o), batch, train=True, layout=self.layout
            )
            return loss, (metrics, new_state)

        grad = jax.value_and_grad(value, argnums=(0, 1), has_aux=True)
        (loss, (metrics, new_state)), (grads, new_over) = grad(params, over)
        return loss, metrics, grads, _replaced(new_state, _read(over, new_over))

    def evaluate(self, params: Any, model_state: Any, batch: Batch):
        loss, metrics, _ = self.loss(params, model_state, batch, train=False, layout=self.layout)
        return loss, metrics


def from_gradient(graphdef: nnx.GraphDef, params: Any, model_state: Any) -> Any:
    """The part of ``model_state`` (a pure dict) whose next value is its gradient
    (:class:`jaxpar.state.FromGradient` variables: FP8 amax histories), as a pure dict."""
    model = nnx.merge(graphdef, params, model_state)
    return nnx.to_pure_dict(nnx.state(model, FromGradient))


def _replaced(state: Any, part: Any) -> Any:
    """The pure dict ``state`` with the leaves ``part`` holds replaced by ``part``'s."""
    if not isinstance(part, dict):
        return part
    return {k: _replaced(v, part[k]) if k in part else v for k, v in state.items()}


def _read(old: Any, new: Any) -> Any:
    """``new`` where the forward pass read the variable (a nonzero cotangent: an update
    always holds a positive scale), else ``old``: an unread one keeps its value."""
    return jax.tree.map(lambda o, n: jnp.where(jnp.any(n != 0), n, o), old, new)


@dataclass(frozen=True)
class Accumulated(Traced):
    """The mean over ``k`` microbatches of ``inner`` (a ``lax.scan``).

    Microbatch ``i`` is rows ``i, i+k, …`` of the batch, so each device's rows stay on
    that device; an ``inner`` that runs ``per_call`` microbatches itself (a pipeline) gets
    the rows that make its j-th microbatch of call i the (i·per_call + j)-th of one
    device's k·per_call (:func:`jaxpar.task.split_microbatches`), whose RNG count it
    draws with. ``grad_shardings`` pins the gradient carry to the parameters' sharding,
    so under FSDP each device accumulates its shard only. ``gathered_shardings``
    (``train.fsdp_gather=once``): the parameters are resharded to these (the FSDP
    shardings without their batch axes) before the loop, so their all-gathers run once per
    step and the whole weights stay on every device through the loop; without it each
    microbatch gathers them again (and frees them: less memory).
    """

    inner: Strategy
    k: int
    grad_shardings: Any = None
    gathered_shardings: Any = None
    per_call: int = 1

    @property
    def layout(self) -> Layout:
        """The layout of the strategy it accumulates."""
        return self.inner.layout

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        if self.gathered_shardings is not None:
            params = jax.lax.with_sharding_constraint(params, self.gathered_shardings)
        micro = {key: split_microbatches(v, self.k, self.per_call) for key, v in batch.items()}
        first = {key: v[0] for key, v in micro.items()}
        shapes = jax.eval_shape(self.inner, params, model_state, first)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[:3])

        def body(carry, mb):
            sums, state = carry
            loss, metrics, grads, state = self.inner(params, state, mb)
            if self.grad_shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
            return (jax.tree.map(jnp.add, sums, (loss, metrics, grads)), state), None

        (sums, state), _ = jax.lax.scan(body, (zeros, model_state), micro)
        loss, metrics, grads = jax.tree.map(lambda x: x / self.k, sums)
        return loss, metrics, grads, state

    def evaluate(self, params: Any, model_state: Any, batch: Batch):
        return self.inner.evaluate(params, model_state, batch)


@dataclass(frozen=True)
class AccumulatedPerDataShard(Traced):
    """Gradients reduced over ``data`` once per step, by the step itself.

    Under ``shard_map`` with ``data`` manual (``fsdp``/``tensor`` stay automatic, so
    FSDP still gathers weights and reduce-scatters gradients per microbatch), each data
    shard sums its ``layout.grad_accum`` (≥ 1) microbatches' gradients locally and the
    sums are all-reduced once, in buckets of ``bucket_bytes`` (:mod:`jaxpar.buckets`; 0:
    one collective per array). With accumulation the automatic path would all-reduce every
    microbatch's gradients: the accumulator is replicated over ``data``, and a partial sum
    cannot be carried through the loop; without it, XLA reduces each array apart, inside
    the layer scan. Only for models whose state is RNG streams at most (every shard
    advances their counts alike: dropout keyed by example draws as on one device):
    BatchNorm statistics would become per-shard ones. ``gathered_specs``: the parameters'
    specs without their batch axes, for ``train.fsdp_gather=once`` (None: gathered per
    microbatch).
    """

    loss: ModelLoss
    layout: Layout
    gathered_specs: Any = None
    bucket_bytes: int = 0

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        n = self.layout.mesh.shape[Axis.DATA]

        def local(params, model_state, batch):
            loss, metrics, grads, state = self._local_step()(params, model_state, batch)
            summed = psum_in_buckets((loss, metrics, grads), Axis.DATA, self.bucket_bytes)
            return jax.tree.map(lambda x: x / n, summed), state  # the counts: alike

        fn = jax.shard_map(
            local,
            mesh=self.layout.mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(Axis.DATA)),
            out_specs=PartitionSpec(),
            axis_names={Axis.DATA},
            check_vma=False,
        )
        (loss, metrics, grads), model_state = fn(params, model_state, dict(batch))
        return loss, metrics, grads, model_state

    def _local_step(self) -> Strategy:
        """One data shard's loss and gradients, unreduced over ``data``."""
        inner = self.layout.manual((Axis.DATA,))
        if self.layout.grad_accum == 1:
            return Plain(self.loss, inner)
        gathered = self.gathered_specs
        return Accumulated(
            Plain(self.loss, inner),
            self.layout.grad_accum,
            named(inner.mesh, self.layout.param_specs),
            named(inner.mesh, gathered) if gathered is not None else None,
        )

    def evaluate(self, params: Any, model_state: Any, batch: Batch):
        return Plain(self.loss, self.layout).evaluate(params, model_state, batch)


@dataclass(frozen=True)
class Pipelined(Traced):
    """Loss and gradients through the pipeline executor, on ``layout.table``. The model's
    state may hold RNG streams only; ``rng_counts`` marks their counts, which advance by
    one per microbatch."""

    split: StageSplit
    graphdef: nnx.GraphDef
    layout: Layout
    rng_counts: Any = None

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        with self.layout.activation_rules():
            streams = stream_constraints()
            loss, metrics, grads = pipeline_grads(
                self.split,
                self.graphdef,
                params,
                batch,
                self.layout,
                model_state=model_state,
                rng_counts=self.rng_counts,
            )
            what = f"the stages ({code_name(self.split.stage)})"
            _named_stream(streams, what, self.layout, self.graphdef)
        counts = self.rng_counts or jax.tree.map(lambda _: False, model_state)
        return loss, metrics, grads, advance_counts(model_state, counts, self.layout.table.m)

    def evaluate(self, params: Any, model_state: Any, batch: Batch) -> tuple[jax.Array, dict]:
        """Loss and metrics in evaluation mode through the stages (forward only, the
        table's ``m`` microbatches): no device holds the whole model."""
        with self.layout.activation_rules():
            streams = stream_constraints()
            out = pipeline_eval(
                self.split, self.graphdef, params, batch, self.layout, model_state=model_state
            )
            what = f"the stages ({code_name(self.split.stage)})"
            _named_stream(streams, what, self.layout, self.graphdef)
        return out
