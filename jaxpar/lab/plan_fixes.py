"""What would make a layout that does not fit fit (``jaxpar plan``'s suggestions): why it
does not (arguments against temporaries), the usual changes that need less memory — each
keeping the layout's own settings — and, where none fits alone, the changes of the one
that comes closest (two together). Plain functions of layouts and measured rows: the
planner (:mod:`jaxpar.lab.planner`) measures what they name."""

from __future__ import annotations

import functools

from jaxpar.axes import MESH_AXES, Axis
from jaxpar.config import Config
from jaxpar.lab.chart import fmt_value
from jaxpar.lab.families import lab_named
from jaxpar.lab.measure import Row, layout_overrides
from jaxpar.lab.sweep import SEQUENCE_PARALLEL
from jaxpar.run import task_for
from jaxpar.task import Task


def degrees(layout: str) -> dict[str, int]:
    overrides = layout_overrides(layout)
    return {o.split("=")[0][5:]: int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")}


def why(row: Row, memory: float) -> str:
    host = (
        f"; optimizer state in host memory: {fmt_value(row.mem_host_bytes, 'B')}"
        if row.mem_host_bytes
        else ""
    )
    return (
        f"needs {fmt_value(row.mem_total_bytes, 'B')} > {fmt_value(memory, 'B')}: "
        f"arguments {fmt_value(row.mem_args_bytes, 'B')} (parameters, optimizer state, "
        f"batch), temporaries {fmt_value(row.mem_temp_bytes, 'B')} (activations){host}"
    )


def fixes(config: Config, layout: str, row: Row, task: Task | None = None) -> list[str]:
    """Variants of ``layout`` that need less memory, most promising first: sequence
    parallelism where ``tensor`` > 1, the model family's own (recomputation, e.g.
    ``model.remat=full``), gradient accumulation, the
    data degree moved into context parallelism (each sequence split: activations shrink
    with it) and into FSDP."""
    deg = degrees(layout)
    accum = []
    shard = []
    context = []
    recompute = (
        []
        if task is not None
        else [f"{layout},{fix}" for fix in config.family.memory_fixes(config.model)]
    )
    family = task.family if task is not None else config.family.name
    if (
        deg[Axis.TENSOR] > 1
        and SEQUENCE_PARALLEL not in layout
        and lab_named(family).sequence_parallel
    ):
        # the residual stream split over tensor too: its activations shrink, nothing recomputed
        recompute.insert(0, f"{layout},{SEQUENCE_PARALLEL}")
    if deg[Axis.STAGE] == 1:
        accum += [
            f"{layout},train.grad_accum={k}"
            for k in (2, 4, 8)
            if k > config.train.grad_accum
            and config.train.batch_size % (k * deg[Axis.DATA] * deg[Axis.FSDP]) == 0
        ]
    if deg[Axis.DATA] > 1:  # move the data degree into fsdp: the state gets sharded that much more
        moved = {**deg, Axis.FSDP: deg[Axis.FSDP] * deg[Axis.DATA], Axis.DATA: 1}
        shard.append(_withdegrees(layout, moved))
        built = task or _task_of(config)
        tokens = built.tokens_per_example
        moved = {**deg, Axis.CONTEXT: deg[Axis.CONTEXT] * deg[Axis.DATA], Axis.DATA: 1}
        if built.context_parallel and tokens % moved[Axis.CONTEXT] == 0:
            context.append(_withdegrees(layout, moved))
    activations_dominate = (row.mem_temp_bytes or 0) > (row.mem_args_bytes or 0)
    if activations_dominate:
        return recompute + context + accum + shard
    return shard + recompute + context + accum


def _withdegrees(layout: str, degrees: dict[str, int]) -> str:
    """``layout`` with its mesh degrees ``degrees`` (those above 1), its other settings
    (``tensor.sequence=true``, ``rules.…``, ``mesh.hosts_…``) kept."""
    axes = [f"{a}={d}" for a, d in degrees.items() if a in MESH_AXES and d > 1]
    kept = [x.strip() for x in layout.split(",") if "." in x.partition("=")[0]]
    return ",".join([*axes, *kept])


@functools.lru_cache(maxsize=2)
def _task_of(config: Config) -> Task:
    """The config's built-in task, built once for all the layouts a plan fixes."""
    return task_for(config)


def tried(config: Config, row: Row, rows: dict[str, Row], task: Task | None) -> list[str]:
    """The fixes of the layout of ``row`` (:func:`fixes`), and where none of them fits, the
    fixes of the one that comes closest (two changes together), as far as ``rows`` holds
    them measured."""
    first = fixes(config, row.layout, row, task)
    measured = [rows[v] for v in first if v in rows and rows[v].ok]
    if not measured or any(r.fits for r in measured):
        return first
    closest = min(measured, key=lambda r: r.mem_total_bytes or 0)
    return first + fixes(config, closest.layout, closest, task)
