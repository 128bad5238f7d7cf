"""The Plan: every layout decision of a run, made once, as plain data.

:func:`make_plan` takes the task (the abstract model, its loss and batch axes), the
optimizer, the mesh, the rules, the pipeline schedule, gradient accumulation and the
FSDP gather setting, and decides everything a layout means before anything compiles:

* the ``PartitionSpec`` and ``NamedSharding`` of every parameter, model-state variable,
  optimizer-state leaf and batch entry (scaling-book notation: ``W[D_fsdp, F_tensor]``);
* the pipeline's tick table (``mesh.stage > 1``);
* the gradient strategy (plain, accumulated, accumulated per data shard, pipelined:
  :mod:`jaxpar.gradients`);
* the bytes of state each device holds;
* every layout check: rules that name no logical axis, a batch not split over a data
  axis, a mesh axis that shards nothing, a model the pipeline cannot cut, a batch the
  devices and microbatches do not divide — each a one-line :class:`~jaxpar.errors.LayoutError`.

The :class:`~jaxpar.trainer.Trainer` takes a Plan and only builds and jits the steps;
everything else that needs a layout (checkpoint restore, the lab, ``jaxpar inspect``,
sampling) reads the Plan. A new parallel strategy is a new field or strategy object
here, never a branch in the trainer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.context import ContextConfig
from jaxpar.errors import ConfigError, TaskError
from jaxpar.gradients import (
    Accumulated,
    AccumulatedPerDataShard,
    ModelLoss,
    Pipelined,
    Plain,
    Strategy,
)
from jaxpar.logical import BATCH_AXES, Rules, names_of, spec_axes, spec_leaves
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.pipeline.ticks import TickTable
from jaxpar.plan import checks
from jaxpar.plan.abstract import AbstractModel, abstract_model, warn_unnamed
from jaxpar.plan.submesh import executor_of, sub_mesh_layout
from jaxpar.state import TrainState
from jaxpar.task import Task

#: When accumulation gathers FSDP-sharded weights (``train.fsdp_gather``).
FsdpGather = Literal["per_microbatch", "once"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the train state on one device (the largest shard of each leaf): parameters,
    optimizer state, model state and ``total`` (with the step counters); and of the whole
    (unsharded) parameters and optimizer state."""

    params: int
    opt_state: int
    model_state: int
    total: int
    params_total: int
    opt_state_total: int


@dataclass(frozen=True, eq=False)
class Plan:
    """Every layout decision of a run (see the module docstring). Build with
    :func:`make_plan`; :meth:`replan` gives the plan of other settings.

    Attributes:
      task, optimizer: what the plan lays out (the abstract model comes from the task,
        the optimizer state's structure from the optimizer).
      mesh, rules: the device mesh and the logical-axis rules.
      model: the abstract model (shapes, logical names, state kinds).
      param_specs, state_specs, opt_specs: ``PartitionSpec`` trees.
      opt_replicated: ``(path, shape)`` of optimizer-state leaves left replicated because
        they are not parameter-shaped.
      abstract_state, state_shardings: the train state as ``ShapeDtypeStruct`` and as
        ``NamedSharding`` trees (the steps' in/out shardings, the checkpoint target).
      batch_specs: the spec of each batch entry.
      grad_accum: microbatches accumulated per step (``train.grad_accum``).
      pipeline: the schedule's tick table, or None without pipeline stages.
      fsdp_gather_once: FSDP-sharded weights are gathered once per step and kept through
        the accumulation loop (``train.fsdp_gather=once`` where it has an effect).
      loss: the task's loss of the model as pure dicts (any mode, mesh and rules).
      gradients: the gradient strategy the train and eval steps call.
      settings: the settings the plan was made with (for :meth:`replan`).
    """

    task: Task
    optimizer: optax.GradientTransformation
    mesh: Mesh
    rules: Rules
    model: AbstractModel
    param_specs: Any
    state_specs: Any
    opt_specs: Any
    opt_replicated: list[tuple[str, tuple[int, ...]]]
    abstract_state: TrainState
    state_shardings: TrainState
    batch_specs: dict[str, PartitionSpec]
    grad_accum: int
    pipeline: TickTable | None
    fsdp_gather_once: bool
    loss: ModelLoss
    gradients: Strategy
    settings: dict[str, Any]

    @property
    def microbatches(self) -> int:
        """Microbatches one step's batch is cut into (accumulation × pipeline)."""
        return self.grad_accum * (self.pipeline.m if self.pipeline else 1)

    @property
    def accumulates_per_data_shard(self) -> bool:
        """Whether gradient accumulation keeps microbatch gradients unreduced over ``data``
        until the step's end (one all-reduce per step instead of one per microbatch)."""
        return isinstance(self.gradients, AccumulatedPerDataShard)

    @property
    def executor(self) -> str | None:
        """The pipeline executor (``spmd`` or ``mpmd``), None without pipeline stages."""
        return executor_of(self.task, self.settings["pipeline"], self.mesh.shape["stage"])

    def batch_ways(self) -> int:
        """Devices the batch dim is split over (the mesh axes of the ``batch`` rule)."""
        return math.prod(
            self.mesh.shape[a] for a in self.rules.get("batch", ()) if a in self.mesh.shape
        )

    def batch_shardings(self, batch: Mapping[str, Any]) -> dict[str, NamedSharding]:
        """Shardings of a global batch (arrays or shapes), after checking its entries and
        that its batch dim splits evenly over the devices and microbatches.

        Raises:
          TaskError: for a batch whose entries are not the task's ``batch_axes``.
          LayoutError: when the global batch (or a microbatch of it) is not divisible by
            the devices that share it.
        """
        if set(batch) != set(self.task.batch_axes):
            raise TaskError(
                f"the batch has entries {sorted(batch)} but the task's batch_axes name "
                f"{sorted(self.task.batch_axes)}; give every batch entry its logical axes in "
                "Task.batch_axes (and only those entries)"
            )
        specs = checks.batch_specs(self.task, self.rules, self.mesh, batch)
        what = " × ".join(
            name
            for name, on in (
                ("train.grad_accum", self.grad_accum > 1 or not self.pipeline),
                ("pipeline.microbatches", self.pipeline is not None),
            )
            if on
        )
        checks.check_rows(
            self.mesh,
            specs,
            batch,
            self.microbatches,
            lambda key, size, ways: (
                f"batch '{key}': global batch {size} must be divisible by {what} "
                f"({self.microbatches}) × the {ways} devices sharing the batch "
                f"dim ({specs[key][0]}) = {self.microbatches * ways}; change "
                f"train.batch_size, {what} or the mesh"
            ),
        )
        return shd.named(self.mesh, specs)

    def check_eval_batch(self, batch: Mapping[str, Any]) -> None:
        """With pipeline stages an evaluation batch runs as ``pipeline.microbatches``
        microbatches on each device sharing its batch dim.

        Raises:
          LayoutError: for a batch that does not split so.
        """
        if self.pipeline is None:
            return
        m = self.pipeline.m
        specs = checks.batch_specs(self.task, self.rules, self.mesh, batch)
        checks.check_rows(
            self.mesh,
            specs,
            batch,
            m,
            lambda key, size, ways: (
                f"batch '{key}': an evaluation batch of {size} runs through the pipeline as "
                f"pipeline.microbatches ({m}) × the {ways} devices sharing the batch dim = "
                f"{m * ways} equal parts; give it a multiple of {m * ways} rows"
            ),
        )

    def state_bytes(self) -> StateBytes:
        """Bytes of the train state per device and in all, from the shardings."""
        a, s = self.abstract_state, self.state_shardings
        return StateBytes(
            shd.bytes_per_device(a.params, s.params),
            shd.bytes_per_device(a.opt_state, s.opt_state),
            shd.bytes_per_device(a.model_state, s.model_state),
            shd.bytes_per_device(a, s),
            shd.total_bytes(a.params),
            shd.total_bytes(a.opt_state),
        )

    def replan(self, **settings: Any) -> Plan:
        """The plan of the same task, optimizer, mesh and rules under other settings
        (``grad_accum``, ``pipeline``, ``fsdp_gather``)."""
        return make_plan(
            self.task, self.optimizer, self.mesh, self.rules, **{**self.settings, **settings}
        )


def make_plan(
    task: Task,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    *,
    grad_accum: int = 1,
    pipeline: PipelineConfig | None = None,
    fsdp_gather: str = "per_microbatch",
    model: AbstractModel | None = None,
    context: ContextConfig | None = None,
) -> Plan:
    """Decides the layout of ``task`` trained by ``optimizer`` on ``mesh`` under ``rules``.

    Args:
      task: the model, its loss and its batch axes.
      optimizer: any Optax transformation (its state's structure gives the optimizer
        state's specs).
      mesh: the device mesh.
      rules: logical axis name → mesh axes.
      grad_accum: microbatches accumulated per step.
      pipeline: the schedule used when ``mesh.shape['stage'] > 1`` (default: 1F1B over
        twice as many microbatches as stages).
      fsdp_gather: with ``grad_accum`` > 1, whether FSDP-sharded weights are gathered
        ``per_microbatch`` or ``once`` per step.
      model: the task's abstract model, when the caller has it already.
      context: how attention runs when ``mesh.context`` > 1 splits each sequence
        (default: all-gathered keys and values, causal load balancing).

    Raises:
      LayoutError: for every layout that cannot run (see the module docstring).
      ConfigError: for a ``grad_accum`` below 1 or an unknown ``fsdp_gather``.
    """
    if grad_accum < 1:
        raise ConfigError(f"train.grad_accum={grad_accum} must be ≥ 1")
    pipeline = pipeline if pipeline is not None else PipelineConfig()
    context = context if context is not None else ContextConfig()
    model = model if model is not None else abstract_model(task)
    if model.unnamed:
        warn_unnamed(model.unnamed)
    rules = shd.fit_soft_rules(rules, model.params, model.param_axes, mesh)
    abstract_opt = jax.eval_shape(optimizer.init, model.params)
    counter = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = TrainState(counter, model.params, abstract_opt, counter, model.state)
    batch_specs = checks.batch_specs(task, rules, mesh, None)
    checks.check_processes_own_rows(mesh, batch_specs)
    loss = ModelLoss(model.graphdef, task.loss_fn, context)
    settings = {
        "grad_accum": grad_accum,
        "pipeline": pipeline,
        "fsdp_gather": fsdp_gather,
        "context": context,
    }
    if executor_of(task, pipeline, mesh.shape["stage"]) == "mpmd":
        layout = sub_mesh_layout(
            task, model, optimizer, abstract_opt, mesh, rules, pipeline, grad_accum, context
        )
        checks.check_layout(
            task, model, rules, mesh, layout.param_specs, batch_specs, run_by_executor=("stage",)
        )
        return Plan(
            task,
            optimizer,
            mesh,
            rules,
            model,
            layout.param_specs,
            layout.state_specs,
            layout.opt_specs,
            layout.opt_replicated,
            abstract,
            layout.shardings,
            batch_specs,
            grad_accum,
            layout.executor.table,
            False,
            loss,
            layout.executor,
            settings,
        )
    table = checks.pipeline_table(task, model, mesh, rules, pipeline)
    if table is not None:
        checks.check_spmd_settings(pipeline)
    param_specs = shd.param_specs(model.params, model.param_axes, rules, mesh)
    state_specs = shd.param_specs(model.state, model.state_axes, rules, mesh, what="model state")
    opt_specs, replicated = shd.opt_state_specs(abstract_opt, model.params, param_specs)
    scalar = NamedSharding(mesh, PartitionSpec())
    shardings = TrainState(
        scalar,
        shd.named(mesh, param_specs),
        shd.named(mesh, opt_specs),
        scalar,
        shd.named(mesh, state_specs),
    )
    checks.check_layout(task, model, rules, mesh, param_specs, batch_specs)
    once = _gather_once(fsdp_gather, grad_accum, param_specs)
    pipelined = (
        Pipelined(
            task.stages, model.graphdef, table, mesh, rules, param_specs, model.rng_counts, context
        )
        if table is not None
        else None
    )
    strategy = _gradient_strategy(
        loss,
        mesh,
        rules,
        param_specs,
        shardings.params,
        grad_accum,
        model.stateful,
        pipelined,
        once,
    )
    return Plan(
        task,
        optimizer,
        mesh,
        rules,
        model,
        param_specs,
        state_specs,
        opt_specs,
        replicated,
        abstract,
        shardings,
        batch_specs,
        grad_accum,
        table,
        once,
        loss,
        strategy,
        settings,
    )


# ---- the gradient strategy ------------------------------------------------------------------
def _gradient_strategy(
    loss: ModelLoss,
    mesh: Mesh,
    rules: Rules,
    param_specs: Any,
    param_shardings: Any,
    grad_accum: int,
    stateful: bool,
    pipelined: Pipelined | None,
    once: bool,
) -> Strategy:
    """The pipeline or a plain step, accumulated over ``grad_accum`` microbatches when it
    is above 1 (locally per data shard when possible); ``once``: FSDP-sharded weights are
    gathered once per step for the accumulation."""
    inner: Strategy = pipelined or Plain(loss, mesh, rules)
    if grad_accum == 1:
        return inner
    gathered = gathered_specs(param_specs) if once else None
    if pipelined is None and per_data_shard_possible(mesh, param_specs, stateful):
        return AccumulatedPerDataShard(loss, grad_accum, mesh, rules, param_specs, gathered)
    return Accumulated(
        inner, grad_accum, param_shardings, shd.named(mesh, gathered) if once else None
    )


def per_data_shard_possible(mesh: Mesh, param_specs: Any, stateful: bool) -> bool:
    """Whether :class:`~jaxpar.gradients.AccumulatedPerDataShard` applies: a data axis, no
    parameter sharded over it, a model without state, and not ``fsdp`` × ``tensor``
    together (there XLA 0.10's SPMD partitioner aborts on the partly manual program: a
    failed check in spmd_partitioner_util.cc)."""
    if mesh.shape["data"] == 1 or stateful:
        return False
    if mesh.shape["fsdp"] > 1 and mesh.shape["tensor"] > 1:
        return False
    return not any("data" in spec_axes(s) for s in spec_leaves(param_specs))


def gathered_specs(param_specs: Any) -> Any:
    """The parameters' specs without the batch axes (``data``, ``fsdp``): FSDP-sharded
    parameters gathered, tensor and stage splits kept."""

    def drop(spec: PartitionSpec) -> PartitionSpec:
        entries = []
        for e in spec:
            kept = tuple(a for a in names_of(e) if a not in BATCH_AXES)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return PartitionSpec(*entries)

    return jax.tree.map(drop, param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def gathers_weights(param_specs: Any) -> bool:
    """Whether any parameter is sharded over a batch axis (and so gathered before use)."""
    return gathered_specs(param_specs) != param_specs


def _gather_once(setting: str, grad_accum: int, param_specs: Any) -> bool:
    """Whether ``train.fsdp_gather=once`` has an effect (a warning says when it has none)."""
    if setting not in get_args(FsdpGather):
        raise ConfigError(
            f"train.fsdp_gather must be one of {', '.join(get_args(FsdpGather))}, got {setting!r}"
        )
    if setting != "once":
        return False
    if grad_accum == 1 or not gathers_weights(param_specs):
        why = "train.grad_accum=1" if grad_accum == 1 else "no parameter sharded over data or fsdp"
        warnings.warn(f"config key 'train.fsdp_gather' has no effect with {why}", stacklevel=3)
        return False
    return True
