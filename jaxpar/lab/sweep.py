"""``jaxpar sweep``: the same model and global batch under many layouts, side by side.

For each layout the real train step is compiled (``Trainer.compile_step``;
:mod:`jaxpar.lab.measure`) and read: memory per device from ``memory_analysis()``,
collective bytes by kind and FLOPs from the optimized HLO (:mod:`jaxpar.hlo`), the
textbook's collective bytes (:mod:`jaxpar.lab.predict`), and a roofline step
time on a hardware profile (:mod:`jaxpar.lab.hardware`). With ``steps > 0`` the
compiled step also runs and its median time is measured, one layout at a time (in a worker
process on the CPU backend: :func:`jaxpar.lab.workers.measure_all`).

A layout is a string such as ``"data=2,fsdp=2,tensor=2"``: mesh degrees (the
axes it leaves out are 1) plus, optionally, any ``section.key=value`` override
(``"fsdp=8,model.remat=full"``). Its rules are the ``auto`` preset (every
logical axis has a rule, so every mesh works) unless the layout names
``rules.preset``. A layout that cannot run (heads not divisible by ``tensor``,
layers not by ``stage``…) becomes a row with the reason, not a crash.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax

from jaxpar.axes import BATCH_AXES, Axis
from jaxpar.buckets import auto_bytes
from jaxpar.config import Config
from jaxpar.errors import LayoutError
from jaxpar.lab.families import lab_named
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Row as Row
from jaxpar.lab.measure import layout_overrides as layout_overrides
from jaxpar.lab.measure import measure as measure
from jaxpar.lab.unread import unused_once
from jaxpar.lab.workers import measure_all
from jaxpar.pipeline.schedule import PipelineConfig, check_shape
from jaxpar.plan import abstract_model
from jaxpar.plan.abstract import AbstractModel, state_per_shard
from jaxpar.run import task_for
from jaxpar.task import Task


def all_layouts(devices: int) -> list[str]:
    """Every assignment of mesh degrees whose product is ``devices`` (data-major order)."""

    def split(n: int, axes: tuple[str, ...]) -> list[list[tuple[str, int]]]:
        if len(axes) == 1:
            return [[(axes[0], n)]]
        return [
            [(axes[0], d), *rest]
            for d in range(n, 0, -1)
            if n % d == 0
            for rest in split(n // d, axes[1:])
        ]

    return [
        ",".join(f"{a}={d}" for a, d in combo if d > 1) or "data=1"
        for combo in split(devices, (Axis.DATA, Axis.FSDP, Axis.CONTEXT, Axis.TENSOR, Axis.STAGE))
    ]


def default_layouts(
    config: Config, devices: int, task: Task | None = None, platform: str | None = None
) -> tuple[list[str], str | None]:
    """:func:`all_layouts` of ``devices``, less those the model cannot run
    (:func:`runnable`), and a note saying what was left out and why (None when nothing
    was); the variants of the options the model allows as well (experts, sequence
    parallelism, Ulysses, the other gradient reduction on ``platform``: JAX's default
    backend when None)."""
    task = task if task is not None else task_for(config)
    kept, note = runnable(all_layouts(devices), task)
    model = abstract_model(task)  # its shapes once, for the variants that read them
    variants = _expert_variants(config, model, kept) + _sequence_variants(task, kept)
    variants += _bucket_variants(config, task, model, kept, platform or jax.default_backend())
    return kept + variants + _ulysses_variants(config, task, kept), note


def microbatched(
    config: Config, layouts: list[str], note: str | None
) -> tuple[list[str], str | None]:
    """``layouts`` with each pipeline whose replicas' rows do not split into the default
    ``pipeline.microbatches`` (2 × ``mesh.stage``) given the most microbatches below that
    which they do split into and the schedule runs (a multiple of the stages under the
    interleaved one), and those whose rows split into none left out; and ``note`` with a
    line for each (a config that names ``pipeline.microbatches`` is planned as given)."""
    pipe, train = config.pipeline, config.train
    if pipe.microbatches:
        return layouts, note
    rows = train.batch_size // train.grad_accum
    kept, fewer, left = [], 0, 0
    for layout in layouts:
        p = _degree(layout, Axis.STAGE)
        if p == 1:
            kept.append(layout)
            continue
        ways = math.prod(_degree(layout, a) for a in BATCH_AXES)  # as the rules' presets
        if rows % ways or not _schedulable(pipe, p, 2 * p):  # its row says why
            kept.append(layout)
            continue
        share = rows // ways
        counts = [m for m in range(1, 2 * p + 1) if share % m == 0 and _schedulable(pipe, p, m)]
        if not counts:
            left += 1
        elif counts[-1] == 2 * p:
            kept.append(layout)
        else:
            fewer += 1
            kept.append(f"{layout},pipeline.microbatches={counts[-1]}")
    lines = []
    if fewer:
        lines.append(
            f"note: {count_layouts(fewer)} with mesh.stage > 1 planned with the most "
            "pipeline.microbatches (named in the layout) that each replica's share of "
            f"train.batch_size={train.batch_size} splits into, fewer than the default 2 × "
            "mesh.stage"
        )
    if left:
        lines.append(
            f"note: {count_layouts(left)} with mesh.stage > 1 left out: each replica's share of "
            f"train.batch_size={train.batch_size} splits into no pipeline.microbatches "
            "count the schedule runs"
        )
    return kept, "\n".join(x for x in (note, *lines) if x) or None


def _schedulable(pipe: PipelineConfig, p: int, m: int) -> bool:
    """Whether ``pipe``'s schedule runs ``m`` microbatches over ``p`` stages
    (:func:`~jaxpar.pipeline.schedule.check_shape`)."""
    try:
        check_shape(pipe.schedule, p, m, pipe.virtual_stages)
    except LayoutError:
        return False
    return True


def runnable(layouts: list[str], task: Task) -> tuple[list[str], str | None]:
    """``layouts`` less those ``task`` cannot run, and one note per reason (None when none
    was left out): layouts with pipeline stages when the task declares neither
    ``Task.layers`` nor a ``StageSplit``, and layouts with context parallelism when its
    model's attention does not run across a split sequence (``Task.context_parallel``)
    or its sequence does not divide."""
    notes = []
    if task.layers is None and task.stages is None:
        notes.append(
            (
                Axis.STAGE,
                f"{task.name} cannot be split into pipeline stages (its task "
                "declares neither Task.layers nor a StageSplit; docs/"
                "pipelines.md)",
            )
        )
    tokens = task.tokens_per_example
    if not task.context_parallel or not tokens:
        notes.append(
            (
                Axis.CONTEXT,
                f"{task.name} does not run with its sequences split (Task."
                "context_parallel; docs/context.md)",
            )
        )
    kept = layouts
    lines = []
    for axis, why in notes:
        before = kept
        kept = [x for x in kept if _degree(x, axis) == 1]
        if len(kept) < len(before):
            lines.append(
                f"note: {count_layouts(len(before) - len(kept))} with mesh.{axis} > 1 "
                f"left out: {why}"
            )
    if task.context_parallel and tokens:
        before = kept
        kept = [x for x in kept if tokens % _degree(x, Axis.CONTEXT) == 0]
        if len(kept) < len(before):
            lines.append(
                f"note: {count_layouts(len(before) - len(kept))} left out whose "
                f"mesh.context does not divide the {tokens}-token sequences"
            )
    return kept, "\n".join(lines) or None


def count_layouts(n: int) -> str:
    """``n layouts`` (``1 layout``)."""
    return f"{n} layout{'s' * (n != 1)}"


def _expert_variants(config: Config, model: AbstractModel, layouts: list[str]) -> list[str]:
    """For a model with experts (a parameter dim named ``experts``): each layout whose
    ``data`` degree (above 1) divides the experts again with the other choice than the
    config's — split over ``data`` (expert parallelism, ``rules.experts=data``), or where
    the config splits them so, not split (``rules.experts=null``)."""
    sizes = {
        leaf.shape[names.index("experts")]
        for leaf, names in zip(
            jax.tree.leaves(model.params),
            jax.tree.leaves(model.param_axes, is_leaf=lambda x: isinstance(x, tuple)),
        )
        if "experts" in names
    }
    if not sizes:
        return []
    given = dict(config.rules.overrides).get("experts", ())
    other = "null" if Axis.DATA in given else Axis.DATA
    return [
        f"{x},rules.experts={other}"
        for x in layouts
        if _degree(x, Axis.DATA) > 1 and all(n % _degree(x, Axis.DATA) == 0 for n in sizes)
    ]


def _bucket_variants(
    config: Config, task: Task, model: AbstractModel, layouts: list[str], platform: str
) -> list[str]:
    """For a model without state (or whose state is RNG streams that draw by example:
    :func:`~jaxpar.plan.abstract.state_per_shard`): each layout whose parameters stay
    whole on every device (``data`` above 1; no ``fsdp``, ``tensor``, stages or
    ``context``) again with the other gradient reduction than ``train.grad_bucket_mb``
    gives on ``platform``: 25 MiB buckets after the backward pass, or XLA's reduction
    inside it (docs/performance.md)."""
    asked = config.train.grad_bucket_mb
    size = auto_bytes(platform) if asked == "auto" else asked
    if state_per_shard(task, model):
        return []
    split = (Axis.FSDP, Axis.TENSOR, Axis.STAGE, Axis.CONTEXT)
    return [
        f"{x},train.grad_bucket_mb={0 if size else 25}"
        for x in layouts
        if _degree(x, Axis.DATA) > 1 and all(_degree(x, a) == 1 for a in split)
    ]


def _sequence_variants(task: Task, layouts: list[str]) -> list[str]:
    """For a family whose residual stream sequence parallelism splits
    (:attr:`~jaxpar.lab.terms.LabModel.sequence_parallel`): each layout with ``tensor``
    above 1 again with ``tensor.sequence=true``, and again overlapped by collective
    matmuls where they run."""
    if not lab_named(task.family).sequence_parallel:
        return []
    tensor = [f"{x},{SEQUENCE_PARALLEL}" for x in layouts if _degree(x, Axis.TENSOR) > 1]
    # overlapped by collective matmuls where they run: no context, no spmd pipeline
    overlap = [
        f"{x},{OVERLAP}"
        for x in tensor
        if _degree(x, Axis.CONTEXT) == 1 and (_degree(x, Axis.STAGE) == 1 or task.stages is None)
    ]
    return tensor + overlap


def _ulysses_variants(config: Config, task: Task, layouts: list[str]) -> list[str]:
    """For a built-in family's model with heads: each layout with ``context`` above 1 whose
    ``tensor`` × ``context`` degrees divide the heads again with Ulysses attention
    (``context.attention=ulysses``: heads must divide; docs/context.md)."""
    heads = getattr(config.model, "n_heads", 0) if task.family else 0
    if not heads or not task.context_parallel or config.context.attention == "ulysses":
        return []
    return [
        f"{x},context.attention=ulysses"
        for x in layouts
        if _degree(x, Axis.CONTEXT) > 1
        and heads % (_degree(x, Axis.CONTEXT) * _degree(x, Axis.TENSOR)) == 0
    ]


#: the layout entry that turns sequence parallelism on
SEQUENCE_PARALLEL = "tensor.sequence=true"
#: the layout entry that overlaps it with the matmuls
OVERLAP = "tensor.overlap=collective_matmul"


def _degree(layout: str, axis: str) -> int:
    """The degree ``layout`` gives mesh ``axis`` (1 when it names none)."""
    found = re.search(rf"\b{axis}=(\d+)", layout)
    return int(found.group(1)) if found else 1


def sweep(
    config: Config,
    layouts: list[str],
    hw: Hardware,
    steps: int = 0,
    memory_bytes: float | None = None,
    echo: bool = False,
    task: Task | None = None,
    done: Callable[[Row], None] | None = None,
    among: list[str] | None = None,
) -> list[Row]:
    """:func:`measure` of every layout, in order: one after another when steps are timed
    (alone on the machine), else compiled several at once
    (:func:`jaxpar.lab.workers.measure_all`); ``done`` is called with each row as it is
    measured (:mod:`jaxpar.lab.resume` keeps them); ``among``: the whole sweep's layouts,
    of which these are the rest (a key is unread only if none of them reads it)."""

    def say(row: Row) -> None:
        if done is not None:
            done(row)
        if echo:
            print(f"  {row.layout}: {'ok' if row.ok else 'invalid'}", flush=True)

    with unused_once(config, among or layouts, task):
        return measure_all(config, layouts, hw, memory_bytes, task, done=say, steps=steps)
