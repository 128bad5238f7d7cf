"""Pipeline schedules: tick tables, bubbles, peak memory, the validator and the text
charts (the drawn chart: tests/test_charts.py).

Pure NumPy; every expectation is recomputed here, independently of the module, from the
definitions (each action exactly once, dependencies, textbook bubble formulas).
"""

import dataclasses
import functools
from collections import Counter

import numpy as np
import pytest

from jaxpar.pipeline import chart
from jaxpar.pipeline.schedule import KINDS, Action, build, check_shape, simulate
from jaxpar.pipeline.ticks import TickTable, tick_table, validate

PS = (2, 4)
SHAPES = [(s, p, m, 1) for s in ("gpipe", "1f1b", "zb_h1") for p in PS for m in (p, 2 * p, 4 * p)]
SHAPES += [("interleaved", p, m, v) for v in (2, 4) for p in PS for m in (p, 2 * p, 4 * p)]


def _id(shape) -> str:
    s, p, m, v = shape
    return f"{s}-p{p}-m{m}-v{v}"


@functools.cache
def _table(schedule: str, p: int, m: int, v: int) -> TickTable:
    return tick_table(schedule, p, m, v)


def _expected_actions(schedule: str, p: int, m: int, v: int) -> set[tuple[str, int, int]]:
    kinds = ("F", "I", "W") if schedule == "zb_h1" else ("F", "B")
    return {(k, j, c) for k in kinds for j in range(m) for c in range(p * v)}


def _ticks_from_grid(table: TickTable) -> dict[tuple[str, int, int], int]:
    return {tuple(a): t for t, row in enumerate(table.grid()) for a in row if a is not None}


# ---- the tick table -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_every_action_exactly_once(shape):
    table = _table(*shape)
    validate(table)
    grid = table.grid()
    assert len(grid) == table.ticks and all(len(row) == table.p for row in grid)
    counts = Counter(tuple(a) for row in grid for a in row if a is not None)
    assert set(counts) == _expected_actions(*shape)
    assert set(counts.values()) == {1}
    # the arrays the executor scans say the same as the grid, each action on its device
    for t, row in enumerate(grid):
        for d, a in enumerate(row):
            if a is None:
                assert table.kind[t, d] == 0
            else:
                assert a.chunk % table.p == d
                assert (KINDS[table.kind[t, d]], table.mb[t, d], table.chunk[t, d]) == (
                    a.kind,
                    a.mb,
                    a.chunk // table.p,
                )


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_dependencies_hold_in_grid(shape):
    schedule, p, m, v = shape
    tick = _ticks_from_grid(_table(*shape))
    chunks = p * v
    back = "I" if schedule == "zb_h1" else "B"
    for j in range(m):
        for c in range(chunks):
            if c > 0:
                assert tick["F", j, c] >= tick["F", j, c - 1] + 1, (j, c)
            assert tick[back, j, c] >= tick["F", j, c] + 1, (j, c)
            if c < chunks - 1:
                assert tick[back, j, c] >= tick[back, j, c + 1] + 1, (j, c)
            if schedule == "zb_h1":
                assert tick["W", j, c] >= tick["I", j, c] + 1, (j, c)


# ---- bubbles ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_bubble_gpipe_1f1b(schedule, p, k):
    m = k * p
    assert simulate(build(schedule, p, m)).bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_bubble_interleaved(v, p, k):
    m = k * p
    timing = simulate(build("interleaved", p, m, v), v)
    assert timing.bubble == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_zb_h1_idle_is_a_third_of_1f1b(p, k):
    m = k * p
    zb, ofob = simulate(build("zb_h1", p, m)), simulate(build("1f1b", p, m))
    for d in range(p):
        assert zb.idle[d] <= ofob.idle[d] / 3, (d, zb.idle, ofob.idle)
    assert zb.bubble < ofob.bubble


# ---- peak in-flight activations -----------------------------------------------------------


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_peak_gpipe_1f1b_zb_h1(p, k):
    m = k * p
    assert simulate(build("gpipe", p, m)).peak_in_flight[0] == m
    assert simulate(build("1f1b", p, m)).peak_in_flight == [p - d for d in range(p)]
    zb = simulate(build("zb_h1", p, m)).peak_in_flight
    assert max(zb) <= p, zb


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("k", [2, 4])
def test_peak_interleaved_device_0(v, p, k):
    """Device 0 holds v·p + p − 1 chunk activations, i.e. p + (p − 1)/v stages' worth."""
    peak = simulate(build("interleaved", p, k * p, v), v).peak_in_flight[0]
    assert peak == v * p + p - 1
    assert peak / v == pytest.approx(p + (p - 1) / v)


# ---- the validator rejects broken tables --------------------------------------------------


def _corrupt(table: TickTable, **cells) -> TickTable:
    """A copy of ``table`` with array cells overwritten: ``name={(t, d): value}``."""
    arrays = {}
    for name, updates in cells.items():
        a = getattr(table, name).copy()
        for (t, d), value in updates.items():
            a[t, d] = value
        arrays[name] = a
    return dataclasses.replace(table, **arrays)


def test_validate_rejects_shared_live_slot():
    table = tick_table("1f1b", 4, 8)
    validate(table)
    # microbatches 0 and 1 on chunk 0 are both live from tick 1 to B0: give them one slot
    slot0 = int(table.act_slot[table.tick[Action("F", 0, 0)], 0])
    readers = [table.tick[Action(k, 1, 0)] for k in ("F", "B")]
    assert {int(table.act_slot[t, 0]) for t in readers} != {slot0}
    bad = _corrupt(table, act_slot={(t, 0): slot0 for t in readers})
    with pytest.raises(ValueError, match="slot .* is overwritten"):
        validate(bad)


def test_validate_rejects_duplicated_action():
    table = tick_table("1f1b", 4, 8)
    t_src = table.tick[Action("F", 0, 0)]
    t_idle = int(np.flatnonzero(table.kind[:, 0] == 0)[0])
    bad = _corrupt(
        table,
        **{
            name: {(t_idle, 0): getattr(table, name)[t_src, 0]}
            for name in ("kind", "mb", "chunk", "act_slot", "grad_slot")
        },
    )
    with pytest.raises(ValueError, match=r"F0 runs twice"):
        validate(bad)


def test_validate_rejects_swapped_ticks():
    table = tick_table("1f1b", 4, 8)
    d = 3  # the last stage runs F0 and then B0 right after it
    t_f, t_b = table.tick[Action("F", 0, d)], table.tick[Action("B", 0, d)]
    assert t_b == t_f + 1
    names = ("kind", "mb", "chunk", "act_slot", "grad_slot")
    bad = _corrupt(
        table,
        **{
            n: {(t_f, d): getattr(table, n)[t_b, d], (t_b, d): getattr(table, n)[t_f, d]}
            for n in names
        },
    )
    with pytest.raises(ValueError, match=r"B0\.3 at tick \d+ runs before F0\.3"):
        validate(bad)


# ---- shape errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ("pipedream", 4, 8, 1),
            r"unknown pipeline.schedule 'pipedream'; choose one of gpipe, 1f1b",
        ),
        (("1f1b", 1, 8, 1), r"mesh.stage ≥ 2 \(got 1\)"),
        (("interleaved", 4, 8, 1), r"pipeline.virtual_stages ≥ 2 \(got 1\)"),
        (("interleaved", 4, 6, 2), r"mesh.stage=4: pipeline.microbatches=6 is not a multiple of 4"),
        (("1f1b", 4, 8, 2), r"virtual_stages=2 applies to schedule=interleaved only.*=1f1b"),
    ],
)
def test_shape_errors(args, match):
    with pytest.raises(ValueError, match=match):
        check_shape(*args)
    with pytest.raises(ValueError, match=match):
        build(*args)


# ---- charts -------------------------------------------------------------------------------


def _label(a: Action, p: int, v: int) -> str:
    return f"{a.kind}{a.mb}" + ("" if v == 1 else "abcd"[a.chunk // p])


@pytest.mark.parametrize(
    "shape", [("1f1b", 4, 8, 1), ("zb_h1", 2, 4, 1), ("interleaved", 4, 8, 2)], ids=_id
)
def test_text_grid_cells(shape):
    table = _table(*shape)
    _, p, _, v = shape
    rows = [line for line in chart.text_grid(table).splitlines() if line.startswith("stage ")]
    assert [r.split()[1] for r in rows] == [str(d) for d in range(p)]
    grid = table.grid()
    width = max(len(_label(a, p, v)) for g in grid for a in g if a is not None)
    indent = len("stage 0  ")
    for d, row in enumerate(rows):
        cells = row.split()[2:]
        assert cells == [("." if g[d] is None else _label(g[d], p, v)) for g in grid]
        # aligned: cell t starts at the same column on every row
        assert all(row[indent + t * (width + 1)] != " " for t in range(table.ticks))


def test_text_grid_wraps():
    table = _table("interleaved", 4, 8, 2)
    text = chart.text_grid(table, width=60)
    assert max(len(line) for line in text.splitlines()) <= 60
    assert sum(line.startswith("stage 0") for line in text.splitlines()) > 1
    labels = {_label(a, 4, 2) for row in table.grid() for a in row if a is not None}
    tokens = set(text.split())
    assert labels <= tokens
    with pytest.raises(ValueError, match="width=5 is too narrow"):
        chart.text_grid(table, width=5)


def test_summary_numbers():
    text = chart.summary(_table("interleaved", 4, 8, 2))
    assert "schedule interleaved: p=4" in text and "m=8" in text and "v=2" in text
    assert f"bubble: {3 / 19:.4f}" in text
    assert "chunks 11 9 7 5; stages (chunks / v) 5.5 4.5 3.5 2.5" in text
    assert "activations 11, gradients 2" in text
    assert "F = I = W = 1" in text
