"""Gradient strategies: how a train step turns a batch into loss, metrics and gradients.

A strategy is a callable ``(params, model_state, batch) -> (loss, metrics, grads,
model_state)``; the trainer picks one when it is built (:func:`choose`) and the step
composes it with the optimizer, with no branch on the layout inside the step:

* :class:`Plain` — one ``value_and_grad`` over the whole batch.
* :class:`Accumulated` — ``k`` microbatches in a ``lax.scan``, each through an inner
  strategy (plain or pipelined), gradients and metrics averaged; the model state
  (BatchNorm statistics, RNG counts) is carried from one microbatch to the next.
* :class:`AccumulatedPerDataShard` — the same under ``shard_map`` with ``data``
  manual: each data shard sums its microbatches locally and the sums are all-reduced
  once per step instead of once per microbatch.
* :class:`Pipelined` — the pipeline executor (``jaxpar/pipeline/executor.py``).

``model_state`` is the pure dict of the model's non-``Param`` variables; a loss
function returns its new value, and ``grads`` are taken with respect to ``params`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.logical import Rules, activation_rules
from jaxpar.pipeline.executor import advance_counts, pipeline_eval, pipeline_grads
from jaxpar.pipeline.schedule import TickTable
from jaxpar.task import Batch, StageSplit, split_microbatches

#: ``(params, model_state, batch) -> (loss, metrics, new model_state)``
StateLoss = Callable[[Any, Any, Batch], tuple[jax.Array, dict, Any]]
#: ``(params, model_state, batch) -> (loss, metrics, grads, new model_state)``
Strategy = Callable[[Any, Any, Batch], tuple[jax.Array, dict, Any, Any]]


@dataclass(frozen=True)
class Plain:
    """One ``value_and_grad`` of ``loss`` over the whole batch."""

    loss: StateLoss

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        def value(p):
            loss, metrics, new_state = self.loss(p, model_state, batch)
            return loss, (metrics, new_state)

        (loss, (metrics, new_state)), grads = jax.value_and_grad(value, has_aux=True)(params)
        return loss, metrics, grads, new_state


@dataclass(frozen=True)
class Accumulated:
    """The mean over ``k`` microbatches of ``inner`` (a ``lax.scan``).

    Microbatch ``i`` is rows ``i, i+k, …`` of the batch, so each device's rows stay on
    that device. ``grad_shardings`` pins the gradient carry to the parameters' sharding,
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

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        if self.gathered_shardings is not None:
            params = jax.lax.with_sharding_constraint(params, self.gathered_shardings)
        micro = {key: split_microbatches(v, self.k) for key, v in batch.items()}
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


@dataclass(frozen=True)
class AccumulatedPerDataShard:
    """Gradient accumulation with one all-reduce over ``data`` per step.

    Under ``shard_map`` with ``data`` manual (``fsdp``/``tensor`` stay automatic, so
    FSDP still gathers weights and reduce-scatters gradients per microbatch), each data
    shard sums its microbatches' gradients locally and the sums are all-reduced once.
    The automatic path would all-reduce every microbatch's gradients: the accumulator is
    replicated over ``data``, and a partial sum cannot be carried through the loop.
    Only for models without state: BatchNorm statistics would become per-shard ones.
    """

    make_loss: Callable[[Any, Rules], StateLoss]
    k: int
    mesh: Mesh
    rules: Rules
    param_specs: Any
    gather_once: bool = False

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        n = self.mesh.shape["data"]
        inner = {name: tuple(a for a in axes if a != "data") for name, axes in self.rules.items()}

        def local(params, model_state, batch):
            mesh = jax.sharding.get_abstract_mesh()
            gathered = shd.named(mesh, gathered_specs(self.param_specs)) \
                if self.gather_once else None
            acc = Accumulated(Plain(self.make_loss(mesh, inner)), self.k,
                              shd.named(mesh, self.param_specs), gathered)
            loss, metrics, grads, _ = acc(params, model_state, batch)
            loss, metrics, grads = jax.tree.map(lambda x: jax.lax.psum(x, "data") / n,
                                                (loss, metrics, grads))
            return loss, metrics, grads

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec("data")),
                           out_specs=PartitionSpec(), axis_names={"data"}, check_vma=False)
        loss, metrics, grads = fn(params, model_state, dict(batch))
        return loss, metrics, grads, model_state


@dataclass(frozen=True)
class Pipelined:
    """Loss and gradients through the pipeline executor. The model's state may hold RNG
    streams only; ``rng_counts`` marks their counts, which advance by one per microbatch."""

    split: StageSplit
    graphdef: nnx.GraphDef
    table: TickTable
    mesh: Mesh
    rules: Rules
    param_specs: Any
    rng_counts: Any = None

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        with activation_rules(self.mesh, self.rules):
            loss, metrics, grads = pipeline_grads(
                self.split, self.graphdef, params, batch, table=self.table, mesh=self.mesh,
                rules=self.rules, param_specs=self.param_specs, model_state=model_state,
                rng_counts=self.rng_counts)
        counts = self.rng_counts or jax.tree.map(lambda _: False, model_state)
        return loss, metrics, grads, advance_counts(model_state, counts, self.table.m)

    def evaluate(self, params: Any, model_state: Any, batch: Batch) -> tuple[jax.Array, dict]:
        """Loss and metrics in evaluation mode through the stages (forward only, the
        table's ``m`` microbatches): no device holds the whole model."""
        t = self.table
        with activation_rules(self.mesh, self.rules):
            return pipeline_eval(self.split, self.graphdef, params, batch, p=t.p, m=t.m,
                                 v=t.v, mesh=self.mesh, rules=self.rules,
                                 model_state=model_state)


def per_data_shard_possible(mesh: Mesh, param_specs: Any, stateful: bool) -> bool:
    """Whether :class:`AccumulatedPerDataShard` applies: a data axis, no parameter sharded
    over it, a model without state, and not ``fsdp`` × ``tensor`` together (there XLA
    0.10's SPMD partitioner aborts on the partly manual program: a failed check in
    spmd_partitioner_util.cc)."""
    if mesh.shape["data"] == 1 or stateful:
        return False
    if mesh.shape["fsdp"] > 1 and mesh.shape["tensor"] > 1:
        return False
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return not any("data" in (e if isinstance(e, tuple) else (e,)) for s in specs for e in s if e)


BATCH_AXES = ("data", "fsdp")


def gathered_specs(param_specs: Any) -> Any:
    """The parameters' specs without the batch axes (``data``, ``fsdp``): FSDP-sharded
    parameters gathered, tensor and stage splits kept."""
    def drop(spec: PartitionSpec) -> PartitionSpec:
        entries = []
        for e in spec:
            kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a and
                         a not in BATCH_AXES)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return PartitionSpec(*entries)

    return jax.tree.map(drop, param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def gathers_weights(param_specs: Any) -> bool:
    """Whether any parameter is sharded over a batch axis (and so gathered before use)."""
    return gathered_specs(param_specs) != param_specs


def choose(*, make_loss: Callable[[Any, Rules], StateLoss], mesh: Mesh, rules: Rules,
           param_specs: Any, param_shardings: Any, grad_accum: int, stateful: bool,
           pipeline: Pipelined | None, fsdp_gather: str = "per_microbatch") -> Strategy:
    """The strategy for a layout: the pipeline or a plain step, accumulated over
    ``grad_accum`` microbatches when it is above 1 (locally per data shard when possible);
    ``fsdp_gather`` (``per_microbatch`` or ``once``) says when the accumulation gathers
    FSDP-sharded weights."""
    inner: Strategy = pipeline or Plain(make_loss(mesh, rules))
    if grad_accum == 1:
        return inner
    once = fsdp_gather == "once" and gathers_weights(param_specs)
    if pipeline is None and per_data_shard_possible(mesh, param_specs, stateful):
        return AccumulatedPerDataShard(make_loss, grad_accum, mesh, rules, param_specs, once)
    gathered = shd.named(mesh, gathered_specs(param_specs)) if once else None
    return Accumulated(inner, grad_accum, param_shardings, gathered)

