"""Charts drawn with matplotlib: the pipeline Gantt chart, the sweep chart, `jaxpar plot`.

Figures are checked against the data they draw, recomputed here from the tick table and
the rows (bars per kind and stage, bar lengths, line data, titles, axis labels); written
files are read back (size, format, mode 0644 under a restrictive umask).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from jaxpar import plot
from jaxpar.lab import chart as lab_chart
from jaxpar.lab import hardware, sweep, sweep_files
from jaxpar.pipeline import chart
from jaxpar.pipeline.schedule import simulate
from jaxpar.pipeline.ticks import tick_table

KIND_CODE = {"F": 1, "B": 2, "I": 3, "W": 4, "idle": 0}
LEGEND = {
    "F": "F forward",
    "B": "B backward",
    "I": "I input gradient",
    "W": "W weight gradient",
    "idle": "idle (bubble)",
}


@pytest.fixture
def strict_umask():
    """Files created 0600 unless the writer chmods them."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _bars(container) -> list[tuple[float, float]]:
    """(x centre, y centre) of each bar of a BarContainer (horizontal bars)."""
    return [
        (r.get_x() + r.get_width() / 2, r.get_y() + r.get_height() / 2) for r in container.patches
    ]


# ---- the pipeline schedule ----------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [("zb_h1", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("gpipe", 2, 3, 1)]
)
def test_schedule_figure_draws_the_tick_table(shape):
    table = tick_table(*shape)
    schedule, p, m, v = shape
    fig = chart.figure(table)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {d}" for d in range(p)]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # stage 0 on top
    assert "tick" in ax.get_xlabel() and "stage" in ax.get_ylabel()
    fig.canvas.draw()  # tick labels exist once drawn: whole ticks, labelled, from 0
    shown = [
        (x, t.get_text())
        for x, t in zip(ax.get_xticks(), ax.get_xticklabels())
        if -0.5 <= x <= table.ticks - 0.5
    ]
    assert len(shown) >= 2 and shown[0] == (0, "0")
    assert all(x == int(x) and text == str(int(x)) for x, text in shown)
    # the kinds present, in the order F B I W idle: one bar container and legend entry each
    present = [k for k in ("F", "B", "I", "W", "idle") if (table.kind == KIND_CODE[k]).any()]
    assert (present == ["F", "I", "W", "idle"]) == (schedule == "zb_h1")
    containers = {c.get_label(): c for c in ax.containers}
    assert list(containers) == [LEGEND[k] for k in present]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [LEGEND[k] for k in present]
    for kind in present:
        cells = _bars(containers[LEGEND[kind]])
        per_stage = Counter(round(y) for _, y in cells)
        for d in range(p):
            assert per_stage[d] == int((table.kind[:, d] == KIND_CODE[kind]).sum()), (kind, d)
        # exactly the table's cells of that kind, bar (t, d) centred on tick t of row d
        want = {
            (t, d)
            for t in range(table.ticks)
            for d in range(p)
            if table.kind[t, d] == KIND_CODE[kind]
        }
        assert {(round(x), round(y)) for x, y in cells} == want
        assert all(abs(x - round(x)) < 1e-9 for x, _ in cells)
    # every busy bar carries its microbatch (and chunk letter); nothing on idle bars
    texts = {
        (round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts
    }
    grid = table.grid()
    want = {
        (t, d): f"{a.mb}" + ("" if v == 1 else "abcd"[a.chunk // p])
        for t, row in enumerate(grid)
        for d, a in enumerate(row)
        if a is not None
    }
    assert texts == want


@pytest.mark.parametrize("shape", [("zb_h1", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)])
def test_schedule_title_numbers_are_the_schedule_modules(shape):
    table = tick_table(*shape)
    schedule, p, m, v = shape
    title = chart.figure(table).axes[0].get_title()
    timing = simulate(table.orders, v)
    assert f"schedule {schedule}:" in title and f"p={p}" in title and f"m={m}" in title
    assert f"v={v}" in title and f"{table.ticks} ticks" in title
    assert re.search(r"bubble (\d\.\d{4})", title).group(1) == f"{timing.bubble:.4f}"
    peaks = re.search(r"peak in-flight microbatches per device.*: ([\d. ]+)$", title).group(1)
    assert [float(x) for x in peaks.split()] == [x / v for x in timing.peak_in_flight]
    busy = int((table.kind != 0).sum())
    tick_bubble = 1 - busy / (table.ticks * p)
    drawn = re.search(r"(\d\.\d{4}) of the drawn ticks", title)
    if f"{tick_bubble:.4f}" == f"{timing.bubble:.4f}":  # zb_h1: F = I = W = 1 tick
        assert drawn is None
    else:  # a fused B lasts 2 in UNIT_TIMES, 1 tick in the table
        assert drawn.group(1) == f"{tick_bubble:.4f}"
    # the bubble equals the textbook's for 1F1B with F = 1, B = 2: (p−1)/(m+p−1)
    if schedule == "1f1b":
        assert f"{timing.bubble:.4f}" == f"{(p - 1) / (m + p - 1):.4f}"


def test_schedule_text_is_left_out_where_it_does_not_fit():
    table = tick_table("gpipe", 2, 200, 1)  # 402 ticks on a width-capped figure
    fig = chart.figure(table)
    ax = fig.axes[0]
    assert len(ax.texts) == 0
    assert "too narrow" in fig.legends[0].get_title().get_text()
    assert sum(len(c.patches) for c in ax.containers) == table.ticks * 2


def test_schedule_png_size_mode_and_svg(tmp_path, strict_umask):
    table = tick_table("zb_h1", 4, 8, 1)
    path = chart.write_png(table, tmp_path / "a" / "b" / "zb_h1.png")
    assert path == tmp_path / "a" / "b" / "zb_h1.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _mode(path) == 0o644
    img = matplotlib.image.imread(path)
    fig = chart.figure(table)
    width, height = np.round(fig.get_size_inches() * plot.DPI).astype(int)
    assert img.shape[:2] == (height, width)
    assert width > height > 0
    # the forward colour is in the picture
    blue = np.array([0x43, 0x78, 0xC8]) / 255
    assert (np.abs(img[..., :3] - blue).max(-1) < 0.02).sum() > 100
    # a longer schedule gets a wider picture
    longer = matplotlib.image.imread(
        chart.write_png(tick_table("zb_h1", 4, 16, 1), tmp_path / "long.png")
    )
    assert longer.shape[1] > img.shape[1]
    svg = chart.write_png(table, tmp_path / "zb_h1.svg")
    assert b"<svg" in svg.read_bytes()[:2000] and _mode(svg) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "long.png", "zb_h1.svg"]
    with pytest.raises(ValueError, match=r"'.*zb_h1\.foo'.*\.png.*\.svg"):
        chart.write_png(table, tmp_path / "zb_h1.foo")


def test_text_outputs_are_unchanged():
    table = tick_table("zb_h1", 4, 8, 1)
    assert chart.summary(table).splitlines()[2].startswith("bubble: 0.1111 of p x makespan")
    assert "pipeline zb_h1: 4 stages × 8 microbatches, bubble 0.111" in chart.describe_pipeline(
        table
    )
    said = "pipeline zb_h1 (pipeline.executor=mpmd): 4 stages × 8 microbatches"
    assert chart.describe_pipeline(table, "mpmd").startswith(said)  # the run's start-up line


def test_import_jaxpar_does_not_import_matplotlib():
    code = (
        "import sys, jaxpar, jaxpar.pipeline.chart, jaxpar.lab.chart, jaxpar.plot, "
        "jaxpar.lab.sweep; print('matplotlib' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert out.stdout.strip() == "False"


# ---- the sweep chart ----------------------------------------------------------------------

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "s": 1, "ms": 1e-3, "us": 1e-6}
LABELS = ["data=8", "fsdp=8", "tensor=8"]
PANELS = [
    lab_chart.Panel(
        "peak memory per device", [3 * 2**20, 1.5 * 2**20, None], "B", "bytes per device"
    ),
    lab_chart.Panel("collective bytes", [(2e6, 1.9e6), (1e6, None), None], "B", "bytes"),
    lab_chart.Panel("predicted step time", [0.004, 0.0025, None], "s", "time per step"),
]


def _unit(ax) -> float:
    return UNITS[re.search(r"\((\w+)\)$", ax.get_xlabel()).group(1)]


def _check_panel(ax, panel: lab_chart.Panel) -> None:
    """Titles, axis label, bar lengths × unit = values, value texts."""
    assert ax.get_title(loc="left") == panel.title
    assert ax.get_xlabel().startswith(panel.quantity + " (")
    unit = _unit(ax)
    paired = any(isinstance(v, tuple) for v in panel.values)
    series = (
        [[v[i] if v else None for v in panel.values] for i in (0, 1)] if paired else [panel.values]
    )
    labels = [c.get_label() for c in ax.containers]
    assert (
        labels == ["measured", "predicted"]
        if paired
        else (len(labels) == 1 and labels[0].startswith("_"))
    )  # no legend entry
    assert len(ax.containers) == len(series)
    for container, values in zip(ax.containers, series):
        widths = [r.get_width() * unit for r in container.patches]
        assert widths == pytest.approx([0.0 if x is None else x for x in values], rel=1e-9)
        rows = [r.get_y() + r.get_height() / 2 for r in container.patches]
        assert np.argsort(rows).tolist() == [0, 1, 2]  # label i on row i
    texts = [t.get_text() for t in ax.texts]
    for values in series:
        for x in values:
            if x is not None:
                assert lab_chart.fmt_value(x, panel.unit) in texts
    assert "n/a" in texts


def test_sweep_chart_panels_axes_and_bars():
    fig = lab_chart.chart_figure(LABELS, PANELS)
    assert len(fig.axes) == 3  # the fourth cell of the 2 × 2 grid removed
    for ax, panel in zip(fig.axes, PANELS):
        _check_panel(ax, panel)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == LABELS
    assert fig.axes[0].get_ylim()[0] > fig.axes[0].get_ylim()[1]  # first label on top
    assert fig.axes[0].get_xlabel() == "bytes per device (MiB)"
    assert fig.axes[2].get_xlabel() == "time per step (ms)"
    # a fully missing pair says n/a once, not twice
    assert [t.get_text() for t in fig.axes[1].texts].count("n/a") == 2  # rows 2 and 3
    with pytest.raises(ValueError, match="2 values for 3 labels"):
        lab_chart.chart_figure(LABELS, [("x", [1, 2], "B")])


def test_axis_units():
    assert lab_chart.axis_unit(1000, "B") == (1, "B")
    assert lab_chart.axis_unit(3 * 2**20, "B") == (2**20, "MiB")
    assert lab_chart.axis_unit(2.5 * 2**30, "B") == (2**30, "GiB")
    assert lab_chart.axis_unit(0.5, "s") == (1, "s")
    assert lab_chart.axis_unit(0.004, "s") == (1e-3, "ms")
    assert lab_chart.axis_unit(4e-6, "s") == (1e-6, "us")
    assert lab_chart.axis_unit(7e9, "FLOP") == (1, "FLOP")


def _rows() -> list[sweep.Row]:
    return [
        sweep.Row(
            "data=8",
            mem_args_bytes=10 * 2**20,
            mem_temp_bytes=60 * 2**20,
            mem_total_bytes=70 * 2**20,
            fits=True,
            flops=2.9e9,
            comm_bytes=6e6,
            predicted_comm_bytes=6e6,
            step_time_s=0.45,
            predicted_step_time_s=5.6e-5,
        ),
        sweep.Row(
            "fsdp=8",
            mem_args_bytes=2**20,
            mem_temp_bytes=53 * 2**20,
            mem_total_bytes=54 * 2**20,
            fits=True,
            flops=2.9e9,
            comm_bytes=12e6,
            predicted_comm_bytes=11e6,
            step_time_s=0.46,
            predicted_step_time_s=5.4e-5,
        ),
        sweep.Row("tensor=8", error="heads not divisible"),
    ]


def test_sweep_write_outputs_chart(tmp_path, strict_umask, monkeypatch):
    drawn = []
    save = lab_chart.save_figure
    monkeypatch.setattr(
        lab_chart, "save_figure", lambda fig, path: drawn.append(fig) or save(fig, path)
    )
    rows = _rows()
    paths = sweep_files.write_outputs(rows, hardware.get_profile("h100"), tmp_path)
    png = tmp_path / "sweep.png"
    assert paths[-1] == png and _mode(png) == 0o644
    assert matplotlib.image.imread(png).shape[:2] == tuple(
        np.round(drawn[0].get_size_inches()[::-1] * plot.DPI).astype(int)
    )
    axes = drawn[0].axes
    assert [ax.get_title(loc="left") for ax in axes] == [
        "peak memory per device",
        "collective bytes per step: measured vs predicted",
        "measured step time (this machine)",
        "predicted step time (h100, roofline)",
    ]
    assert [ax.get_xlabel() for ax in axes] == [
        "bytes per device (MiB)",
        "bytes sent per device per step (MiB)",
        "time per step (s)",
        "time per step (ms)",
    ]
    for ax, field in zip(
        axes, ("mem_total_bytes", "comm_bytes", "step_time_s", "predicted_step_time_s")
    ):
        widths = [r.get_width() * _unit(ax) for r in ax.containers[0].patches]
        assert widths == pytest.approx([getattr(r, field) or 0.0 for r in rows])
    predicted = [r.get_width() * _unit(axes[1]) for r in axes[1].containers[1].patches]
    assert predicted == pytest.approx([6e6, 11e6, 0.0])
    # without measured step times the panel is left out; an .svg name writes SVG
    for r in rows:
        r.step_time_s = None
    sweep_files.write_outputs(rows, hardware.get_profile("h100"), tmp_path, chart="sweep.svg")
    assert len(drawn[1].axes) == 3
    assert b"<svg" in (tmp_path / "sweep.svg").read_bytes()[:2000]
    assert _mode(tmp_path / "sweep.svg") == 0o644


# ---- jaxpar plot --------------------------------------------------------------------------


def _write(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    """Two runs: eval in rows of their own + tokens + a truncated last line; eval in the
    train rows, no tokens."""
    a = _write(
        tmp_path / "runs" / "fsdp8",
        [
            {"step": 10, "loss": 3.0, "tokens": 1280, "time": 1.0, "step_time_s": 0.1},
            {"step": 20, "loss": 2.5, "tokens": 2560, "time": 2.0},
            {"step": 20, "time": 2.1, "eval_loss": 2.7, "eval_accuracy": 0.3, "eval_time_s": 0.1},
            {"step": 30, "loss": 2.2, "tokens": 3840, "time": 3.0},
            {"step": 25, "time": 3.1, "eval_loss": 2.4, "eval_time_s": 0.1},
        ],
        tail='{"step": 40, "loss": 2.',
    )
    b = _write(
        tmp_path / "runs" / "data8",
        [
            {"step": 5, "loss": 4.0},
            {"step": 10, "loss": 3.5, "eval_loss": 3.6},
            {"step": 15, "loss": 3.1, "eval_loss": 3.3, "eval_accuracy": 0.5},
        ],
    )
    return a, b


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
    }


def test_plot_figure_has_the_rows_data(runs):
    a, b = runs
    with pytest.warns(UserWarning, match=r"metrics.jsonl:6: skipped the last line, not JSON"):
        curves = [plot.load_run(a), plot.load_run(b)]
    fig = plot.loss_figure(curves)
    by_step, by_tokens = fig.axes
    assert by_step.get_xlabel() == "step" and by_tokens.get_xlabel() == "tokens seen"
    assert by_step.get_ylabel() == "loss"
    assert _lines(by_step) == {
        "fsdp8 train loss": ([10, 20, 30], [3.0, 2.5, 2.2]),
        "fsdp8 eval loss": ([20, 25], [2.7, 2.4]),
        "data8 train loss": ([5, 10, 15], [4.0, 3.5, 3.1]),
        "data8 eval loss": ([10, 15], [3.6, 3.3]),
    }
    # tokens: the train rows' own; an eval row's from its step × tokens per step (128)
    assert _lines(by_tokens) == {
        "fsdp8 train loss": ([1280, 2560, 3840], [3.0, 2.5, 2.2]),
        "fsdp8 eval loss": ([2560, 3200], [2.7, 2.4]),
    }
    assert [t.get_text() for t in by_step.get_legend().get_texts()] == list(_lines(by_step))
    # one colour per run, in both panels
    colour = {line.get_label(): line.get_color() for ax in fig.axes for line in ax.get_lines()}
    assert colour["fsdp8 train loss"] == colour["fsdp8 eval loss"] != colour["data8 eval loss"]


def test_plot_without_tokens_has_one_panel(runs):
    fig = plot.loss_figure([plot.load_run(runs[1])])
    assert len(fig.axes) == 1 and fig.axes[0].get_xlabel() == "step"


def test_plot_command(runs, tmp_path, strict_umask, monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="jaxpar")
    plot.add_parser(parser.add_subparsers(dest="command"))
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["plot", *map(str, runs)])
    assert args.command == "plot" and args.out == "plot.png"
    with pytest.warns(UserWarning, match="truncated"):
        plot.run(args)
    assert "plot written to plot.png" in capsys.readouterr().out
    img = matplotlib.image.imread(tmp_path / "plot.png")
    assert img.shape[1] > img.shape[0] > 100 and _mode(tmp_path / "plot.png") == 0o644
    with pytest.warns(UserWarning, match="truncated"):
        plot.run(parser.parse_args(["plot", *map(str, runs), "--out", "out/cmp.svg"]))
    assert b"<svg" in (tmp_path / "out" / "cmp.svg").read_bytes()[:2000]
    assert _mode(tmp_path / "out" / "cmp.svg") == 0o644


def test_plot_names_repeated_directory_names_by_their_parents(tmp_path):
    rows = [{"step": 1, "loss": 1.0}]
    dirs = [
        _write(tmp_path / "x" / "gpt", rows),
        _write(tmp_path / "y" / "gpt", rows),
        _write(tmp_path / "conv", rows),
    ]
    assert plot.run_names(dirs) == ["x/gpt", "y/gpt", "conv"]


def test_plot_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{missing}: no such run directory.*run.dir"):
        plot.plot_runs([missing], tmp_path / "p.png")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"empty/metrics.jsonl not found.*jaxpar train"):
        plot.plot_runs([empty_dir], tmp_path / "p.png")
    (empty_dir / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty/metrics.jsonl holds no rows"):
        plot.plot_runs([empty_dir], tmp_path / "p.png")
    bad = _write(
        tmp_path / "bad",
        [{"step": 1, "loss": 1.0}],
        tail="{oops\n" + json.dumps({"step": 3, "loss": 0.5}) + "\n",
    )
    with pytest.raises(ValueError, match=r"bad/metrics.jsonl:2: not JSON"):
        plot.plot_runs([bad], tmp_path / "p.png")
    other = _write(tmp_path / "other", [{"step": 1, "acc": 1.0}])
    with pytest.raises(ValueError, match=r"no row has 'loss' or 'eval_loss'.*acc, step"):
        plot.plot_runs([other], tmp_path / "p.png")
    good = _write(tmp_path / "good", [{"step": 1, "loss": 1.0}])
    with pytest.raises(ValueError, match=r"p\.jpeg2"):
        plot.plot_runs([good], tmp_path / "p.jpeg2")
    with pytest.raises(ValueError) as err:
        plot.plot_runs([missing])
    assert "\n" not in str(err.value)  # one line, as the CLI prints it
    assert not (tmp_path / "p.png").exists()
