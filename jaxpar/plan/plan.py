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
sampling) reads the Plan. Engine code (the gradient strategies, the pipeline executors)
reads one frozen value, ``plan.layout`` (:class:`~jaxpar.pipeline.layout.Layout`). A new
parallel strategy is a new field or strategy object here, never a branch in the trainer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import sharding as shd
from jaxpar import tensor_parallel
from jaxpar.buckets import platform_of
from jaxpar.context import ContextConfig
from jaxpar.errors import ConfigError, TaskError
from jaxpar.gradients import AccumulatedPerDataShard, ModelLoss, Strategy
from jaxpar.logical import BATCH, Rules
from jaxpar.pipeline.layout import Layout
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.pipeline.ticks import TickTable
from jaxpar.plan import checks, decide
from jaxpar.plan.abstract import AbstractModel, abstract_model, warn_unnamed
from jaxpar.plan.offload import check_executor, device_part
from jaxpar.plan.sizes import StateBytes
from jaxpar.plan.submesh import executor_of
from jaxpar.state import TrainState
from jaxpar.task import Task
from jaxpar.tensor_parallel import TensorConfig


@dataclass(frozen=True, eq=False, kw_only=True)
class Plan:
    """Every layout decision of a run (see the module docstring). Build with
    :func:`make_plan`; :meth:`replan` gives the plan of other settings.

    Attributes:
      task, optimizer: what the plan lays out (the abstract model comes from the task,
        the optimizer state's structure from the optimizer).
      model: the abstract model (shapes, logical names, state kinds).
      layout: what engine code reads (:class:`~jaxpar.pipeline.layout.Layout`): the mesh, the
        rules, the context settings, the parameters' and the batch's specs, the tick
        table, the accumulation; its parts are also properties of the plan.
      pipeline_config: the pipeline settings the plan was made with (its tick table is
        :attr:`pipeline`).
      fsdp_gather: ``train.fsdp_gather`` as given (:attr:`fsdp_gather_once`: whether it
        has an effect).
      optimizer_offload: whether the optimizer state's shardings are in pinned host
        memory (``train.optimizer_offload``: :mod:`jaxpar.plan.offload`).
      state_specs, opt_specs: ``PartitionSpec`` trees of the model state and the
        optimizer state.
      opt_replicated: ``(path, shape)`` of optimizer-state leaves left replicated because
        they are not parameter-shaped.
      abstract_state, state_shardings: the train state as ``ShapeDtypeStruct`` and as
        ``NamedSharding`` trees (the steps' in/out shardings, the checkpoint target).
      loss: the task's loss of the model as pure dicts (any mode and layout).
      gradients: the gradient strategy the train and eval steps call.
    """

    task: Task
    optimizer: optax.GradientTransformation
    model: AbstractModel
    layout: Layout
    pipeline_config: PipelineConfig
    fsdp_gather: str
    optimizer_offload: bool = False
    state_specs: Any
    opt_specs: Any
    opt_replicated: list[tuple[str, tuple[int, ...]]]
    abstract_state: TrainState
    state_shardings: TrainState
    loss: ModelLoss
    gradients: Strategy

    # ---- the layout's parts ----------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The device mesh."""
        return self.layout.mesh

    @property
    def rules(self) -> Rules:
        """The logical-axis rules (soft rules fitted to the model and mesh)."""
        return self.layout.rules

    @property
    def tensor(self) -> TensorConfig:
        """How tensor parallelism runs (sequence parallelism, overlap)."""
        return self.layout.tensor

    @property
    def context(self) -> ContextConfig:
        """How attention runs when ``mesh.context`` > 1 splits each sequence."""
        return self.layout.context

    @property
    def param_specs(self) -> Any:
        """The parameters' ``PartitionSpec`` tree."""
        return self.layout.param_specs

    @property
    def batch_specs(self) -> Mapping[str, PartitionSpec]:
        """The spec of each batch entry."""
        return self.layout.batch_specs

    @functools.cached_property
    def row_share(self) -> tuple[int, int]:
        """The rows of each batch this process loads: share ``i`` of ``n`` equal,
        consecutive parts of the global batch's rows (its devices' rows)."""
        return checks.row_share(self.mesh, self.batch_specs)

    @property
    def grad_accum(self) -> int:
        """Microbatches accumulated per step (``train.grad_accum``)."""
        return self.layout.grad_accum

    @property
    def pipeline(self) -> TickTable | None:
        """The schedule's tick table, or None without pipeline stages."""
        return self.layout.table

    @property
    def fsdp_gather_once(self) -> bool:
        """FSDP-sharded weights are gathered once per step and kept through the
        accumulation loop (``train.fsdp_gather=once`` where it has an effect)."""
        return self.layout.fsdp_gather_once

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
        return executor_of(self.task, self.pipeline_config, self.layout.stages)

    def batch_ways(self) -> int:
        """Devices the batch dim is split over (the mesh axes of the ``batch`` rule)."""
        return math.prod(
            self.mesh.shape[a] for a in self.rules.get(BATCH, ()) if a in self.mesh.shape
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
        a = self.abstract_state
        s = self.state_shardings
        offload = self.optimizer_offload
        opt_state = shd.bytes_per_device(a.opt_state, s.opt_state)
        return StateBytes(
            params=shd.bytes_per_device(a.params, s.params),
            opt_state=opt_state,
            model_state=shd.bytes_per_device(a.model_state, s.model_state),
            total=shd.bytes_per_device(device_part(a, offload), device_part(s, offload)),
            params_total=shd.total_bytes(a.params),
            opt_state_total=shd.total_bytes(a.opt_state),
            host=opt_state if offload else 0,
        )

    def replan(self, **settings: Any) -> Plan:
        """The plan of the same task, optimizer, mesh and rules under other settings
        (``grad_accum``, ``pipeline``, ``fsdp_gather``, ``context``, ``tensor``,
        ``optimizer_offload``, ``grad_bucket_bytes``)."""
        given = dict(
            grad_accum=self.grad_accum,
            pipeline=self.pipeline_config,
            fsdp_gather=self.fsdp_gather,
            context=self.context,
            tensor=self.tensor,
            optimizer_offload=self.optimizer_offload,
            grad_bucket_bytes=self.layout.grad_bucket_bytes,
            platform=self.layout.platform,
        )
        return make_plan(self.task, self.optimizer, self.mesh, self.rules, **{**given, **settings})


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
    tensor: TensorConfig | None = None,
    optimizer_offload: bool = False,
    grad_bucket_bytes: int | None = None,
    platform: str | None = None,
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
      tensor: how tensor parallelism runs (default: no overlap; sequence parallelism is
        the rules' ``act_seq``: :func:`jaxpar.rules.sequence_parallel`).
      optimizer_offload: hold the optimizer state in pinned host memory between steps.
      grad_bucket_bytes: the step sums gradients over ``data`` in buckets of this size
        where it can (:mod:`jaxpar.buckets`; 0: XLA's reduction; None: the platform's
        default, :func:`jaxpar.buckets.auto_bytes`).
      platform: what the run is planned for (default: the mesh's devices' platform).

    Raises:
      LayoutError: for every layout that cannot run (see the module docstring).
      ConfigError: for a ``grad_accum`` below 1, an unknown ``fsdp_gather``, or
        ``optimizer_offload`` with the sub-mesh executor.
    """
    if grad_accum < 1:
        raise ConfigError(f"train.grad_accum={grad_accum} must be ≥ 1")
    pipeline = pipeline if pipeline is not None else PipelineConfig()
    context = context if context is not None else ContextConfig()
    model = model if model is not None else abstract_model(task)
    if model.unnamed:
        warn_unnamed(model.unnamed)
    rules = shd.fit_soft_rules(rules, model.params, model.param_axes, mesh)
    given = decide.Given(
        task=task,
        optimizer=optimizer,
        model=model,
        pipeline=pipeline,
        fsdp_gather=fsdp_gather,
        optimizer_offload=optimizer_offload,
        abstract_state=decide.abstract_state(optimizer, model),
        loss=ModelLoss(model.graphdef, task.loss_fn),
    )
    tensor = tensor if tensor is not None else TensorConfig()
    layout = decide.batch_layout(task, mesh, rules, (context, tensor), grad_accum)
    planned = platform or platform_of(mesh)
    layout = replace(layout, grad_bucket_bytes=grad_bucket_bytes, platform=planned)
    executor = executor_of(task, pipeline, layout.stages)
    check_executor(optimizer_offload, executor)
    tensor_parallel.check_executor(tensor, executor)
    if executor == "mpmd":
        return _plan(given, decide.sub_mesh(given, layout))
    return _plan(given, decide.one_program(given, layout))


def _plan(given: decide.Given, decided: decide.Decided) -> Plan:
    """The plan of what :func:`make_plan` was given and what the layout decided."""
    return Plan(
        task=given.task,
        optimizer=given.optimizer,
        model=given.model,
        layout=decided.layout,
        pipeline_config=given.pipeline,
        fsdp_gather=given.fsdp_gather,
        optimizer_offload=given.optimizer_offload,
        state_specs=decided.state_specs,
        opt_specs=decided.opt_specs,
        opt_replicated=decided.opt_replicated,
        abstract_state=given.abstract_state,
        state_shardings=decided.state_shardings,
        loss=given.loss,
        gradients=decided.gradients,
    )
