"""The layout checks of a plan: each refuses, in one line naming the fix, a layout whose
devices would idle, duplicate work or not divide what they share."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from jaxpar.axes import BATCH_AXES, Axis
from jaxpar.errors import LayoutError
from jaxpar.logical import (
    LAYERS,
    SEQ,
    Rules,
    names_of,
    spec_axes,
    spec_for,
    spec_leaves,
    split_over,
)
from jaxpar.pipeline.ticks import TickTable, tick_table
from jaxpar.plan.abstract import AbstractModel
from jaxpar.rules import PRESETS
from jaxpar.task import Task


def batch_specs(
    task: Task, rules: Rules, mesh: Mesh, batch: Mapping[str, Any] | None
) -> dict[str, PartitionSpec]:
    """Batch specs; with ``batch`` None, without the divisibility check."""
    specs = {}
    for key, names in task.batch_axes.items():
        shape = batch[key].shape if batch is not None else [0] * len(names)
        specs[key] = spec_for(names, rules, mesh, shape, f"batch '{key}'")
    return specs


def row_share(
    mesh: Mesh | AbstractMesh,
    specs: Mapping[str, PartitionSpec],
    processes: np.ndarray | None = None,
    process: int | None = None,
) -> tuple[int, int]:
    """Which rows of each batch ``process`` loads: share ``i`` of ``n`` equal, consecutive
    parts of the global batch's rows, the rows its devices hold. Processes whose devices
    sit at the same places along the axes splitting the rows (``data``, ``fsdp``) load the
    same rows: processes split along ``stage``, ``context`` or ``tensor`` share them.
    ``processes``: each place of the mesh's grid as its process (a plan for devices that
    are not here); None: the mesh's devices' own (an abstract mesh: one process).
    ``process``: None for this one.

    Raises:
      LayoutError: for a process whose devices' rows are not one whole, consecutive
        share (each process loads one run of rows).
    """
    if processes is None:
        processes = _processes_of(mesh)
        if processes is None:
            return 0, 1
        process = jax.process_index() if process is None else process
    if len(np.unique(processes)) == 1:
        return 0, 1
    shares = {_process_rows(key, mesh, spec, processes) for key, spec in specs.items()}
    if len(shares) > 1:
        raise LayoutError(
            f"the batch entries {', '.join(specs)} are split over different mesh axes, but "
            "each process loads one share of every entry's rows; give them the same "
            "logical batch axes (Task.batch_axes)"
        )
    owned = dict(shares.pop()) if shares else {}
    process = int(processes.flat[0]) if process is None else process
    return owned.get(process, (0, 1))


def _process_rows(
    key: str, mesh: Any, spec: PartitionSpec, processes: np.ndarray
) -> tuple[tuple[int, tuple[int, int]], ...]:
    """Each process's share (index, count) of entry ``key``'s rows; a one-line error when
    a process's rows are not a whole, consecutive share."""
    axes = spec_axes(spec[:1])
    groups = _row_blocks(mesh, axes, processes)
    ways = len(groups)
    # each (process, row block) it holds once, sorted by process then block
    held = np.unique(groups.astype(np.int64) * ways + np.arange(ways)[:, None])
    process_of, block_of = np.divmod(held, ways)
    starts = np.flatnonzero(np.r_[True, process_of[1:] != process_of[:-1]])
    owned = {}
    for process, blocks in zip(process_of[starts].tolist(), np.split(block_of, starts[1:])):
        width = len(blocks)
        if blocks[-1] - blocks[0] + 1 != width or blocks[0] % width:
            raise LayoutError(_split_rows(key, mesh, axes, processes))
        owned[process] = (int(blocks[0]) // width, ways // width)
    return tuple(sorted(owned.items()))


def check_stages_in_every_process(
    mesh: Mesh | AbstractMesh, processes: np.ndarray | None = None
) -> None:
    """The sub-mesh executor moves each shard from a stage to the device at the same place
    of the next, which must be the same process's: every stage's devices must lie in the
    processes the first stage's do, place by place. ``processes`` as for :func:`row_share`.

    Raises:
      LayoutError: for a stage whose places lie in other processes than the first's.
    """
    processes = _processes_of(mesh) if processes is None else processes
    if processes is None:
        return
    stage = mesh.axis_names.index(Axis.STAGE)
    first = np.take(processes, 0, axis=stage)
    if any(
        not np.array_equal(np.take(processes, s, axis=stage), first)
        for s in range(processes.shape[stage])
    ):
        count = len(np.unique(processes))
        raise LayoutError(
            "pipeline.executor=mpmd moves each process's own shards between the stages, but "
            "the processes hold different places of the stages (the devices in process "
            "order, or mesh.hosts_*); put a whole axis other than stage across the hosts "
            f"(e.g. mesh.hosts_data={count}, its degree a multiple of the {count} processes) "
            "or use pipeline.executor=spmd, whose stages may cross hosts"
        )


def _processes_of(mesh: Mesh | AbstractMesh) -> np.ndarray | None:
    """Each place of the mesh's grid as its device's process; None for an abstract mesh
    (a plan whose processes it does not say)."""
    if not isinstance(mesh, Mesh):
        return None
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def _row_blocks(mesh: Any, axes: tuple, processes: np.ndarray) -> np.ndarray:
    """The processes of each row block, [blocks, places]: the grid's places grouped by
    where they sit along the batch axes ``axes`` (in their order)."""
    keep = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(processes.ndim) if i not in keep]
    ways = math.prod(mesh.shape[a] for a in axes)
    return processes.transpose(*keep, *rest).reshape(ways, -1)


def _split_rows(key: str, mesh: Any, axes: tuple, processes: np.ndarray) -> str:
    """Why a process's devices do not hold one consecutive share of the rows, and the fix:
    where processes hold some of the same rows, batch axes that divide among them; else
    the hosts across the outer batch axis first."""
    held = _row_blocks(mesh, axes, processes)
    ways = len(held)
    split = [a for i, a in enumerate(mesh.axis_names) if (np.diff(processes, axis=i) != 0).any()]
    count = len(np.unique(processes))
    sets = {frozenset(held[b].tolist()) for b in range(ways)}
    overlap = any(x != y and x & y for x in sets for y in sets)
    batch = "×".join(axes) or "the batch axes"
    # a batch axis the hosts can cross alone: one whose outer batch axes are of size 1
    outermost = [a for i, a in enumerate(axes) if all(mesh.shape[b] == 1 for b in axes[:i])]
    whole = [a for a in outermost if mesh.shape[a] % count == 0]
    others = ", ".join(
        f"mesh.hosts_{a}" for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1
    )
    if overlap and whole:
        fix = f"put {whole[0]} across the hosts (mesh.hosts_{whole[0]}={count})"
    elif overlap:
        divide = f"make {batch} ({ways}) a multiple of the {count} processes, or " * bool(
            ways % count
        )
        fix = f"{divide}let only axes that do not split the rows cross the hosts ({others})"
    else:
        outer, inner = axes[0], axes[-1]
        fix = (
            f"let the hosts cross {outer}, the outer batch axis, first (mesh.hosts_{outer}; "
            f"mesh.hosts_{inner} above 1 only once mesh.hosts_{outer} = mesh.{outer})"
        )
    return (
        f"batch '{key}': the processes split the mesh along {', '.join(split)}, so a "
        f"process's devices hold rows of the {ways} row blocks ({batch}) that are not one "
        f"consecutive share, but each process loads one run of rows; {fix}"
    )


def check_rows(
    mesh: Mesh,
    specs: Mapping[str, PartitionSpec],
    batch: Mapping[str, Any],
    parts: int,
    message: Any,
) -> None:
    """Each entry's rows split into ``parts`` equal parts on each device sharing them;
    ``message(key, rows, ways)`` says what to change."""
    for key, spec in specs.items():
        ways = math.prod(mesh.shape[a] for a in spec_axes(spec[:1]))
        size = batch[key].shape[0]
        if size % (ways * parts):
            raise LayoutError(message(key, size, ways))


def check_layout(
    task: Task,
    model: AbstractModel,
    rules: Rules,
    mesh: Mesh,
    param_specs: Any,
    batch_specs: dict[str, PartitionSpec],
    run_by_executor: tuple[str, ...] = (),
) -> None:
    """Rules name real logical axes; the batch is split over data axes; no mesh axis idles
    (``run_by_executor``: axes an executor uses itself, such as the sub-mesh pipeline's
    ``stage``)."""
    names = jax.tree.leaves(
        [model.param_axes, model.state_axes], is_leaf=lambda x: isinstance(x, tuple)
    )
    used = {
        n
        for group in [*names, *task.batch_axes.values()]
        for entry in group
        for n in names_of(entry)
    }
    check_rule_names(rules, used)
    check_batch_sharded(mesh, batch_specs)
    check_axes_used(
        mesh, [param_specs, batch_specs], run_by_executor + check_context(task, rules, mesh)
    )


def check_context(task: Task, rules: Rules, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split each sequence (the rule of the logical ``seq`` axis), for a
    task that can run so.

    Raises:
      LayoutError: for a task without sequences, a model whose attention does not run
        across a split sequence, or a sequence length those axes do not divide.
    """
    axes = split_over(rules, mesh.shape, SEQ)
    if not axes:
        return ()
    ways = math.prod(mesh.shape[a] for a in axes)
    split = f"mesh axes {', '.join(axes)} (size {ways}) split each sequence"
    fix = "set mesh.context=1" if axes == (Axis.CONTEXT,) else "set rules.seq=null"
    name = f"task '{task.name}'" if task.name else "the task"
    if not task.tokens_per_example:
        batch = ", ".join(f"{k} {tuple(v)}" for k, v in task.batch_axes.items())
        raise LayoutError(f"{split}, but {name} has no sequences (its batch: {batch}); {fix}")
    if not task.context_parallel:
        raise LayoutError(
            f"{split}, but the attention of {name} does not run across a split sequence; "
            f"{fix}, or give a model of your own jaxpar.attend with the tokens' positions "
            "and declare Task(context_parallel=True) (docs/context.md; a built-in family's "
            "model.* settings may keep the sequence whole: docs/models.md)"
        )
    if task.tokens_per_example % ways:
        raise LayoutError(
            f"{split}, but its sequences of {task.tokens_per_example} tokens do not divide "
            f"into {ways}; change data.seq_len or mesh.context"
        )
    return axes


def check_rule_names(rules: Rules, used: set[str]) -> None:
    """Every rule must name a logical axis that a preset or the model knows.

    Raises:
      LayoutError: for a rule that matches nothing (a typo such as ``rules.mpl``),
        naming the closest logical name.
    """
    known = set(used).union(*PRESETS.values())
    for name in rules:
        if name not in known:
            match = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean 'rules.{match[0]}'? " if match else ""
            raise LayoutError(
                f"rule 'rules.{name}' names no logical axis of this model or of any preset; "
                f"{hint}logical axes: {', '.join(sorted(known))}"
            )


def check_batch_sharded(mesh: Mesh, batch_specs: Mapping[str, PartitionSpec]) -> None:
    """The data-parallel axes (``data``, ``fsdp``) must split the batch.

    Raises:
      LayoutError: when such an axis is larger than 1 but some batch entry is not split
        over it — those devices would compute the same examples.
    """
    for key, spec in batch_specs.items():
        axes = set(spec_axes(spec[:1]))
        for axis in BATCH_AXES:
            if mesh.shape[axis] > 1 and axis not in axes:
                raise LayoutError(
                    f"batch '{key}' is not split over mesh axis '{axis}' (size "
                    f"{mesh.shape[axis]}), so those devices would all compute the same "
                    "examples; add it to the batch rule, e.g. rules.batch=data,fsdp"
                )


def check_axes_used(mesh: Mesh, specs: list[Any], skip: tuple[str, ...] = ()) -> None:
    """Every mesh axis larger than 1 must shard something.

    Raises:
      LayoutError: naming an axis no rule uses: its devices would all hold the same data
        and do the same work.
    """
    used = {a for tree in specs for spec in spec_leaves(tree) for a in spec_axes(spec)}
    for axis, size in mesh.shape.items():
        if size > 1 and axis not in used and axis not in skip:
            hint = (
                "pipeline stages split the stacked layers: set rules.layers=stage, or mesh.stage=1"
                if axis == Axis.STAGE
                else f"map a logical axis onto it (e.g. rules.batch=data,{axis}) or set "
                f"mesh.{axis}=1"
            )
            raise LayoutError(
                f"mesh axis '{axis}' has size {size} but no rule shards anything over it, so "
                f"its devices would duplicate all work; {hint}"
            )


def check_spmd_settings(cfg: Any, task: Task, context: Any, platform: str) -> None:
    """The spmd executor cuts a stack into equal chunks and recomputes each backward's
    forward: ``pipeline.split`` (a model given by its layers) and ``pipeline.backward``
    are the mpmd executor's. Ring attention inside it deadlocks on XLA:CPU (docs/context.md).

    Raises:
      LayoutError: naming the setting that would have no effect, or the ring on the CPU.
    """
    if cfg.split:
        fix = "set pipeline.executor=mpmd" if task.layers is not None else "leave it out"
        raise LayoutError(
            f"pipeline.split={list(cfg.split)} cuts a model given by its layers (Task.layers) "
            f"under pipeline.executor=mpmd, but this layout runs the spmd executor "
            f"(pipeline.executor={cfg.executor}), which cuts a stack of layers into equal "
            f"chunks; {fix}"
        )
    if cfg.backward != "recompute":
        raise LayoutError(
            f"pipeline.backward={cfg.backward} applies to pipeline.executor=mpmd, but this "
            f"layout runs the spmd executor (pipeline.executor={cfg.executor}, a stack of "
            "layers); set pipeline.executor=mpmd, or leave it out"
        )
    if context is not None and context.attention == "ring" and platform == "cpu":
        raise LayoutError(
            "context.attention=ring inside the spmd pipeline executor deadlocks on XLA:CPU "
            "(the ring's sends run in one stage's branch while the other stage waits); use "
            "context.attention=all_gather, or pipeline.executor=mpmd with the ring"
        )


def pipeline_table(
    task: Task, model: AbstractModel, mesh: Mesh, rules: Rules, cfg: Any
) -> TickTable | None:
    """The schedule's tick table when the mesh has pipeline stages, after the checks.

    Raises:
      LayoutError: for a model that cannot be split or has non-parameter state, or
        layers not divisible by stages × virtual stages.
    """
    p = mesh.shape[Axis.STAGE]
    if p == 1:
        return None
    split = task.stages
    if split is None:
        raise LayoutError(
            f"mesh.stage={p}, but this model cannot be split into pipeline stages: its task "
            "declares neither its layers (Task.layers=jaxpar.Layers(inputs=…, loss=…): any "
            "sequence of layers, run by pipeline.executor=mpmd) nor a StageSplit (a stack of "
            "identical layers); give it one, or set mesh.stage=1"
        )
    if model.from_gradient:
        raise LayoutError(
            f"mesh.stage={p}: this model's state holds {', '.join(model.from_gradient)}, "
            "whose next value comes from the backward pass (FP8 delayed scaling's amax "
            "histories), which the pipeline executors do not carry; set "
            "model.fp8_scaling=current, or mesh.stage=1"
        )
    other = model.beyond_rngs
    if other:
        raise LayoutError(
            f"mesh.stage={p}: the pipeline runs models whose state besides nnx.Param is RNG "
            f"streams only, but this one also has {', '.join(other)} (statistics of the whole "
            "batch cannot be split into stages there); give the Task its layers and use "
            "pipeline.executor=mpmd (each stage keeps its own statistics), or set "
            "mesh.stage=1 (data, fsdp and tensor parallelism carry such state)"
        )
    if tuple(rules.get(LAYERS, ())) != (Axis.STAGE,):
        raise LayoutError(
            f"mesh.stage={p} needs the stacked layers split over it, but rules.layers="
            f"{','.join(rules.get(LAYERS, ())) or 'null'}; set rules.layers=stage"
        )
    m = cfg.microbatches or 2 * p
    v = cfg.virtual_stages
    n_layers = jax.tree.leaves(model.params[split.layers_key])[0].shape[0]
    if n_layers % (p * v):
        raise LayoutError(
            f"{n_layers} layers cannot be cut into mesh.stage × pipeline.virtual_stages = "
            f"{p}×{v} = {p * v} equal chunks; change the number of layers, mesh.stage or "
            "pipeline.virtual_stages"
        )
    return tick_table(cfg.schedule, p, m, v)
