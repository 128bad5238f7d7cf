"""Pictures of a pipeline tick table: a text grid, a summary and a Gantt chart.

How to read the charts (``p`` devices, ``m`` microbatches, ``v`` chunks per device):

* one row per device — ``stage d`` is device ``d``; for ``v > 1`` it holds the
  chunks ``d, d+p, d+2p, …`` (the interleaved layout);
* one column per tick of :func:`~jaxpar.pipeline.ticks.tick_table`, i.e. the
  schedule played with every action lasting one tick — the table the executor
  scans over;
* a cell is the action the device runs in that tick: ``F3`` forward of
  microbatch 3, ``B3`` its full backward, ``I3`` / ``W3`` the input- and
  weight-gradient halves of a split backward (zero-bubble schedules). For
  ``v > 1`` a letter names the device-local chunk: ``F3a`` is microbatch 3 on
  the device's first chunk (global chunk ``d``), ``F3b`` on its second (global
  chunk ``d + p``), and so on. ``.`` is an idle tick — the bubble.

The chart (:func:`figure`, written by :func:`write_png`) draws the same grid with
matplotlib as a Gantt chart: a bar per cell, coloured by kind — F blue, B green,
I orange, W purple, idle light grey — with a legend of the kinds present, the
microbatch (and for ``v > 1`` the chunk letter) written on each bar where it fits,
tick numbers along the x axis, and the schedule's shape, bubble fraction and peak
in-flight microbatches (the numbers of :func:`summary`) in the title.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.errors import ConfigError
from jaxpar.figures import new_figure, save_figure
from jaxpar.pipeline.schedule import KINDS, Timing, simulate
from jaxpar.pipeline.ticks import TickTable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Bar colour per cell kind, and the legend's name of each kind.
COLOURS = {"F": "#4378c8", "B": "#3f9a4f", "I": "#e88c28", "W": "#8e5bbf", "idle": "#dcdcdc"}
KIND_NAMES = {
    "F": "F forward",
    "B": "B backward",
    "I": "I input gradient",
    "W": "W weight gradient",
    "idle": "idle (bubble)",
}
#: Chart width per tick (inches).
TICK_IN = 0.32
#: Least chart width (inches).
MIN_W_IN = 6.0
#: Most chart width (inches).
MAX_W_IN = 24.0
#: Chart height per stage row (inches).
ROW_IN = 0.42
#: Height of the room around the axes (inches).
EXTRA_H_IN = 1.9
#: Width of the room around the axes (inches).
MARGIN_W_IN = 1.3
#: Font size (points) of the text on the bars.
BAR_FONT_PT = 7.0
#: A digit's width in ems (DejaVu Sans).
CHAR_EM = 0.64
#: Ticks between tick numbers in the text header.
TICK_EVERY = 5


# ---- text ----------------------------------------------------------------------------------


def cell_label(kind: str, mb: int, local_chunk: int, v: int) -> str:
    """The text of one busy cell: ``F3`` for v = 1, ``F3a``/``F3b``/… for v > 1."""
    if v == 1:
        return f"{kind}{mb}"
    suffix = chr(ord("a") + local_chunk) if local_chunk < 26 else f".{local_chunk}"
    return f"{kind}{mb}{suffix}"


def _labels(table: TickTable) -> list[list[str]]:
    """``labels[d][t]``: the cell text of device ``d`` at tick ``t`` (``.`` when idle)."""
    rows = []
    for d in range(table.p):
        row = []
        for t in range(table.ticks):
            k = int(table.kind[t, d])
            row.append(
                "."
                if k == 0
                else cell_label(KINDS[k], int(table.mb[t, d]), int(table.chunk[t, d]), table.v)
            )
        rows.append(row)
    return rows


def _header(first: int, count: int, cell: int, indent: int) -> str:
    """Tick numbers above the columns of ticks ``first … first+count-1``, every TICK_EVERY."""
    line = [" "] * (indent + count * (cell + 1))
    line[:4] = "tick"
    for t in range(first, first + count):
        if t % TICK_EVERY == 0 or t == first:
            text = str(t)
            pos = indent + (t - first) * (cell + 1)
            if pos + len(text) <= len(line) and all(c == " " for c in line[pos : pos + len(text)]):
                line[pos : pos + len(text)] = text
    return "".join(line).rstrip()


def text_grid(table: TickTable, width: int | None = None) -> str:
    """A text chart: one row per device, one column per tick (see the module docstring).

    Args:
      table: from :func:`~jaxpar.pipeline.ticks.tick_table`.
      width: wrap into blocks of ticks so no line is longer than this many
        characters; ``None`` keeps every tick on one line.

    Raises:
      ConfigError: if ``width`` cannot hold even one tick column.
    """
    labels = _labels(table)
    names = [f"stage {d}" for d in range(table.p)]
    cell = max(len(s) for row in labels for s in row)
    indent = max(len(n) for n in names) + 2
    per_block = table.ticks
    if width is not None:
        per_block = (width - indent + 1) // (cell + 1)
        if per_block < 1:
            raise ConfigError(
                f"text_grid width={width} is too narrow for one tick column; "
                f"use width ≥ {indent + cell}"
            )
    blocks = []
    for first in range(0, table.ticks, per_block):
        count = min(per_block, table.ticks - first)
        lines = [_header(first, count, cell, indent)]
        for name, row in zip(names, labels):
            cells = " ".join(s.ljust(cell) for s in row[first : first + count])
            lines.append((name.ljust(indent) + cells).rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _fmt(values) -> str:
    """Numbers separated by spaces, integers without a decimal point."""
    return " ".join(f"{x:g}" for x in values)


def _tick_bubble(table: TickTable) -> tuple[int, float]:
    """(busy cells, idle fraction) of the tick table, where every action lasts one tick."""
    busy_cells = int((table.kind != 0).sum())
    return busy_cells, 1.0 - busy_cells / (table.ticks * table.p)


def summary(table: TickTable) -> str:
    """Shape, bubble, idle time, peak in-flight activations and buffer slots, as text lines."""
    timing = simulate(table.orders, table.v)
    busy_cells, tick_bubble = _tick_bubble(table)
    peaks = timing.peak_in_flight
    shape = (
        f"schedule {table.schedule}: p={table.p} devices, m={table.m} microbatches, "
        f"v={table.v} chunks per device, {table.ticks} ticks"
    )
    model = (
        "time model: F = I = W = 1, fused B = I + W = 2 (schedule.UNIT_TIMES); "
        "the tick table gives every action one tick"
    )
    bubble = (
        f"bubble: {timing.bubble:.4f} of p x makespan (UNIT_TIMES, makespan "
        f"{timing.makespan:g}); tick table {tick_bubble:.4f} "
        f"({busy_cells} busy of {table.ticks * table.p} cells)"
    )
    peak = (
        f"peak in-flight activations per device (UNIT_TIMES): chunks {_fmt(peaks)}; "
        f"stages (chunks / v) {_fmt(x / table.v for x in peaks)}"
    )
    slots = (
        f"buffer slots per device: activations {table.act_slots}, gradients "
        f"{table.grad_slots} (plus one trash slot each)"
    )
    idle = f"idle time per device (UNIT_TIMES): {_fmt(timing.idle)}"
    lines = [shape, model, bubble, idle, peak, slots]
    return "\n".join(lines)


def describe_pipeline(table: TickTable, executor: str = "") -> str:
    """One line for a run's start-up: schedule, ``executor`` (``spmd``, ``mpmd``), shape,
    bubble, peak activations."""
    timing = simulate(table.orders, table.v)
    run_by = f" (pipeline.executor={executor})" if executor else ""
    return (
        f"pipeline {table.schedule}{run_by}: {table.p} stages × {table.m} microbatches"
        + (f" × {table.v} virtual stages" if table.v > 1 else "")
        + f", bubble {timing.bubble:.3f}, peak in-flight activations "
        f"{max(timing.peak_in_flight) / table.v:g} stages' worth per device "
        "(`jaxpar pipeline` draws the schedule)"
    )


# ---- the Gantt chart -----------------------------------------------------------------------


def chart_title(table: TickTable, timing: Timing | None = None) -> str:
    """The chart's two title lines: shape; bubble and peak in-flight microbatches.

    The numbers are :func:`summary`'s: the bubble of
    :func:`~jaxpar.pipeline.schedule.simulate` under ``UNIT_TIMES`` (and the drawn
    table's own idle share when it differs), the peak in-flight activations per device
    in stages' worth (chunks / v) — microbatches when v = 1.
    """
    timing = timing or simulate(table.orders, table.v)
    _, tick_bubble = _tick_bubble(table)
    shape = (
        f"schedule {table.schedule}: p={table.p} stages, m={table.m} microbatches, "
        f"v={table.v} chunk{'s' * (table.v > 1)} per device, {table.ticks} ticks"
    )
    bubble = f"bubble {timing.bubble:.4f} (F = I = W = 1, B = 2)"
    if f"{tick_bubble:.4f}" != f"{timing.bubble:.4f}":
        bubble += f", {tick_bubble:.4f} of the drawn ticks"
    worth = "" if table.v == 1 else " (stages' worth: chunks / v)"
    peaks = _fmt(x / table.v for x in timing.peak_in_flight)
    return f"{shape}\n{bubble}; peak in-flight microbatches per device{worth}: {peaks}"


def _chart_width(ticks: int) -> float:
    """Figure width in inches: TICK_IN per tick plus margins, within [MIN_W_IN, MAX_W_IN]."""
    return min(max(MARGIN_W_IN + ticks * TICK_IN, MIN_W_IN), MAX_W_IN)


def _bar_text(table: TickTable, t: int, d: int) -> str:
    """The text on a busy bar: the microbatch, plus the local chunk's letter for v > 1."""
    label = cell_label("F", int(table.mb[t, d]), int(table.chunk[t, d]), table.v)
    return label[1:]


def _cells_of(table: TickTable, kind: str) -> list[tuple[int, int]]:
    """(tick, device) of every cell of ``kind`` (``"idle"`` for idle ones), tick-major."""
    code = 0 if kind == "idle" else KINDS.index(kind)
    ts, ds = (table.kind == code).nonzero()
    return list(zip(ts.tolist(), ds.tolist()))


def figure(table: TickTable) -> Figure:
    """The schedule as a Gantt chart (see the module docstring), as a matplotlib Figure.

    Bars: one :class:`~matplotlib.container.BarContainer` per kind present (``F``, ``B``,
    ``I``, ``W``, then ``idle``), labelled as in the legend (``"F forward"`` …); bar
    ``(t, d)`` spans ticks ``t ± 0.5`` on row ``d`` (``stage d``, top to bottom).
    """
    width = _chart_width(table.ticks)
    fig = new_figure(width, EXTRA_H_IN + ROW_IN * table.p)
    ax = fig.add_subplot()
    cell_pt = (width - MARGIN_W_IN) * 72.0 / table.ticks
    edge = 0.6 if cell_pt >= 8 else 0.0  # white gaps between bars, unless they would hide them
    present = [k for k in (*KINDS[1:], "idle") if _cells_of(table, k)]
    texts = 0
    for kind in present:
        cells = _cells_of(table, kind)
        ax.barh(
            [d for _, d in cells],
            1.0,
            left=[t - 0.5 for t, _ in cells],
            height=0.8,
            color=COLOURS[kind],
            edgecolor="white",
            linewidth=edge,
            label=KIND_NAMES[kind],
        )
        if kind == "idle":
            continue
        for t, d in cells:
            text = _bar_text(table, t, d)
            if len(text) * CHAR_EM * BAR_FONT_PT <= cell_pt - 2:
                ax.text(t, d, text, ha="center", va="center", fontsize=BAR_FONT_PT, color="white")
                texts += 1
    ax.set_yticks(range(table.p), [f"stage {d}" for d in range(table.p)])
    ax.set_ylim(table.p - 0.5, -0.5)  # stage 0 on top, as in the text grid
    ax.set_xlim(-0.5, table.ticks - 0.5)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("tick (every action lasts one tick, as the executor runs the table)")
    ax.set_ylabel("pipeline stage (device)")
    ax.set_title(chart_title(table), fontsize="medium")
    ax.spines[["top", "right"]].set_visible(False)
    what = "microbatch" if table.v == 1 else "microbatch + local chunk (a = first, …)"
    note = (
        f"text on a bar: {what}"
        if texts
        else "bars too narrow for microbatch numbers: `jaxpar pipeline` prints them as text"
    )
    fig.legend(
        loc="outside lower center",
        ncols=len(present),
        fontsize="small",
        title=note,
        title_fontsize="small",
        frameon=False,
    )
    return fig


def write_png(table: TickTable, path: str | Path) -> Path:
    """Writes the chart of ``table`` at ``path`` (parent folders created), mode 0644.

    The suffix picks the format: ``.png`` (also when there is none), ``.svg``, ``.pdf`` …

    Raises:
      ConfigError: for a suffix matplotlib cannot write.
    """
    return save_figure(figure(table), path)
