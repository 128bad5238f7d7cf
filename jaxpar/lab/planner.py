"""``jaxpar plan``: rank every layout of N devices by predicted step time, without training.

Each layout's step is compiled on simulated devices, several at once
(:func:`jaxpar.lab.workers.measure_all`); layouts are ranked by the roofline step time on
a hardware profile (α-β communication: bytes over the links plus a latency per
collective executed, :mod:`jaxpar.lab.hardware`), those that fit the device memory first.
Layouts the model cannot run (pipeline stages for a model without a stage split, context
parallelism for one without ``Task.context_parallel``) are one note, not a row each. For a
layout that does not fit, the plan says why (arguments — parameters, optimizer state, batch — versus
temporaries, mostly activations) and compiles the usual fixes — activation
recomputation (the model family's setting, e.g. ``model.remat=full``), gradient accumulation
(``train.grad_accum``), sharding the state further (``fsdp``) — and suggests
the fastest of those that fit. A suggestion is therefore a compiled, measured
layout, not a rule of thumb.

The memory is that of the program XLA compiles for the CPU backend: GPU
programs differ in fusion and temporaries, so treat a margin of a few percent
as none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxpar.axes import MESH_AXES, Axis
from jaxpar.config import Config
from jaxpar.files import ensure_dir
from jaxpar.lab.analytic import estimate
from jaxpar.lab.chart import fmt_value
from jaxpar.lab.families import lab_named
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Row, layout_overrides, measure
from jaxpar.lab.sweep import SEQUENCE_PARALLEL, default_layouts, microbatched, runnable
from jaxpar.lab.unread import unused_once
from jaxpar.lab.workers import default_workers, measure_all
from jaxpar.outputs import check_new_folder
from jaxpar.run import task_for
from jaxpar.task import Task


@dataclass
class Planned:
    """One ranked layout: its measurements, why it does not fit, what would make it fit."""

    row: Row
    why: str = ""
    suggestion: str = ""
    suggestion_row: Row | None = None


def _degrees(layout: str) -> dict[str, int]:
    overrides = layout_overrides(layout)
    return {o.split("=")[0][5:]: int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")}


def _why(row: Row, memory: float) -> str:
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
    deg = _degrees(layout)
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
        shard.append(_with_degrees(layout, moved))
        built = task or _task_of(config)
        tokens = built.tokens_per_example
        moved = {**deg, Axis.CONTEXT: deg[Axis.CONTEXT] * deg[Axis.DATA], Axis.DATA: 1}
        if built.context_parallel and tokens % moved[Axis.CONTEXT] == 0:
            context.append(_with_degrees(layout, moved))
    activations_dominate = (row.mem_temp_bytes or 0) > (row.mem_args_bytes or 0)
    if activations_dominate:
        return recompute + context + accum + shard
    return shard + recompute + context + accum


def _with_degrees(layout: str, degrees: dict[str, int]) -> str:
    """``layout`` with its mesh degrees ``degrees`` (those above 1), its other settings
    (``tensor.sequence=true``, ``rules.…``, ``mesh.hosts_…``) kept."""
    axes = [f"{a}={d}" for a, d in degrees.items() if a in MESH_AXES and d > 1]
    kept = [x.strip() for x in layout.split(",") if "." in x.partition("=")[0]]
    return ",".join([*axes, *kept])


def _within_domains(layouts: list[str], note: str | None, hw: Hardware) -> tuple[list[str], str]:
    """``layouts`` less those whose ``tensor`` group spans more than one of ``hw``'s NVLink
    domains (their every layer's activation all-reduces would cross the network: Megatron-LM
    SC'21 keeps tensor parallelism inside a node), and the note saying so."""
    domain = hw.domain_devices
    kept = [x for x in layouts if not domain or _degrees(x)[Axis.TENSOR] <= domain]
    if len(kept) < len(layouts):
        left = (
            f"note: {_count(len(layouts) - len(kept))} with mesh.tensor above the "
            f"{domain} GPUs of one NVLink domain left out (each layer's activations would "
            "cross the network); name them with --layouts to plan them"
        )
        note = f"{note}\n{left}" if note else left
    return kept, note


def _cuttable(
    layouts: list[str], note: str | None, config: Config, task: Task | None
) -> tuple[list[str], str]:
    """``layouts`` less those whose stages cannot hold equal shares of a built-in model's
    layers (they cannot run: either executor cuts a stack of layers into ``stage ×
    virtual stages`` equal chunks), and the note saying so; all of them for a user's task
    (its layers are its own) or a model that does not name its layer count."""
    layers = getattr(config.model, "n_layers", None)
    chunks = config.pipeline.virtual_stages
    if task is not None or not isinstance(layers, int):
        return layouts, note
    kept = [x for x in layouts if layers % (_degrees(x)[Axis.STAGE] * chunks) == 0]
    if len(kept) < len(layouts):
        cut = {_degrees(x)[Axis.STAGE] for x in kept}
        stages = sorted({_degrees(x)[Axis.STAGE] for x in layouts} - cut)
        left = (
            f"note: {_count(len(layouts) - len(kept))} with mesh.stage "
            f"{', '.join(map(str, stages))} left out: {layers} layers do not cut into that "
            f"many equal chunks (× pipeline.virtual_stages={chunks})"
        )
        note = f"{note}\n{left}" if note else left
    return kept, note


@functools.lru_cache(maxsize=2)
def _task_of(config: Config) -> Task:
    """The config's built-in task, built once for all the layouts a plan fixes."""
    return task_for(config)


class Ranking(list):
    """The ranked :class:`Planned` layouts (a list), with ``notes``: what was left out."""

    def __init__(self, planned: list[Planned], notes: list[str]):
        super().__init__(planned)
        self.notes = notes


def _tried(config: Config, row: Row, rows: dict[str, Row], task: Task | None) -> list[str]:
    """The fixes of the layout of ``row`` (:func:`fixes`), and where none of them fits, the
    fixes of the one that comes closest (two changes together), as far as ``rows`` holds
    them measured."""
    first = fixes(config, row.layout, row, task)
    measured = [rows[v] for v in first if v in rows and rows[v].ok]
    if not measured or any(r.fits for r in measured):
        return first
    closest = min(measured, key=lambda r: r.mem_total_bytes or 0)
    return first + fixes(config, closest.layout, closest, task)


def _fix(how: Measuring, misfits: list[Planned], rows: dict[str, Row]) -> dict[str, Row]:
    """``rows`` with the fixes of each layout that does not fit measured, and where none of
    them fits, the fixes of the closest (:func:`_tried`)."""
    config, task = how.config, how.task
    variants = [v for p in misfits for v in fixes(config, p.row.layout, p.row, task)]
    rows = _measure(how, variants, rows, "fixes of the layouts that do not fit")
    again = [v for p in misfits for v in _tried(config, p.row, rows, task)]
    return _measure(how, again, rows, "fixes of their fixes that come closest")


def _suggest(config: Config, planned: Planned, rows: dict[str, Row], task: Task | None) -> None:
    """The fastest measured fix of a layout that does not fit (``rows``: every layout
    measured, fixes included; one change, or two where none alone fits), or what to do
    when none fits."""
    variants = _tried(config, planned.row, rows, task)
    fitting = [rows[v] for v in variants if rows[v].ok and rows[v].fits]
    if fitting:
        planned.suggestion_row = min(fitting, key=lambda r: r.predicted_step_time_s)
        planned.suggestion = planned.suggestion_row.layout
    else:
        planned.suggestion = (
            "none of remat, more context parallelism, gradient accumulation "
            "or more FSDP fits, alone or two together; "
            "use more devices or a smaller model/batch"
        )


def plan(
    config: Config,
    devices: int,
    hw: Hardware,
    memory_bytes: float | None = None,
    layouts: list[str] | None = None,
    echo: bool = False,
    task: Task | None = None,
    workers: int | None = None,
    analytic: bool = False,
) -> Ranking:
    """Every layout of ``devices`` devices (or ``layouts``), ranked: fitting ones by
    predicted step time, then those that do not fit (with a suggestion), then invalid.
    ``task``: a user's task (default: the built-in model the config names); ``workers``:
    how many layouts compile at once (default: one per core); ``analytic``: estimate each
    layout from the model's shape instead of compiling it (:mod:`jaxpar.lab.analytic`:
    any device count)."""
    memory = memory_bytes or hw.memory_bytes
    if layouts:
        layouts, note = runnable(list(dict.fromkeys(layouts)), task or task_for(config))
    else:
        layouts, note = default_layouts(config, devices, task, hw.platform)
        if analytic:
            layouts, note = _within_domains(layouts, note, hw)
            layouts, note = _cuttable(layouts, note, config, task)
        layouts, note = microbatched(config, layouts, note)
    workers = workers or default_workers()
    how = Measuring(config, hw, memory, task, workers, echo, devices if analytic else 0)
    with unused_once(config, layouts, task), _soft_rules_once() as held_whole:
        rows = _measure(how, layouts, {})
        planned = [Planned(rows[x]) for x in layouts]
        misfits = [p for p in planned if p.row.ok and not p.row.fits]
        rows = _fix(how, misfits, rows)
    for p in misfits:
        p.why = _why(p.row, memory)
        _suggest(config, p, rows, task)

    def key(p: Planned) -> tuple[int, float]:
        group = 0 if p.row.ok and p.row.fits else 1 if p.row.ok else 2
        return group, p.row.predicted_step_time_s or 0.0

    notes = note.splitlines() if note else []
    notes += _cpu_memory_note(config, hw, analytic, task) + held_whole
    if analytic and task is not None:
        notes.append(
            "note: a model of your own has no lab module: its activations' collectives "
            "(tensor, context) are not estimated, so such layouts look cheaper than they are"
        )
    return Ranking(sorted(planned, key=key), notes)


#: the warning of a rule that cannot split a dim (:func:`jaxpar.sharding.fit_soft_rules`)
_SOFT = re.compile(r"rules\.(\w+)=.*: (\d+) \w+ of '.*' do not split (\d+) ways")


@contextlib.contextmanager
def _soft_rules_once() -> Iterator[list[str]]:
    """Around measuring a plan's layouts: a rule that cannot split a dim in some of them
    (8 K/V heads over ``tensor=16``: held whole on each device, as the rows count them) is
    a warning for a run that names it; in a plan of layouts the plan chose, one note (the
    list yielded, filled on exit). Other warnings pass as they are."""
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield notes
    splits: dict[tuple[str, str], set[int]] = {}
    said: set[str] = set()
    for w in seen:
        found = _SOFT.search(str(w.message))
        if found is None:
            if str(w.message) not in said:  # once each, as the default filter shows them
                said.add(str(w.message))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        name, count, ways = found.groups()
        splits.setdefault((name, count), set()).add(int(ways))
    notes += [
        f"note: where a layout splits {name} {', '.join(map(str, sorted(ways)))} ways, "
        f"its {count} {name} are held whole on each device of the group (its row counts "
        "them so)"
        for (name, count), ways in splits.items()
    ]


def _cpu_memory_note(config: Config, hw: Hardware, analytic: bool, task: Task | None) -> list[str]:
    """A compiled plan of a bfloat16 model for a GPU profile reports the memory of the
    program XLA:CPU compiles here, which holds bfloat16 activations as float32 and fuses
    less: the note saying so (Llama-3-8B at ``fsdp=8``: 55.3 GiB compiled here, 27.1 GiB
    estimated for an H100)."""
    if analytic or task is not None or hw.platform == "cpu" or jax.default_backend() != "cpu":
        return []
    if config.family.compute_dtype(config.model) != "bfloat16":
        return []
    return [
        "note: memory is that of the program XLA:CPU compiles here, which holds bfloat16 "
        "activations as float32 and fuses less than a GPU: a GPU's temporaries can be half "
        "of it or less; --analytic estimates the GPU's program (docs/lab.md)"
    ]


@dataclass(frozen=True)
class Measuring:
    """How a plan measures its layouts: compiled on simulated devices, ``workers`` at a
    time, or (``analytic``: the device count) estimated without compiling."""

    config: Config
    hw: Hardware
    memory: float
    task: Task | None
    workers: int
    echo: bool
    analytic: int = 0


def _measure(
    how: Measuring, layouts: list[str], rows: dict[str, Row], what: str = ""
) -> dict[str, Row]:
    """``rows`` with every layout of ``layouts`` it lacks measured (a layout that is also
    another's fix compiles once); ``what``: what the layouts are, for the line saying so."""
    todo = [x for x in dict.fromkeys(layouts) if x not in rows]
    if not todo:
        return rows
    config, hw, memory, task, echo = how.config, how.hw, how.memory, how.task, how.echo
    count = f"{len(todo)} {what}" if what else _count(len(todo))
    if how.analytic:
        if echo:
            print(f"estimating {count} from the model's shape", flush=True)
        found = [estimate(config, x, hw, how.analytic, memory, task) for x in todo]
        return {**rows, **{r.layout: r for r in found}}
    workers = how.workers

    def say(row: Row) -> None:
        if not echo:
            return
        if not row.ok:
            verdict = "invalid"
        elif row.fits:
            verdict = "fits"
        else:
            verdict = "too big"
        print(f"  {row.layout}: {verdict}", flush=True)

    if echo:
        print(f"compiling {count}, {min(workers, len(todo))} at a time", flush=True)
    found = measure_all(config, todo, hw, memory, task, workers, done=say)
    return {**rows, **{r.layout: r for r in found}}


def _count(n: int) -> str:
    return f"{n} layout{'s' * (n != 1)}"


@dataclass
class Longest:
    """The longest sequence one layout fits (doubling from the config's ``data.seq_len``):
    ``row`` measured at ``tokens``; ``beyond``: the row of twice as many (too big or
    invalid), None when the search stopped at its limit."""

    layout: str
    tokens: int = 0
    row: Row | None = None
    beyond: Row | None = None


def longest_sequence(
    config: Config,
    layout: str,
    hw: Hardware,
    memory: float,
    task: Task | None = None,
    limit: int = 2**20,
) -> Longest:
    """The longest ``data.seq_len`` (the config's, doubled while it fits, up to ``limit``)
    with which ``layout`` fits in ``memory`` per device; ``model.max_seq_len`` follows it
    where the model has that key."""
    found = Longest(layout)
    tokens = config.data.seq_len
    stretch = "max_seq_len" in {f.name for f in dataclasses.fields(config.model)}
    while tokens <= limit:
        longer = f"{layout},data.seq_len={tokens}" + (
            f",model.max_seq_len={tokens}" if stretch else ""
        )
        row = measure(config, longer, hw, memory_bytes=memory, task=task)
        if not row.ok or not row.fits:
            found.beyond = row
            break
        found.tokens = tokens
        found.row = row
        tokens *= 2
    return found


def format_longest(found: list[Longest], memory: float) -> str:
    """One line per layout: the longest sequence that fits and what twice as long needs."""
    lines = []
    for f in found:
        fits = (
            f"{f.tokens:,} tokens fit ({fmt_value(f.row.mem_total_bytes, 'B')})"
            if f.row
            else "nothing fits"
        )
        b = f.beyond
        after = (
            ""
            if b is None
            else f"; {'twice as many' if f.row else 'the first'} "
            + (
                f"cannot run: {b.error}"
                if not b.ok
                else f"needs {fmt_value(b.mem_total_bytes, 'B')}"
            )
        )
        lines.append(f"{f.layout}: {fits}{after}")
    lines.append(
        f"memory judged against {memory / 1e9:.3g} GB ({fmt_value(memory, 'B')}) per device"
    )
    return "\n".join(lines)


def best(planned: list[Planned]) -> tuple[str, Row] | None:
    """The fastest predicted layout that fits, counting the suggested fixes."""
    options = [(p.row.layout, p.row) for p in planned if p.row.ok and p.row.fits]
    options += [(p.suggestion, p.suggestion_row) for p in planned if p.suggestion_row]
    return min(options, key=lambda o: o[1].predicted_step_time_s, default=None)


def plan_folder(out: str, overwrite: bool = False) -> Path:
    """The ``--out`` folder of ``plan``, checked and created before anything compiles.

    Raises:
      PathError: a run's own folder, a running run's, a file, or a folder holding files
        without ``overwrite``.
    """
    check_new_folder(out, "--out", "plan.csv", overwrite)
    return ensure_dir(out, "--out", "choose another --out folder")
