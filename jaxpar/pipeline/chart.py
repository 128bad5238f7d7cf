"""Pictures of a pipeline tick table: a text grid, a summary and a PNG.

How to read the charts (``p`` devices, ``m`` microbatches, ``v`` chunks per device):

* one row per device — ``stage d`` is device ``d``; for ``v > 1`` it holds the
  chunks ``d, d+p, d+2p, …`` (the interleaved layout);
* one column per tick of :func:`~jaxpar.pipeline.schedule.tick_table`, i.e. the
  schedule played with every action lasting one tick — the table the executor
  scans over;
* a cell is the action the device runs in that tick: ``F3`` forward of
  microbatch 3, ``B3`` its full backward, ``I3`` / ``W3`` the input- and
  weight-gradient halves of a split backward (zero-bubble schedules). For
  ``v > 1`` a letter names the device-local chunk: ``F3a`` is microbatch 3 on
  the device's first chunk (global chunk ``d``), ``F3b`` on its second (global
  chunk ``d + p``), and so on. ``.`` is an idle tick — the bubble.

In the PNG the same grid is drawn as coloured cells: F blue, B green, I orange,
W purple, idle light grey. Lightness cycles with the microbatch index so that
neighbouring microbatches differ; for ``v > 1`` a dark bar along the top of a
cell grows with the local chunk (a short bar for chunk ``a``, the full cell
width for the last chunk). A legend strip at the bottom shows one swatch per
kind present, in the order F, B, I, W, idle.
"""

from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np

from jaxpar.pipeline.schedule import KINDS, TickTable, simulate
from jaxpar.png import write_png_file

#: PNG layout in pixels: cell size, gap between cells, legend strip height.
CELL_W, CELL_H, GAP = 16, 24, 1
SWATCH_W, SWATCH_H, LEGEND_H = 16, 10, 14
#: Height of the chunk bar drawn at the top of a cell when v > 1.
CHUNK_BAR_H = 4
#: Hue (degrees) per action kind; idle is drawn grey.
HUES = {"F": 215.0, "B": 130.0, "I": 32.0, "W": 280.0}
IDLE_RGB = (220, 220, 220)
BACKGROUND_RGB = (255, 255, 255)
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
            row.append("." if k == 0 else cell_label(
                KINDS[k], int(table.mb[t, d]), int(table.chunk[t, d]), table.v))
        rows.append(row)
    return rows


def _header(first: int, count: int, cell: int, indent: int) -> str:
    """Tick numbers above the columns of ticks ``first … first+count-1``, every TICK_EVERY."""
    line = [" "] * (indent + count * (cell + 1))
    line[:4] = "tick"
    for t in range(first, first + count):
        if t % TICK_EVERY == 0 or t == first:
            text, pos = str(t), indent + (t - first) * (cell + 1)
            if pos + len(text) <= len(line) and all(c == " " for c in line[pos:pos + len(text)]):
                line[pos:pos + len(text)] = text
    return "".join(line).rstrip()


def text_grid(table: TickTable, width: int | None = None) -> str:
    """A text chart: one row per device, one column per tick (see the module docstring).

    Args:
      table: from :func:`~jaxpar.pipeline.schedule.tick_table`.
      width: wrap into blocks of ticks so no line is longer than this many
        characters; ``None`` keeps every tick on one line.

    Raises:
      ValueError: if ``width`` cannot hold even one tick column.
    """
    labels = _labels(table)
    names = [f"stage {d}" for d in range(table.p)]
    cell = max(len(s) for row in labels for s in row)
    indent = max(len(n) for n in names) + 2
    per_block = table.ticks
    if width is not None:
        per_block = (width - indent + 1) // (cell + 1)
        if per_block < 1:
            raise ValueError(f"text_grid width={width} is too narrow for one tick column; "
                             f"use width ≥ {indent + cell}")
    blocks = []
    for first in range(0, table.ticks, per_block):
        count = min(per_block, table.ticks - first)
        lines = [_header(first, count, cell, indent)]
        for name, row in zip(names, labels):
            cells = " ".join(s.ljust(cell) for s in row[first:first + count])
            lines.append((name.ljust(indent) + cells).rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _fmt(values) -> str:
    """Numbers separated by spaces, integers without a decimal point."""
    return " ".join(f"{x:g}" for x in values)


def summary(table: TickTable) -> str:
    """Shape, bubble, idle time, peak in-flight activations and buffer slots, as text lines."""
    timing = simulate(table.orders, table.v)
    busy_cells = int((table.kind != 0).sum())
    tick_bubble = 1.0 - busy_cells / (table.ticks * table.p)
    peaks = timing.peak_in_flight
    shape = (f"schedule {table.schedule}: p={table.p} devices, m={table.m} microbatches, "
             f"v={table.v} chunks per device, {table.ticks} ticks")
    model = ("time model: F = I = W = 1, fused B = I + W = 2 (schedule.UNIT_TIMES); "
             "the tick table gives every action one tick")
    bubble = (f"bubble: {timing.bubble:.4f} of p x makespan (UNIT_TIMES, makespan "
              f"{timing.makespan:g}); tick table {tick_bubble:.4f} "
              f"({busy_cells} busy of {table.ticks * table.p} cells)")
    peak = (f"peak in-flight activations per device (UNIT_TIMES): chunks {_fmt(peaks)}; "
            f"stages (chunks / v) {_fmt(x / table.v for x in peaks)}")
    slots = (f"buffer slots per device: activations {table.act_slots}, gradients "
             f"{table.grad_slots} (plus one trash slot each)")
    idle = f"idle time per device (UNIT_TIMES): {_fmt(timing.idle)}"
    lines = [shape, model, bubble, idle, peak, slots]
    return "\n".join(lines)


def describe_pipeline(table: TickTable) -> str:
    """One line for a run's start-up: schedule, shape, bubble, peak activations."""
    timing = simulate(table.orders, table.v)
    return (f"pipeline {table.schedule}: {table.p} stages × {table.m} microbatches"
            + (f" × {table.v} virtual stages" if table.v > 1 else "")
            + f", bubble {timing.bubble:.3f}, peak in-flight activations "
            f"{max(timing.peak_in_flight) / table.v:g} stages' worth per device "
            "(`jaxpar pipeline` draws the schedule)")


# ---- PNG -----------------------------------------------------------------------------------


def kind_rgb(kind: str, mb: int = 0) -> tuple[int, int, int]:
    """The fill colour of a cell: the kind's hue, lightness cycling with the microbatch."""
    if kind == "idle":
        return IDLE_RGB
    lightness = 0.36 + 0.09 * (mb % 4)
    r, g, b = colorsys.hls_to_rgb(HUES[kind] / 360.0, lightness, 0.75)
    return round(r * 255), round(g * 255), round(b * 255)


def image_size(ticks: int, p: int) -> tuple[int, int]:
    """(width, height) in pixels of the chart of a ``[ticks, p]`` table."""
    legend_w = GAP + len(KINDS) * (SWATCH_W + 4 * GAP)
    width = max(GAP + ticks * (CELL_W + GAP), legend_w)
    height = GAP + p * (CELL_H + GAP) + LEGEND_H
    return width, height


def _draw_cell(img: np.ndarray, t: int, d: int, rgb, bar: float) -> None:
    """Fills cell (tick t, device d); ``bar`` > 0 adds a dark top bar that wide (fraction)."""
    x0, y0 = GAP + t * (CELL_W + GAP), GAP + d * (CELL_H + GAP)
    img[y0:y0 + CELL_H, x0:x0 + CELL_W] = rgb
    if bar > 0:
        dark = tuple(int(c * 0.45) for c in rgb)
        img[y0:y0 + CHUNK_BAR_H, x0:x0 + max(1, round(CELL_W * bar))] = dark


def _draw_legend(img: np.ndarray, present: list[str], p: int) -> None:
    """One swatch per present kind along the bottom strip."""
    y0 = GAP + p * (CELL_H + GAP) + (LEGEND_H - SWATCH_H) // 2
    for i, kind in enumerate(present):
        x0 = GAP + i * (SWATCH_W + 4 * GAP)
        img[y0:y0 + SWATCH_H, x0:x0 + SWATCH_W] = kind_rgb(kind)


def render(table: TickTable) -> np.ndarray:
    """The chart as an RGB uint8 array ``[height, width, 3]``."""
    width, height = image_size(table.ticks, table.p)
    img = np.empty((height, width, 3), np.uint8)
    img[:] = BACKGROUND_RGB
    for t in range(table.ticks):
        for d in range(table.p):
            kind = KINDS[int(table.kind[t, d])]
            bar = (int(table.chunk[t, d]) + 1) / table.v if table.v > 1 and kind != "idle" else 0
            _draw_cell(img, t, d, kind_rgb(kind, int(table.mb[t, d])), bar)
    kinds = {KINDS[int(k)] for k in np.unique(table.kind)}
    _draw_legend(img, [k for k in (*KINDS[1:], "idle") if k in kinds], table.p)
    return img


def write_png(table: TickTable, path: str | Path) -> Path:
    """Writes the chart of ``table`` as a PNG at ``path`` (parent folders created)."""
    return write_png_file(render(table), path)
