"""The sharded train state and the jitted train and eval steps.

One init path: ``nnx.eval_shape`` gives the abstract model, the rules give
every parameter and optimizer-state leaf a ``NamedSharding``, and
``jit(init, out_shardings=...)`` creates the state already sharded, so no
parameter is ever whole on one device. The same shardings are the step's
``in_shardings``/``out_shardings`` (the state is donated).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.config import PipelineConfig
from jaxpar.logical import Rules, activation_rules, spec_for
from jaxpar.pipeline.executor import pipeline_grads
from jaxpar.pipeline.schedule import TickTable, tick_table
from jaxpar.task import Batch, Task, split_microbatches


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step updates. ``skipped`` counts non-finite steps not applied."""

    step: jax.Array
    params: Any
    opt_state: Any
    skipped: jax.Array


def abstract_model(task: Task, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and abstract (shape-only) state of the task's model."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: task.model_fn(nnx.Rngs(seed))))
    return graphdef, state


def abstract_params_and_axes(task: Task, seed: int = 0) -> tuple[Any, Any]:
    """Abstract parameters and their logical axes, both as pure dicts."""
    return _params_and_axes(abstract_model(task, seed)[1], task)


def _params_and_axes(state: nnx.State, task: Task) -> tuple[Any, Any]:
    _params_only(state)
    return nnx.to_pure_dict(state), shd.logical_axes(state, task.path_rules)[0]


def _params_only(state: nnx.State) -> None:
    """jaxpar trains modules whose variables are all ``nnx.Param``."""
    others = [shd.path_str(p) for p, v in jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)) if not isinstance(v, nnx.Param)]
    if others:
        raise ValueError(f"model has non-Param variables {others}; jaxpar trains nnx.Param only")


def global_batch_shapes(host_batch: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """The global shapes of a batch of which this process holds ``host_batch``: each of the
    ``jax.process_count()`` processes loads an equal share of the rows."""
    count = jax.process_count()
    return {k: jax.ShapeDtypeStruct((v.shape[0] * count, *v.shape[1:]), v.dtype)
            for k, v in host_batch.items()}


def _accumulate(grad_fn: Callable, params: Any, batch: Batch, k: int,
                param_shardings: Any) -> tuple[jax.Array, dict, Any]:
    """Sums of loss, metrics and gradients over ``k`` microbatches of ``batch`` (a scan;
    the gradient carry keeps the parameters' sharding, so FSDP accumulates shards)."""
    micro = {key: split_microbatches(v, k) for key, v in batch.items()}

    def body(carry, mb):
        (loss, aux), grads = grad_fn(params, mb)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

    first = {key: v[0] for key, v in micro.items()}
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        lambda p, b: (*grad_fn(p, b)[0], p), params, first))
    return jax.lax.scan(body, zeros, micro)[0]


class Trainer:
    """Sharded state, train step and eval step for a task on a mesh.

    Args:
      task: model, loss and batch axes.
      optimizer: the Optax transformation.
      mesh: the device mesh.
      rules: logical axis name → mesh axes.
      schedule: learning-rate schedule, logged as ``lr``.
      grad_accum: microbatches per step, accumulated inside the jitted step.
      seed: init seed (used for the abstract model too).
      pipeline: the schedule used when ``mesh.shape['stage'] > 1``.
    """

    def __init__(self, task: Task, optimizer: optax.GradientTransformation, mesh: Mesh,
                 rules: Rules, *, schedule: Callable[[Any], Any] | None = None,
                 grad_accum: int = 1, seed: int = 0, pipeline: PipelineConfig | None = None):
        self.task, self.tx, self.mesh, self.rules = task, optimizer, mesh, rules
        self.schedule, self.grad_accum, self.seed = schedule, grad_accum, seed
        self.graphdef, abstract = abstract_model(task, seed)
        self.abstract_params, self.axes = _params_and_axes(abstract, task)
        self.pipeline: TickTable | None = self._pipeline_table(pipeline or PipelineConfig())
        self.param_specs = shd.param_specs(self.abstract_params, self.axes, rules, mesh)
        abstract_opt = jax.eval_shape(optimizer.init, self.abstract_params)
        opt_specs = shd.opt_state_specs(abstract_opt, self.abstract_params, self.param_specs)
        scalar = NamedSharding(mesh, PartitionSpec())
        self.state_shardings = TrainState(
            scalar, shd.named(mesh, self.param_specs), shd.named(mesh, opt_specs), scalar)
        self.abstract_state = TrainState(
            jax.ShapeDtypeStruct((), jnp.int32), self.abstract_params, abstract_opt,
            jax.ShapeDtypeStruct((), jnp.int32))
        self._check_layout()
        self.microbatches = self.pipeline.m if self.pipeline else grad_accum
        self._step = jax.jit(self._train_step, in_shardings=(self.state_shardings, None),
                             out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._eval = jax.jit(self._eval_step, in_shardings=(self.state_shardings.params, None))
        self._init = jax.jit(self._create, out_shardings=self.state_shardings)
        self._grads_jit = jax.jit(self._grads, in_shardings=(self.state_shardings.params, None))

    def _check_layout(self) -> None:
        """Rules name real axes; the batch is split over data axes; no mesh axis idles."""
        param_names = jax.tree.leaves(self.axes, is_leaf=lambda x: isinstance(x, tuple))
        used = {n for names in [*param_names, *self.task.batch_axes.values()] for n in names if n}
        shd.check_rule_names(self.rules, used)
        batch_specs = self._batch_specs(None)
        shd.check_batch_sharded(self.mesh, batch_specs)
        shd.check_axes_used(self.mesh, [self.param_specs, batch_specs])

    def _pipeline_table(self, cfg: PipelineConfig) -> TickTable | None:
        """The schedule's tick table when the mesh has pipeline stages, after the checks.

        Raises:
          ValueError: for a model that cannot be split, layers not divisible by
            stages × virtual stages, or gradient accumulation on top of microbatches.
        """
        p = self.mesh.shape["stage"]
        if p == 1:
            return None
        split = self.task.stages
        if split is None:
            raise ValueError(
                f"mesh.stage={p}, but this model cannot be split into pipeline stages (its task "
                "has no StageSplit: stacked layers with embed/stage/head functions); "
                "set mesh.stage=1 or use model.name=gpt")
        if self.grad_accum > 1:
            raise ValueError(
                f"train.grad_accum={self.grad_accum} with mesh.stage={p}: the pipeline already "
                "splits the batch into pipeline.microbatches; set train.grad_accum=1 and raise "
                "pipeline.microbatches instead")
        if tuple(self.rules.get("layers", ())) != ("stage",):
            raise ValueError(
                f"mesh.stage={p} needs the stacked layers split over it, but rules.layers="
                f"{','.join(self.rules.get('layers', ())) or 'null'}; set rules.layers=stage")
        m = cfg.microbatches or 2 * p
        v = cfg.virtual_stages
        n_layers = jax.tree.leaves(self.abstract_params[split.layers_key])[0].shape[0]
        if n_layers % (p * v):
            raise ValueError(
                f"{n_layers} layers cannot be cut into mesh.stage × pipeline.virtual_stages = "
                f"{p}×{v} = {p * v} equal chunks; change model.n_layers, mesh.stage or "
                "pipeline.virtual_stages")
        return tick_table(cfg.schedule, p, m, v)

    # ---- batches -------------------------------------------------------------------------
    def _batch_specs(self, batch: Mapping[str, Any] | None) -> dict[str, PartitionSpec]:
        """Batch specs; with ``batch`` None, without the divisibility check."""
        specs = {}
        for key, names in self.task.batch_axes.items():
            shape = batch[key].shape if batch is not None else [0] * len(names)
            specs[key] = spec_for(names, self.rules, self.mesh, shape, f"batch '{key}'")
        return specs

    def batch_shardings(self, batch: Mapping[str, Any]) -> dict[str, NamedSharding]:
        """Shardings of a batch, checking that its batch dim splits evenly.

        Raises:
          ValueError: when the global batch (or a microbatch of it) is not
            divisible by the devices that share it.
        """
        specs = self._batch_specs(batch)
        for key, spec in specs.items():
            ways = math.prod(self.mesh.shape[a] for e in spec[:1] if e
                             for a in (e if isinstance(e, tuple) else (e,)))
            size = batch[key].shape[0]
            if size % (ways * self.microbatches):
                what = "pipeline.microbatches" if self.pipeline else "train.grad_accum"
                raise ValueError(
                    f"batch '{key}': global batch {size} must be divisible by {what} "
                    f"({self.microbatches}) × the {ways} devices sharing the batch dim "
                    f"({spec[0]}) = {self.microbatches * ways}; change train.batch_size, "
                    f"{what} or the mesh"
                )
        return shd.named(self.mesh, specs)

    def shard_batch(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host arrays (this process's rows) → global ``jax.Array``s with the batch sharding."""
        shapes = global_batch_shapes(host_batch)
        shardings = self.batch_shardings(shapes)
        return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v),
                                                          shapes[k].shape)
                for k, v in host_batch.items()}

    # ---- init ----------------------------------------------------------------------------
    def _create(self) -> TrainState:
        with activation_rules(self.mesh, self.rules), nnx.use_eager_sharding(False):
            model = self.task.model_fn(nnx.Rngs(self.seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, self.tx.init(params), zero)

    def init(self) -> TrainState:
        """A fresh state, born sharded (``jit`` with ``out_shardings``)."""
        return self._init()

    def compile_init(self) -> jax.stages.Compiled:
        """The compiled init program (its memory analysis shows what one device holds)."""
        return self._init.lower().compile()

    # ---- steps ---------------------------------------------------------------------------
    def loss(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The task's loss and metrics of ``params`` (traceable; used by the steps)."""
        with activation_rules(self.mesh, self.rules):
            return self.task.loss_fn(nnx.merge(self.graphdef, params), batch)

    def _grads(self, params: Any, batch: Batch) -> tuple[jax.Array, dict, Any]:
        if self.pipeline is not None:
            with activation_rules(self.mesh, self.rules):
                return pipeline_grads(self.task.stages, self.graphdef, params, batch,
                                      table=self.pipeline, mesh=self.mesh, rules=self.rules,
                                      param_specs=self.param_specs)
        if self.grad_accum == 1:
            (loss, aux), grads = jax.value_and_grad(self.loss, has_aux=True)(params, batch)
            return loss, aux, grads
        if self.accumulates_per_data_shard:
            return self._accumulate_over_data(params, batch)
        total = _accumulate(jax.value_and_grad(self.loss, has_aux=True), params, batch,
                            self.grad_accum, self.state_shardings.params)
        return jax.tree.map(lambda x: x / self.grad_accum, total)

    @property
    def accumulates_per_data_shard(self) -> bool:
        """Whether gradient accumulation keeps microbatch gradients unreduced over ``data``
        until the step's end (one all-reduce per step instead of one per microbatch).

        It needs a data axis and no parameter sharded over it. With ``fsdp`` and
        ``tensor`` both above 1, XLA 0.10's SPMD partitioner aborts on the partly
        manual program (a failed check in spmd_partitioner_util.cc), so that layout
        keeps the automatic path.
        """
        if self.grad_accum == 1 or self.pipeline is not None or self.mesh.shape["data"] == 1:
            return False
        if self.mesh.shape["fsdp"] > 1 and self.mesh.shape["tensor"] > 1:
            return False
        specs = jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return not any("data" in (e if isinstance(e, tuple) else (e,))
                       for s in specs for e in s if e)

    def _accumulate_over_data(self, params: Any, batch: Batch) -> tuple[jax.Array, dict, Any]:
        """Gradient accumulation with one all-reduce over ``data`` per step.

        Under ``shard_map`` with ``data`` manual (``fsdp``/``tensor`` stay automatic,
        so FSDP still gathers weights and reduce-scatters gradients per microbatch),
        each data shard sums its microbatches' gradients locally and the sums are
        all-reduced once. The automatic path would all-reduce every microbatch's
        gradients: the accumulator is replicated over ``data``, and a partial sum
        cannot be carried through the loop.
        """
        n, k = self.mesh.shape["data"], self.grad_accum
        inner = {name: tuple(a for a in axes if a != "data") for name, axes in self.rules.items()}

        def local(params, batch):
            mesh = jax.sharding.get_abstract_mesh()
            shardings = shd.named(mesh, self.param_specs)

            def loss(p, b):
                with activation_rules(mesh, inner):
                    return self.task.loss_fn(nnx.merge(self.graphdef, p), b)

            total = _accumulate(jax.value_and_grad(loss, has_aux=True), params, batch, k,
                                shardings)
            return jax.tree.map(lambda x: jax.lax.psum(x, "data") / (n * k), total)

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(PartitionSpec(), PartitionSpec("data")),
                           out_specs=PartitionSpec(), axis_names={"data"}, check_vma=False)
        return fn(params, dict(batch))

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        loss, aux, grads = self._grads(state.params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = TrainState(
            state.step + 1, keep(params, state.params), keep(opt_state, state.opt_state),
            state.skipped + (~finite).astype(jnp.int32))
        # The optimizer's own step count excludes skipped steps, and so does its schedule.
        applied = state.step - state.skipped
        lr = self.schedule(applied) if self.schedule is not None else jnp.nan
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32),
                   "finite": finite, **aux}
        return new_state, metrics

    def _eval_step(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
        loss, aux = self.loss(params, batch)
        return {"loss": loss, **aux}

    def step(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        """One optimizer step (donates ``state``)."""
        return self._step(state, batch)

    def grads(self, params: Any, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict, Any]:
        """Loss, metrics and gradients of one step's batch, as the train step computes them."""
        return self._grads_jit(params, batch)

    def evaluate(self, params: Any, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Loss (and task metrics) of ``params`` on one batch."""
        return self._eval(params, batch)

    # ---- compiled program ------------------------------------------------------------------
    def compile_step(self, batch: Mapping[str, Any]) -> jax.stages.Compiled:
        """The compiled train step for batches shaped like ``batch`` (no data needed)."""
        shardings = self.batch_shardings(batch)
        abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                          for k, v in batch.items()}
        abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract_state, self.state_shardings)
        return self._step.lower(abstract_state, abstract_batch).compile()
