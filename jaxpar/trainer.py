"""The sharded train state and the jitted train and eval steps.

One init path: ``nnx.eval_shape`` gives the abstract model, the rules give
every parameter and optimizer-state leaf a ``NamedSharding``, and
``jit(init, out_shardings=...)`` creates the state already sharded, so no
parameter is ever whole on one device. The same shardings are the step's
``in_shardings``/``out_shardings`` (the state is donated).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import gradients, guard
from jaxpar import sharding as shd
from jaxpar.logical import Rules, activation_rules, spec_for
from jaxpar.pipeline.schedule import PipelineConfig, TickTable, tick_table
from jaxpar.task import Batch, Task


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step updates. ``skipped`` counts non-finite steps not applied;
    ``model_state`` holds the model's variables other than ``nnx.Param`` (BatchNorm
    statistics, the RNG streams of dropout, …) as a pure dict — empty for most models."""

    step: jax.Array
    params: Any
    opt_state: Any
    skipped: jax.Array
    model_state: Any = field(default_factory=dict)


@dataclass(frozen=True)
class AbstractModel:
    """A task's model without any array: its graph, its variables' shapes and their
    logical names (pure dicts), split into trainable ``params`` and the other ``state``.

    ``unnamed`` lists the parameters without logical names (replicated); ``state_kinds``
    the variable types of the state (``BatchStat``, ``RngKey``, …); ``rng_counts`` is True
    for each ``RngCount`` of the state (like ``state``)."""

    graphdef: nnx.GraphDef
    params: Any
    state: Any
    param_axes: Any
    state_axes: Any
    unnamed: tuple[str, ...]
    state_kinds: tuple[str, ...]
    rng_counts: Any


def build_model(task: Task, seed: int) -> nnx.Module:
    """The task's model, built with logical names only: Flax 0.12 would otherwise try to
    shard each annotated variable at construction over a mesh named by its logical names."""
    with nnx.use_eager_sharding(False):
        return task.model_fn(nnx.Rngs(seed))


def abstract_model(task: Task, seed: int = 0) -> AbstractModel:
    """The task's model as shapes and names (``nnx.eval_shape``: nothing is allocated)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: task.model_fn(nnx.Rngs(seed)))
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    param_axes, unnamed = shd.logical_axes(params, task.path_rules)
    state_axes, _ = shd.logical_axes(state)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kinds = sorted({type(v).__name__ for v in variables})
    pure = nnx.to_pure_dict(state)
    counts = jax.tree.unflatten(jax.tree.structure(pure),
                                [isinstance(v, nnx.RngCount) for v in variables])
    return AbstractModel(graphdef, nnx.to_pure_dict(params), pure, param_axes, state_axes,
                         tuple(unnamed), tuple(kinds), counts)


def abstract_params_and_axes(task: Task, seed: int = 0) -> tuple[Any, Any]:
    """Abstract parameters and their logical axes, both as pure dicts."""
    model = abstract_model(task, seed)
    return model.params, model.param_axes


def global_batch_shapes(host_batch: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """The global shapes of a batch of which this process holds ``host_batch``: each of the
    ``jax.process_count()`` processes loads an equal share of the rows."""
    count = jax.process_count()
    return {k: jax.ShapeDtypeStruct((v.shape[0] * count, *v.shape[1:]), v.dtype)
            for k, v in host_batch.items()}


def injected_lr(opt_state: Any) -> jax.Array | None:
    """The learning rate ``optax.inject_hyperparams`` recorded in ``opt_state`` (the one
    the last update used), or None when there is not exactly one."""
    found = [v for _, v in optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
             if getattr(v, "shape", None) == ()]
    return found[0] if len(found) == 1 else None


class Trainer:
    """Sharded state, train step and eval step for a task on a mesh.

    Args:
      task: model, loss and batch axes.
      optimizer: any Optax transformation.
      mesh: the device mesh.
      rules: logical axis name → mesh axes.
      schedule: jaxpar's learning-rate schedule, logged as ``lr``; without it ``lr`` is
        read from ``optax.inject_hyperparams`` state when there is one, else not logged.
      grad_accum: microbatches per step, accumulated inside the jitted step.
      fsdp_gather: with ``grad_accum`` > 1, whether FSDP-sharded weights are gathered
        ``per_microbatch`` or ``once`` per step (kept gathered through the loop).
      seed: init seed (used for the abstract model too).
      pipeline: the schedule used when ``mesh.shape['stage'] > 1``.
      nonfinite_guard: how a non-finite step keeps the old state: ``cond``, ``where``
        or ``auto`` (``where`` on a GPU, ``cond`` elsewhere); see ``jaxpar/guard.py``.
    """

    def __init__(self, task: Task, optimizer: optax.GradientTransformation, mesh: Mesh,
                 rules: Rules, *, schedule: Callable[[Any], Any] | None = None,
                 grad_accum: int = 1, seed: int = 0, pipeline: PipelineConfig | None = None,
                 fsdp_gather: str = "per_microbatch", nonfinite_guard: str = "auto"):
        self.task, self.tx, self.mesh, self.rules = task, optimizer, mesh, rules
        self.nonfinite_guard = nonfinite_guard
        self.keep = guard.choose(nonfinite_guard, mesh.devices.flat[0].platform)
        self.schedule, self.grad_accum, self.seed = schedule, grad_accum, seed
        self.model = abstract_model(task, seed)
        self.graphdef, self.abstract_params, self.axes = (
            self.model.graphdef, self.model.params, self.model.param_axes)
        self.stateful = bool(jax.tree.leaves(self.model.state))
        if self.model.unnamed:
            _warn_unnamed(self.model.unnamed)
        self.pipeline: TickTable | None = self._pipeline_table(pipeline or PipelineConfig())
        self.param_specs = shd.param_specs(self.abstract_params, self.axes, rules, mesh)
        self.state_specs = shd.param_specs(self.model.state, self.model.state_axes, rules, mesh,
                                           what="model state")
        abstract_opt = jax.eval_shape(optimizer.init, self.abstract_params)
        opt_specs, self.opt_replicated = shd.opt_state_specs(
            abstract_opt, self.abstract_params, self.param_specs)
        scalar = NamedSharding(mesh, PartitionSpec())
        self.state_shardings = TrainState(
            scalar, shd.named(mesh, self.param_specs), shd.named(mesh, opt_specs), scalar,
            shd.named(mesh, self.state_specs))
        self.abstract_state = TrainState(
            jax.ShapeDtypeStruct((), jnp.int32), self.abstract_params, abstract_opt,
            jax.ShapeDtypeStruct((), jnp.int32), self.model.state)
        self._check_layout()
        self.microbatches = grad_accum * (self.pipeline.m if self.pipeline else 1)
        self.pipelined = self._pipelined()  # also evaluates through the stages
        self.gradients = gradients.choose(
            make_loss=self._loss_under, mesh=mesh, rules=rules, param_specs=self.param_specs,
            param_shardings=self.state_shardings.params, grad_accum=grad_accum,
            stateful=self.stateful, pipeline=self.pipelined, fsdp_gather=fsdp_gather)
        self.fsdp_gather_once = fsdp_gather == "once"
        if self.fsdp_gather_once and (grad_accum == 1
                                      or not gradients.gathers_weights(self.param_specs)):
            why = ("train.grad_accum=1" if grad_accum == 1
                   else "no parameter sharded over data or fsdp")
            warnings.warn(f"config key 'train.fsdp_gather' has no effect with {why}",
                          stacklevel=2)
            self.fsdp_gather_once = False
        self._step = jax.jit(self._train_step, in_shardings=(self.state_shardings, None),
                             out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._eval = jax.jit(self._eval_step, in_shardings=(
            self.state_shardings.params, self.state_shardings.model_state, None))
        self._init = jax.jit(self._create, out_shardings=self.state_shardings)
        self._grads_jit = jax.jit(self._grads, in_shardings=(
            self.state_shardings.params, None, self.state_shardings.model_state))

    def _check_layout(self) -> None:
        """Rules name real axes; the batch is split over data axes; no mesh axis idles."""
        names = jax.tree.leaves([self.axes, self.model.state_axes],
                                is_leaf=lambda x: isinstance(x, tuple))
        used = {n for group in [*names, *self.task.batch_axes.values()] for entry in group
                if entry for n in (entry if isinstance(entry, tuple) else (entry,))}
        shd.check_rule_names(self.rules, used)
        batch_specs = self._batch_specs(None)
        shd.check_batch_sharded(self.mesh, batch_specs)
        shd.check_axes_used(self.mesh, [self.param_specs, batch_specs])

    def _pipeline_table(self, cfg: PipelineConfig) -> TickTable | None:
        """The schedule's tick table when the mesh has pipeline stages, after the checks.

        Raises:
          ValueError: for a model that cannot be split or has non-parameter state, or
            layers not divisible by stages × virtual stages.
        """
        p = self.mesh.shape["stage"]
        if p == 1:
            return None
        split = self.task.stages
        if split is None:
            raise ValueError(
                f"mesh.stage={p}, but this model cannot be split into pipeline stages (its task "
                "has no StageSplit: stacked layers with embed/stage/head functions); "
                "set mesh.stage=1")
        other = [k for k in self.model.state_kinds if k not in ("RngKey", "RngCount")]
        if other:
            raise ValueError(
                f"mesh.stage={p}: the pipeline runs models whose state besides nnx.Param is RNG "
                f"streams only, but this one also has {', '.join(other)} (statistics of the whole "
                "batch cannot be split into stages); set mesh.stage=1 (data, fsdp and tensor "
                "parallelism carry such state)")
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
                f"{p}×{v} = {p * v} equal chunks; change the number of layers, mesh.stage or "
                "pipeline.virtual_stages")
        return tick_table(cfg.schedule, p, m, v)

    def _pipelined(self) -> gradients.Pipelined | None:
        if self.pipeline is None:
            return None
        return gradients.Pipelined(self.task.stages, self.graphdef, self.pipeline, self.mesh,
                                   self.rules, self.param_specs, self.model.rng_counts)

    @property
    def accumulates_per_data_shard(self) -> bool:
        """Whether gradient accumulation keeps microbatch gradients unreduced over ``data``
        until the step's end (one all-reduce per step instead of one per microbatch)."""
        return isinstance(self.gradients, gradients.AccumulatedPerDataShard)

    # ---- batches -------------------------------------------------------------------------
    def _batch_specs(self, batch: Mapping[str, Any] | None) -> dict[str, PartitionSpec]:
        """Batch specs; with ``batch`` None, without the divisibility check."""
        specs = {}
        for key, names in self.task.batch_axes.items():
            shape = batch[key].shape if batch is not None else [0] * len(names)
            specs[key] = spec_for(names, self.rules, self.mesh, shape, f"batch '{key}'")
        return specs

    def batch_shardings(self, batch: Mapping[str, Any]) -> dict[str, NamedSharding]:
        """Shardings of a batch, checking its keys and that its batch dim splits evenly.

        Raises:
          ValueError: for a batch whose keys are not the task's ``batch_axes``, or when
            the global batch (or a microbatch of it) is not divisible by the devices
            that share it.
        """
        if set(batch) != set(self.task.batch_axes):
            raise ValueError(
                f"the batch has entries {sorted(batch)} but the task's batch_axes name "
                f"{sorted(self.task.batch_axes)}; give every batch entry its logical axes in "
                "Task.batch_axes (and only those entries)")
        specs = self._batch_specs(batch)
        for key, spec in specs.items():
            ways = math.prod(self.mesh.shape[a] for e in spec[:1] if e
                             for a in (e if isinstance(e, tuple) else (e,)))
            size = batch[key].shape[0]
            if size % (ways * self.microbatches):
                what = " × ".join(name for name, on in (
                    ("train.grad_accum", self.grad_accum > 1 or not self.pipeline),
                    ("pipeline.microbatches", self.pipeline is not None)) if on)
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
        with activation_rules(self.mesh, self.rules):
            model = build_model(self.task, self.seed)
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, self.tx.init(params), zero,
                          nnx.to_pure_dict(model_state))

    def _create_from(self, params: Any) -> TrainState:
        # the model's own parameters are built too, unused (XLA drops them): the other
        # state (RNG streams, statistics) comes from the same init path
        state = self._create()
        return TrainState(state.step, params, self.tx.init(params), state.skipped,
                          state.model_state)

    def init(self) -> TrainState:
        """A fresh state, born sharded (``jit`` with ``out_shardings``).

        With the task's ``init_params`` (pretrained weights) the parameters are those,
        each device receiving only its slice (:func:`place_params`); the optimizer state
        starts fresh.

        Raises:
          ValueError: when ``init_params`` gives parameters that do not fit the model.
        """
        if self.task.init_params is None:
            return self._init()
        params = place_params(self.task.init_params(), self.abstract_params,
                              self.state_shardings.params)
        create = jax.jit(self._create_from, in_shardings=(self.state_shardings.params,),
                         out_shardings=self.state_shardings, donate_argnums=0)
        return create(params)

    def compile_init(self) -> jax.stages.Compiled:
        """The compiled init program (its memory analysis shows what one device holds)."""
        return self._init.lower().compile()

    # ---- the model as a function -----------------------------------------------------------
    def apply(self, params: Any, model_state: Any, batch: Batch, *, train: bool,
              mesh: Any = None, rules: Rules | None = None) -> tuple[jax.Array, dict, Any]:
        """The task's loss, metrics and the model's new state (traceable).

        The model runs in NNX's training mode (``model.train()``: dropout on, BatchNorm on
        batch statistics, updating its running averages) or evaluation mode
        (``model.eval()``), with the activation rules of ``mesh``/``rules`` (default:
        the trainer's).
        """
        model = nnx.merge(self.graphdef, params, model_state)
        model.train() if train else model.eval()
        with activation_rules(self.mesh if mesh is None else mesh,
                              self.rules if rules is None else rules):
            loss, metrics = self.task.loss_fn(model, batch)
        return loss, metrics, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))

    def _loss_under(self, mesh: Any, rules: Rules) -> gradients.StateLoss:
        return lambda p, s, b: self.apply(p, s, b, train=True, mesh=mesh, rules=rules)

    def loss(self, params: Any, batch: Batch, model_state: Any = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The task's loss and metrics of ``params`` in training mode (traceable)."""
        return self.apply(params, self._state_or_empty(model_state), batch, train=True)[:2]

    def _state_or_empty(self, model_state: Any) -> Any:
        if model_state is None and self.stateful:
            raise ValueError("this model has state besides its parameters "
                             f"({', '.join(self.model.state_kinds)}): pass model_state "
                             "(TrainState.model_state)")
        return {} if model_state is None else model_state

    # ---- steps ---------------------------------------------------------------------------
    def _grads(self, params: Any, batch: Batch, model_state: Any = None):
        loss, metrics, grads, _ = self.gradients(params, self._state_or_empty(model_state),
                                                 batch)
        return loss, metrics, grads

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        loss, aux, grads, model_state = self.gradients(state.params, state.model_state, batch)
        grad_norm = optax.tree.norm(grads)

        def update() -> tuple[Any, Any]:
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state

        def named(params: Any, opt_state: Any, model_state: Any) -> dict[str, Any]:
            return {"params": params, "opt_state": opt_state, "model_state": model_state}

        # The loss and the gradient norm miss what the optimizer makes of finite gradients
        # (a huge lr or weight decay, a user's transformation): the new parameters are
        # checked too, reduced on device with the rest (no host sync); the guard keeps
        # the old state when anything is not finite (jaxpar/guard.py).
        params, opt_state = update()
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & guard.all_finite(params)
        kept = self.keep(finite, named(params, opt_state, model_state),
                         lambda: named(*update(), model_state),
                         named(state.params, state.opt_state, state.model_state))
        new_state = TrainState(state.step + 1, kept["params"], kept["opt_state"],
                               state.skipped + (~finite).astype(jnp.int32), kept["model_state"])
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                   "skipped": new_state.skipped, **aux}
        lr = self._lr(state, opt_state)
        if lr is not None:
            metrics["lr"] = jnp.asarray(lr, jnp.float32)
        return new_state, metrics

    def _lr(self, state: TrainState, opt_state: Any) -> Any:
        """The learning rate of this step: jaxpar's schedule at the optimizer's own step
        count (skipped steps excluded), or what ``inject_hyperparams`` recorded."""
        if self.schedule is not None:
            return self.schedule(state.step - state.skipped)
        return injected_lr(opt_state)

    def _eval_step(self, params: Any, model_state: Any, batch: Batch) -> dict[str, jax.Array]:
        if self.pipelined is not None:  # through the stages: no device gathers every layer
            loss, aux = self.pipelined.evaluate(params, model_state, batch)
        else:
            loss, aux, _ = self.apply(params, model_state, batch, train=False)
        return {"loss": loss, **aux}

    def step(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        """One optimizer step (donates ``state``)."""
        return self._step(state, batch)

    def grads(self, params: Any, batch: Mapping[str, jax.Array], model_state: Any = None
              ) -> tuple[jax.Array, dict, Any]:
        """Loss, metrics and gradients of one step's batch, as the train step computes them."""
        return self._grads_jit(params, batch, self._state_or_empty(model_state))

    def evaluate(self, state: TrainState | Any, batch: Mapping[str, jax.Array]
                 ) -> dict[str, jax.Array]:
        """Loss (and task metrics) on one batch in evaluation mode (``model.eval()``: no
        dropout, BatchNorm on its running averages). ``state`` is a :class:`TrainState`,
        or the parameters of a model without other state. With pipeline stages the batch
        runs through them as ``pipeline.microbatches`` microbatches.

        Raises:
          ValueError: with stages, for a batch that does not split into that many
            microbatches on each device sharing its batch dim.
        """
        if self.pipelined is not None:
            self._check_pipelined_eval_batch(batch)
        if isinstance(state, TrainState):
            return self._eval(state.params, state.model_state, batch)
        return self._eval(state, self._state_or_empty(None), batch)

    def _check_pipelined_eval_batch(self, batch: Mapping[str, Any]) -> None:
        m = self.pipeline.m
        for key, spec in self._batch_specs(batch).items():
            ways = math.prod(self.mesh.shape[a] for e in spec[:1] if e
                             for a in (e if isinstance(e, tuple) else (e,)))
            size = batch[key].shape[0]
            if size % (ways * m):
                raise ValueError(
                    f"batch '{key}': an evaluation batch of {size} runs through the pipeline "
                    f"as pipeline.microbatches ({m}) × the {ways} devices sharing the batch "
                    f"dim = {m * ways} equal parts; give it a multiple of {m * ways} rows")

    # ---- compiled program ------------------------------------------------------------------
    def compile_step(self, batch: Mapping[str, Any]) -> jax.stages.Compiled:
        """The compiled train step for batches shaped like ``batch`` (no data needed)."""
        return self.lower_step(batch).compile()

    def lower_step(self, batch: Mapping[str, Any]) -> jax.stages.Lowered:
        """The train step for batches shaped like ``batch``, lowered (not yet compiled)."""
        shardings = self.batch_shardings(batch)
        abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                          for k, v in batch.items()}
        abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract_state, self.state_shardings)
        return self._step.lower(abstract_state, abstract_batch)


def place_params(host: Any, abstract: Any, shardings: Any) -> Any:
    """Host (numpy) parameters as global arrays with ``shardings``: each process copies
    only the slices its devices hold (``jax.make_array_from_callback``).

    Args:
      host: a pure dict of arrays with the structure of ``abstract``.
      abstract: the model's abstract parameters (``ShapeDtypeStruct`` leaves).
      shardings: a ``NamedSharding`` per parameter.

    Raises:
      ValueError: naming each parameter that is missing, extra or of another shape.
    """
    given = {shd.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(host)}
    wanted = {shd.path_str(p): a for p, a in jax.tree_util.tree_leaves_with_path(abstract)}
    problems = [f"{k} missing" for k in wanted if k not in given]
    problems += [f"{k} is not a parameter of the model" for k in given if k not in wanted]
    problems += [f"{k} has shape {tuple(np.shape(given[k]))}, the model's is {a.shape}"
                 for k, a in wanted.items() if k in given and np.shape(given[k]) != a.shape]
    if problems:
        raise ValueError("the initial parameters do not fit the model: " + "; ".join(problems))

    def place(path: Any, a: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.Array:
        x = given[shd.path_str(path)]
        return jax.make_array_from_callback(
            a.shape, sharding, lambda index: np.asarray(x[index], dtype=a.dtype))

    return jax.tree_util.tree_map_with_path(place, abstract, shardings)


def _warn_unnamed(paths: tuple[str, ...]) -> None:
    """Says which parameters carry no logical names (they are replicated on every device)."""
    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
    warnings.warn(
        f"{len(paths)} parameter{'s' * (len(paths) != 1)} carry no logical axes and are "
        f"replicated on every device: {shown}; to shard them, annotate them "
        "(kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')) or nnx.Param(value, "
        "out_sharding=(...))) or give the Task path_rules", stacklevel=3)
