"""The layout of the sub-mesh pipeline executor (``pipeline.executor=mpmd``): which stage
holds each variable, and its sharding on that stage's sub-mesh.

A layer's parameters, optimizer statistics and model state (BatchNorm statistics, RNG
streams) live on the stage of the chunk that holds the layer, sharded there by the rules
(the sub-mesh has every axis but ``stage``); the step counters and the optimizer's
scalars (step counts, injected hyperparameters) live on the whole mesh, replicated, where
every stage reads them in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.axes import Axis
from jaxpar.errors import LayoutError
from jaxpar.pipeline.chunks import ByLayer
from jaxpar.pipeline.cut import LayerCut, cut_by_layer, stage_meshes
from jaxpar.pipeline.layout import Layout
from jaxpar.pipeline.mpmd import SubMeshPipeline
from jaxpar.pipeline.schedule import Executor, PipelineConfig, check_shape
from jaxpar.pipeline.stacked import ByStack
from jaxpar.pipeline.ticks import tick_table
from jaxpar.pipeline.views import STACKED, WHOLE
from jaxpar.plan import checks
from jaxpar.state import TrainState
from jaxpar.task import Task
from jaxpar.update import optimizer_update


@dataclass(frozen=True, kw_only=True)
class SubMeshLayout:
    """What :func:`jaxpar.plan.make_plan` takes from the sub-mesh layout: the layout (with
    the parameters' specs and the tick table), the other specs and shardings of the train
    state, and the executor."""

    layout: Layout
    state_specs: Any
    opt_specs: Any
    opt_replicated: list
    shardings: TrainState
    executor: SubMeshPipeline


def executor_of(task: Task, pipeline: PipelineConfig, stages: int) -> str | None:
    """The executor a layout runs (None without pipeline stages): ``pipeline.executor``,
    ``auto`` meaning spmd for a stack of layers (``Task.stages``) and mpmd for a model
    given by its layers (``Task.layers``)."""
    if stages == 1:
        return None
    chosen = pipeline.executor
    if chosen not in get_args(Executor):
        raise LayoutError(
            f"pipeline.executor must be one of {', '.join(get_args(Executor))}, got {chosen!r}"
        )
    if chosen == "auto":
        return "mpmd" if task.stages is None and task.layers is not None else "spmd"
    return chosen


def sub_mesh_layout(
    task: Task,
    model: Any,
    optimizer: optax.GradientTransformation,
    abstract_opt: Any,
    layout: Layout,
    pipeline: PipelineConfig,
) -> SubMeshLayout:
    """Where every variable lives under the sub-mesh executor, and the executor, on the
    mesh, rules, context settings and accumulation of ``layout``.

    Raises:
      TaskError, LayoutError: for a model that cannot be cut by layer, or a cut that does
        not fit the schedule.
    """
    p, v = layout.stages, pipeline.virtual_stages
    m = pipeline.microbatches or 2 * p
    check_shape(pipeline.schedule, p, m, v)
    meshes = tuple(stage_meshes(layout.mesh))
    if task.layers is None and task.stages is not None:
        cut, homes, param_specs, state_specs = _by_stack(task, model, layout, pipeline)
    else:
        cut, homes, param_specs, state_specs = _by_layer(task, model, layout, meshes[0], pipeline)
    opt_specs, replicated = shd.opt_state_specs(abstract_opt, model.params, param_specs)
    homes = TrainState(
        WHOLE, homes[0], _opt_homes(homes[0], model.params, abstract_opt), WHOLE, homes[1]
    )
    _check_per_stage_update(optimizer, homes.params, p)
    specs = TrainState(PartitionSpec(), param_specs, opt_specs, PartitionSpec(), state_specs)
    shardings = jax.tree.map(
        lambda home, spec: NamedSharding(layout.mesh if home < 0 else meshes[home], spec),
        homes,
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    layout = replace(layout, param_specs=param_specs, table=tick_table(pipeline.schedule, p, m, v))
    executor = SubMeshPipeline(
        cut=cut,
        layout=layout,
        meshes=meshes,
        homes=homes,
        shardings=shardings,
        heaviest_stage=_heaviest(homes.params, shardings.params, model.params, p),
        in_order=layout.mesh.devices.flat[0].platform == "cpu",
        residuals=pipeline.backward == "residuals",
    )
    return SubMeshLayout(
        layout=layout,
        state_specs=state_specs,
        opt_specs=opt_specs,
        opt_replicated=replicated,
        shardings=shardings,
        executor=executor,
    )


def _by_layer(
    task: Task, model: Any, layout: Layout, first: Mesh, pipeline: PipelineConfig
) -> tuple[ByLayer, tuple, Any, Any]:
    """A model given by its layers (``Task.layers``) under the sub-mesh executor: cut into
    ``stage`` × ``virtual_stages`` chunks, each variable on the stage of its layer, sharded
    by the rules as on ``first`` (a stage's sub-mesh: every one has the same axes)."""
    p = layout.stages
    chunks = p * pipeline.virtual_stages
    layer_cut = cut_by_layer(task, model.params, model.state, chunks, tuple(pipeline.split))
    rules = layout.rules
    param_specs = shd.param_specs(model.params, model.param_axes, rules, first)
    state_specs = shd.param_specs(model.state, model.state_axes, rules, first, what="model state")
    homes = _by_layer_homes(layer_cut, p, model.params, model.state)
    return ByLayer(layer_cut, task.layers), homes, param_specs, state_specs


def _by_stack(
    task: Task, model: Any, layout: Layout, pipeline: PipelineConfig
) -> tuple[ByStack, tuple, Any, Any]:
    """A stack of layers (``Task.stages``) under the sub-mesh executor: stage ``s`` holds the
    ``s``-th chunk of the stack, split over ``stage`` as under the spmd executor (so the
    two executors' states are alike); the other variables live on the whole mesh.

    With virtual stages, chunk ``c`` of ``stage × virtual_stages`` runs on stage ``c mod
    stage`` (:class:`~jaxpar.pipeline.stacked.ByStack`).

    Raises:
      LayoutError: for a variable outside the stack split over ``stage``.
    """
    if pipeline.split:  # the stack is split over ``stage``: its chunks are equal
        raise LayoutError(
            f"pipeline.split={list(pipeline.split)} cuts a model given by its layers "
            "(Task.layers), but this model is a stack of layers (its StageSplit), cut into "
            f"{layout.stages * pipeline.virtual_stages} equal chunks; leave pipeline.split out"
        )
    mesh = layout.mesh
    rules = layout.rules
    table = checks.pipeline_table(task, model, mesh, rules, pipeline)
    chunks = layout.stages * table.v
    key = task.stages.layers_key
    param_specs = shd.param_specs(model.params, model.param_axes, rules, mesh)
    state_specs = shd.param_specs(model.state, model.state_axes, rules, mesh, what="model state")

    def home(path: tuple, spec: PartitionSpec) -> int:
        stacked = _key(path[0]) == key
        if stacked and tuple(spec)[:1] == (Axis.STAGE,):
            return STACKED
        if not stacked and Axis.STAGE not in jax.tree.leaves(tuple(spec)):
            return WHOLE
        raise LayoutError(
            f"pipeline.executor=mpmd: {shd.path_str(path)} has spec {spec}, but the stacked "
            f"layers ('{key}') must be split over 'stage' on their first dim and nothing else "
            "over it; map only the logical 'layers' axis to stage (rules.layers=stage)"
        )

    specs = lambda tree: jax.tree_util.tree_map_with_path(
        home, tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    # the layers: the longest entry of the stack (an entry of every other layer is shorter)
    n = max(x.shape[0] for x in jax.tree.leaves(model.params[key])) // chunks
    cut = ByStack(
        task.stages,
        model.graphdef,
        tuple((c * n, (c + 1) * n) for c in range(chunks)),
        model.rng_counts,
    )
    return cut, (specs(param_specs), specs(state_specs)), param_specs, state_specs


def _check_per_stage_update(tx: optax.GradientTransformation, homes: Any, p: int) -> None:
    """Each stage updates its own parameters: the optimizer's update of one parameter must
    not read another stage's gradients (nor, for a stack split over the stages, the rest
    of its own leaf). Checked on a probe (the parameters' structure, 2 rows a stage, large
    gradients): the update of the whole probe against each stage's share updated alone,
    with the whole probe's gradient norm.

    Raises:
      LayoutError: naming the first parameter whose update differs.
    """
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda h: jnp.asarray(rng.normal(size=(2 * p if h == STACKED else 2, 2)), jnp.float32),
        homes,
    )
    grads = jax.tree.map(lambda x: 1e3 * x, params)
    norm = optax.tree.norm(grads)
    whole, _ = optimizer_update(tx, grads, tx.init(params), params, norm)
    positions = shd.param_positions(jax.eval_shape(tx.init, params), params)
    flat = jax.tree.leaves(homes)
    for s in range(p):

        def part(home: int, x: Any, s: int = s) -> Any:
            if home == STACKED:
                return x[2 * s : 2 * s + 2]
            return x if home in (s, WHOLE) else None

        mine = lambda tree: jax.tree.map(part, homes, tree)
        opt = jax.tree.map(
            lambda i, x: part(flat[i], x) if i >= 0 else x,
            positions,
            tx.init(params),
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )
        alone, _ = optimizer_update(tx, mine(grads), opt, mine(params), norm)
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(alone), jax.tree.leaves(mine(whole))
        ):
            if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
                raise LayoutError(
                    f"pipeline.executor=mpmd updates each stage's parameters on its own "
                    f"devices, but this optimizer's update of {shd.path_str(path)} depends on "
                    "other stages' gradients (a global-norm clip inside the optax chain, "
                    "say): clip with jaxpar.clip_by_global_norm(max_norm) (or optim.clip_norm), "
                    "which clips by the whole model's norm, or use pipeline.executor=spmd"
                )


def _heaviest(homes: Any, shardings: Any, params: Any, p: int) -> int:
    """The stage whose devices hold the most parameter bytes."""
    held = [0] * p
    for home, sharding, leaf in zip(
        jax.tree.leaves(homes), jax.tree.leaves(shardings), jax.tree.leaves(params)
    ):
        for s in range(p) if home < 0 else [home]:
            held[s] += math.prod(sharding.shard_shape(leaf.shape)) * shd.itemsize(leaf.dtype)
    return max(range(p), key=held.__getitem__)


def _by_layer_homes(cut: LayerCut, p: int, params: Any, state: Any) -> tuple[Any, Any]:
    """The stage of every parameter and model-state leaf: that of the layer it lies in."""
    owners = {}
    for c in range(len(cut.chunks)):
        for path in cut.paths(c):
            owners[path] = c % p

    def stage_of(path: tuple, _: Any) -> int:
        keys = tuple(map(_key, path))
        return next(s for owned, s in owners.items() if keys[: len(owned)] == owned)

    return (
        jax.tree_util.tree_map_with_path(stage_of, params),
        jax.tree_util.tree_map_with_path(stage_of, state),
    )


def _opt_homes(param_homes: Any, params: Any, abstract_opt: Any) -> Any:
    """An optimizer statistic lives where its parameter does; a scalar on the whole mesh."""
    flat = jax.tree.leaves(param_homes)
    positions = shd.param_positions(abstract_opt, params)
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    return jax.tree.map(
        lambda i: i if is_masked(i) else (flat[i] if i >= 0 else WHOLE),
        positions,
        is_leaf=is_masked,
    )


def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "idx", None))
