"""The steps of :func:`jaxpar.plan.make_plan`: the layout of the batch, then the specs and
shardings of the train state and the gradient strategy, for one program over the whole
mesh or for the sub-mesh executor (:mod:`jaxpar.plan.submesh`).

Each step returns plain data (:class:`Decided`); :func:`~jaxpar.plan.make_plan` puts it
and what it was given (:class:`Given`) together into the :class:`~jaxpar.plan.Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.axes import Axis
from jaxpar.context import ContextConfig
from jaxpar.gradients import ModelLoss, Pipelined, Strategy
from jaxpar.logical import Rules
from jaxpar.pipeline.layout import Layout
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.plan import checks
from jaxpar.plan.abstract import AbstractModel, state_per_shard
from jaxpar.plan.offload import on_host
from jaxpar.plan.strategy import gather_once, gradient_strategy
from jaxpar.plan.submesh import sub_mesh_layout
from jaxpar.state import TrainState
from jaxpar.task import Task
from jaxpar.tensor_parallel import TensorConfig


@dataclass(frozen=True, kw_only=True)
class Given:
    """What :func:`~jaxpar.plan.make_plan` was given (defaults filled in), with the train
    state's shapes and the task's loss: the parts of the plan that do not depend on the
    layout."""

    task: Task
    optimizer: optax.GradientTransformation
    model: AbstractModel
    pipeline: PipelineConfig
    fsdp_gather: str
    optimizer_offload: bool
    abstract_state: TrainState
    loss: ModelLoss


@dataclass(frozen=True, kw_only=True)
class Decided:
    """The parts of the plan that the layout decides: the layout (with the parameters'
    specs and the tick table), the other specs and shardings of the train state, and the
    gradient strategy."""

    layout: Layout
    state_specs: Any
    opt_specs: Any
    opt_replicated: list
    state_shardings: TrainState
    gradients: Strategy


#: the last train states traced, with the optimizer and model they were traced from (a
#: plan of many layouts hands the same two to every layout: tracing Optax's init is most of
#: what estimating a layout costs)
_TRACED: list[tuple[optax.GradientTransformation, AbstractModel, TrainState]] = []


def abstract_state(optimizer: optax.GradientTransformation, model: AbstractModel) -> TrainState:
    """The train state as ``ShapeDtypeStruct`` trees."""
    for traced_optimizer, traced_model, state in _TRACED:
        if traced_optimizer is optimizer and traced_model is model:
            return state
    abstract_opt = jax.eval_shape(optimizer.init, model.params)
    counter = jax.ShapeDtypeStruct((), jnp.int32)
    state = TrainState(counter, model.params, abstract_opt, counter, model.state)
    _TRACED[:] = [*_TRACED[-3:], (optimizer, model, state)]
    return state


def batch_layout(
    task: Task,
    mesh: Mesh,
    rules: Rules,
    options: tuple[ContextConfig, TensorConfig],
    grad_accum: int,
) -> Layout:
    """The layout before the parameters' specs: mesh, rules, context and tensor settings
    and the batch's specs (checked: each process's devices hold one share of the rows)."""
    batch_specs = checks.batch_specs(task, rules, mesh, None)
    checks.row_share(mesh, batch_specs)
    context, tensor = options
    return Layout(
        mesh=mesh,
        rules=rules,
        context=context,
        tensor=tensor,
        batch_specs=batch_specs,
        grad_accum=grad_accum,
    )


def sub_mesh(given: Given, layout: Layout) -> Decided:
    """What the layout decides under the sub-mesh executor (``pipeline.executor=mpmd``)."""
    task = given.task
    model = given.model
    checks.check_stages_in_every_process(layout.mesh)
    decided = sub_mesh_layout(
        task, model, given.optimizer, given.abstract_state.opt_state, layout, given.pipeline
    )
    layout = decided.layout
    checks.check_layout(
        task,
        model,
        layout.rules,
        layout.mesh,
        layout.param_specs,
        layout.batch_specs,
        run_by_executor=(Axis.STAGE,),
    )
    return Decided(
        layout=layout,
        state_specs=decided.state_specs,
        opt_specs=decided.opt_specs,
        opt_replicated=decided.opt_replicated,
        state_shardings=decided.shardings,
        gradients=decided.executor,
    )


def one_program(given: Given, layout: Layout) -> Decided:
    """What the layout decides for one program over the whole mesh: a plain or accumulated
    step, or the SPMD pipeline executor (``mesh.stage`` > 1)."""
    task = given.task
    model = given.model
    mesh = layout.mesh
    rules = layout.rules
    table = checks.pipeline_table(task, model, mesh, rules, given.pipeline)
    if table is not None:
        ring = layout.context if layout.mesh.shape.get(Axis.CONTEXT, 1) > 1 else None
        checks.check_spmd_settings(given.pipeline, task, ring, layout.platform)
    param_specs = shd.param_specs(model.params, model.param_axes, rules, mesh)
    state_specs = shd.param_specs(model.state, model.state_axes, rules, mesh, what="model state")
    opt_state = given.abstract_state.opt_state
    opt_specs, replicated = shd.opt_state_specs(opt_state, model.params, param_specs)
    shardings = _state_shardings(mesh, param_specs, opt_specs, state_specs)
    if given.optimizer_offload:
        shardings = replace(shardings, opt_state=on_host(shardings.opt_state))
    checks.check_layout(task, model, rules, mesh, param_specs, layout.batch_specs)
    layout = replace(
        layout,
        param_specs=param_specs,
        table=table,
        fsdp_gather_once=gather_once(given.fsdp_gather, layout.grad_accum, param_specs),
    )
    pipelined = (
        Pipelined(task.stages, model.graphdef, layout, model.rng_counts)
        if table is not None
        else None
    )
    return Decided(
        layout=layout,
        state_specs=state_specs,
        opt_specs=opt_specs,
        opt_replicated=replicated,
        state_shardings=shardings,
        gradients=gradient_strategy(
            given.loss, layout, shardings.params, pipelined, state_per_shard(task, model)
        ),
    )


def _state_shardings(mesh: Mesh, param_specs: Any, opt_specs: Any, state_specs: Any) -> TrainState:
    """The train state's shardings on one mesh (the step counters replicated)."""
    scalar = NamedSharding(mesh, PartitionSpec())
    return TrainState(
        scalar,
        shd.named(mesh, param_specs),
        shd.named(mesh, opt_specs),
        scalar,
        shd.named(mesh, state_specs),
    )
