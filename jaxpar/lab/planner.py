"""``jaxpar plan``: rank every layout of N devices by predicted step time, without training.

Each layout's step is compiled on simulated devices, several at once
(:func:`jaxpar.lab.workers.measure_all`); layouts are ranked by the roofline step time on
a hardware profile (α-β communication: bytes over the links plus a latency per
collective executed, :mod:`jaxpar.lab.hardware`), those that fit the device memory first.
Layouts the model cannot run (pipeline stages for a model without a stage split, context
parallelism for one without ``Task.context_parallel``) are one note, not a row each
(:mod:`jaxpar.lab.plan_notes`). For a layout that does not fit, the plan says why and
measures the usual fixes (:mod:`jaxpar.lab.plan_fixes`), and suggests the fastest of those
that fit: a measured layout, not a rule of thumb. With ``analytic`` each layout is estimated
from the model's shape instead (:mod:`jaxpar.lab.analytic`); ``--longest`` is
:mod:`jaxpar.lab.longest`.

A compiled row's memory is that of the program XLA compiles for the CPU backend, which
holds bfloat16 activations as float32 and fuses less than a GPU (a note says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jaxpar.config import Config
from jaxpar.files import ensure_dir
from jaxpar.lab.analytic import estimate
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Row
from jaxpar.lab.plan_fixes import fixes, tried, why
from jaxpar.lab.plan_notes import cpu_memory_note, cuttable, soft_rules_once, within_domains
from jaxpar.lab.sweep import count_layouts, default_layouts, microbatched, runnable
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


class Ranking(list):
    """The ranked :class:`Planned` layouts (a list), with ``notes``: what was left out."""

    def __init__(self, planned: list[Planned], notes: list[str]):
        super().__init__(planned)
        self.notes = notes


def _fix(how: Measuring, misfits: list[Planned], rows: dict[str, Row]) -> dict[str, Row]:
    """``rows`` with the fixes of each layout that does not fit measured, and where none of
    them fits, the fixes of the closest (:func:`~jaxpar.lab.plan_fixes.tried`)."""
    config, task = how.config, how.task
    variants = [v for p in misfits for v in fixes(config, p.row.layout, p.row, task)]
    rows = _measure(how, variants, rows, "fixes of the layouts that do not fit")
    again = [v for p in misfits for v in tried(config, p.row, rows, task)]
    return _measure(how, again, rows, "fixes of their fixes that come closest")


def _suggest(config: Config, planned: Planned, rows: dict[str, Row], task: Task | None) -> None:
    """The fastest measured fix of a layout that does not fit (``rows``: every layout
    measured, fixes included; one change, or two where none alone fits), or what to do
    when none fits."""
    variants = tried(config, planned.row, rows, task)
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
            layouts, note = within_domains(layouts, note, hw)
            layouts, note = cuttable(layouts, note, config, task)
        layouts, note = microbatched(config, layouts, note)
    workers = workers or default_workers()
    how = Measuring(config, hw, memory, task, workers, echo, devices if analytic else 0)
    with unused_once(config, layouts, task), soft_rules_once() as held_whole:
        rows = _measure(how, layouts, {})
        planned = [Planned(rows[x]) for x in layouts]
        misfits = [p for p in planned if p.row.ok and not p.row.fits]
        rows = _fix(how, misfits, rows)
    for p in misfits:
        p.why = why(p.row, memory)
        _suggest(config, p, rows, task)

    def key(p: Planned) -> tuple[int, float]:
        group = 0 if p.row.ok and p.row.fits else 1 if p.row.ok else 2
        return group, p.row.predicted_step_time_s or 0.0

    notes = note.splitlines() if note else []
    notes += cpu_memory_note(config, hw, analytic, task) + held_whole
    if analytic and task is not None:
        notes.append(
            "note: a model of your own has no lab module: its activations' collectives "
            "(tensor, context) are not estimated, so such layouts look cheaper than they are"
        )
    return Ranking(sorted(planned, key=key), notes)


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
    count = f"{len(todo)} {what}" if what else count_layouts(len(todo))
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
