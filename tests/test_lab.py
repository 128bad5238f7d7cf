"""The layout lab: predictions against compiled programs, the sweep's files, the plan."""

from __future__ import annotations

import csv
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.lab import hardware, predict, sweep, sweep_files, workers
from jaxpar.lab.measure import measure
from jaxpar.lab.plan_text import format_plan
from jaxpar.lab.planner import best, plan
from jaxpar.lock import holder
from jaxpar.run import build
from tests.helpers import GPT_SMALL, grid

MPMD = "pipeline.executor=mpmd"
#: the layouts planned once for the tests below: each axis's collectives, FSDP's in the
#: one-program pipeline, and the sub-mesh executor's
PLANNED = [
    "data=8",
    "fsdp=8",
    "data=4,tensor=2",
    "data=4,stage=2",
    "data=2,fsdp=2,stage=2",
    f"data=4,stage=2,{MPMD}",
]
#: and two crossings of those axes, each measured by itself in the extended tier (tensor
#: in the sub-mesh executor's stages: tests/test_analytic.py's suite predicts it to the
#: byte)
LAYOUTS = grid(
    [
        pytest.param(x, id=x)
        for x in (*PLANNED, "data=2,fsdp=2,tensor=2", f"data=2,tensor=2,stage=2,{MPMD}")
    ],
    set(PLANNED),
)


@pytest.fixture(scope="module")
def h100():
    return hardware.get_profile("h100")


@pytest.fixture(scope="module")
def planned(h100):
    """Each of :data:`PLANNED` of a tiny GPT compiled once (no timing), in worker processes
    (as a plan of :data:`~jaxpar.lab.workers.MIN_FOR_PROCESSES` layouts or more compiles
    them), and ranked, for the tests below."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workers, "MIN_FOR_PROCESSES", len(PLANNED))
        return plan(load_config([], GPT_SMALL), 8, h100, layouts=PLANNED)


@pytest.fixture(scope="module")
def rows(planned):
    return {p.row.layout: p.row for p in planned}


def test_data_and_fsdp_collective_bytes_match_the_textbook(rows):
    for layout in ("data=8", "fsdp=8"):
        row = rows[layout]
        assert row.ok, row.error
        assert row.comm_bytes == pytest.approx(row.predicted_comm_bytes, rel=0.10), layout
    # data parallel: exactly one ring all-reduce of every gradient, 2·7/8 of the parameters
    run_params = rows["data=8"].predicted_comm_bytes / (2 * 7 / 8)
    assert rows["data=8"].all_reduce_bytes == pytest.approx(2 * 7 / 8 * run_params, rel=0.01)
    assert rows["data=8"].all_gather_bytes == 0
    # FSDP: every weight gathered once (embedding, head) or twice (the scanned layers, in
    # the forward and the backward scan) on top of the gradient reduction
    assert 7 / 8 * run_params < rows["fsdp=8"].all_gather_bytes < 2 * 7 / 8 * run_params
    assert rows["fsdp=8"].all_reduce_bytes == pytest.approx(2 * 7 / 8 * run_params, rel=0.01)


@pytest.fixture(scope="module")
def tied_fsdp(h100):
    """A tied-embedding tiny GPT under ``fsdp=8``, compiled once, and its prediction."""
    from jaxpar.run import build

    config = load_config([], [*GPT_SMALL, "model.tie_embeddings=true"])
    run = build(sweep_config(config, "fsdp=8"))
    return sweep.measure(config, "fsdp=8", h100), predict.predict_comm(run, "cpu")


def test_tied_table_is_gathered_once_under_fsdp(tied_fsdp):
    """The lookup and the head read one gather of the tied table (the textbook's count)."""
    row, predicted = tied_fsdp
    assert row.ok, row.error
    assert row.all_gather_bytes == pytest.approx(predicted.by_kind()["all-gather"], rel=0.01)


def test_tied_table_collectives_match_the_textbook_under_fsdp(tied_fsdp):
    """One gather and one gradient reduction of the tied table, as the textbook counts."""
    row, predicted = tied_fsdp
    assert row.ok, row.error
    assert row.comm_bytes == pytest.approx(predicted.total_bytes, rel=0.05)


def test_fsdp_holds_an_eighth_of_the_state(rows):
    ratio = rows["fsdp=8"].mem_args_bytes / rows["data=8"].mem_args_bytes
    assert ratio == pytest.approx(1 / 8, rel=0.08)  # the batch and step scalars add a little


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_matches_its_prediction(request, h100, layout):
    if layout in PLANNED:
        row = request.getfixturevalue("rows")[layout]
    else:  # the extended tier's: measured here as a plan's worker would, with no plan made
        row = measure(load_config([], GPT_SMALL), layout, h100)
    assert row.ok, row.error
    assert row.comm_ratio == pytest.approx(1.0, abs=0.10)
    assert row.mem_args_bytes == pytest.approx(row.predicted_mem_args_bytes, rel=0.01)
    kinds = {
        k
        for k in ("all_reduce", "all_gather", "reduce_scatter", "collective_permute")
        if getattr(row, f"{k}_bytes")
    }
    expected = {
        "data=8": {"all_reduce"},
        "fsdp=8": {"all_reduce", "all_gather"},
        "data=4,stage=2": {"all_reduce", "collective_permute"},
        "data=2,fsdp=2,stage=2": {
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "collective_permute",
        },
        # the sub-mesh executor moves activations with device_put, not collectives
        f"data=4,stage=2,{MPMD}": {"all_reduce"},
    }
    assert kinds == expected.get(layout, kinds)


def test_megatron_term_counts_four_activation_all_reduces_per_layer(rows):
    config = load_config([], GPT_SMALL)
    from jaxpar.run import build

    run = build(sweep_config(config, "data=4,tensor=2"))
    terms = predict.predict_comm(run, "cpu").terms
    act = next(t for t in terms if t.what == "Megatron activation all-reduces")
    layers, rows_per_device = config.model.n_layers, config.train.batch_size // 4
    assert act.times == 4 * layers + 1
    assert act.payload_bytes == rows_per_device * config.data.seq_len * config.model.d_model * 4
    assert rows["data=4,tensor=2"].all_reduce_bytes == pytest.approx(
        sum(t.wire_bytes for t in terms if t.kind == "all-reduce"), rel=0.10
    )


def sweep_config(config, layout):
    from jaxpar.config import apply_overrides

    return apply_overrides(config, sweep.layout_overrides(layout))


def test_reduce_scatter_prediction_for_gpu_moves_less_than_the_cpu_form():
    from jaxpar.run import build

    run = build(sweep_config(load_config([], GPT_SMALL), "fsdp=8"))
    cpu, gpu = predict.predict_comm(run, "cpu"), predict.predict_comm(run, "gpu")
    # the gradients of FSDP-sharded weights: all-reduced (2·7/8·S) on CPU, reduce-scattered
    # (7/8·S) on GPU; b_in [L, F] is not sharded over fsdp and is all-reduced on both
    moved = cpu.by_kind()["all-reduce"] - gpu.by_kind()["all-reduce"]
    assert moved == pytest.approx(2 * gpu.by_kind()["reduce-scatter"])
    assert gpu.by_kind()["all-gather"] == cpu.by_kind()["all-gather"]
    assert gpu.total_bytes < cpu.total_bytes


def test_predicted_step_time_is_the_roofline_of_the_measured_program(rows, h100):
    """A pipeline's collectives are all exposed: compute, then every byte and collective.
    ``data=8`` on a GPU reduces each layer's gradients in the backward scan, overlapped
    with the other layers' backward (on XLA:CPU nothing overlaps): those bytes are hidden
    and count only where they outlast the compute; the rest (the embedding's and head's,
    reduced after the scan) adds. Collectives go at the share of NVLink NCCL reaches."""
    bandwidth = h100.link_bandwidth * h100.links * h100.link_efficiency
    row = rows["data=4,stage=2"]
    traffic = row.mem_args_bytes + row.mem_output_bytes + 2 * row.mem_temp_bytes
    assert row.mem_traffic_bytes == traffic
    # matmuls at no more than the chip's best (its MAMF share), the other kernels after
    best = row.flops / (h100.flops_f32 * h100.matmul_efficiency)
    # (this tiny model's matmuls are memory-bound: slower still, tests/test_kernels.py)
    assert best <= row.predicted_compute_s and row.predicted_elementwise_s > 0
    busy = row.predicted_compute_s + row.predicted_elementwise_s
    compute = max(busy, traffic / h100.hbm_bandwidth)
    assert row.predicted_hidden_s == 0
    assert row.predicted_step_time_s == pytest.approx(
        compute + row.comm_bytes / bandwidth + row.collective_ops * h100.collective_latency
    )
    data = rows["data=8"]
    exposed, hidden = data.predicted_comm_s * bandwidth, data.predicted_hidden_s * bandwidth
    assert exposed + hidden == pytest.approx(data.comm_bytes)
    assert exposed > 0 and hidden > 0  # here the layers hold about half the parameters
    busy = data.predicted_compute_s + data.predicted_elementwise_s
    busy = max(busy, data.predicted_memory_s, data.predicted_hidden_s)
    assert data.predicted_step_time_s == pytest.approx(
        busy + data.predicted_comm_s + data.collective_ops * h100.collective_latency
    )
    # the pipeline does more FLOPs per device per step than data=8 here (bubbles count)
    assert row.flops > data.flops


def test_layouts_enumerate_every_factorization():
    layouts = sweep.all_layouts(8)
    assert len(layouts) == len(set(layouts)) == 35  # ordered 5-way factorizations of 2³
    for layout in layouts:
        degrees = [int(x.split("=")[1]) for x in layout.split(",")]
        assert eval("*".join(map(str, degrees))) == 8
    assert sweep.layout_overrides("fsdp=4,stage=2,model.remat=full") == [
        "mesh.data=1",
        "mesh.stage=2",
        "mesh.fsdp=4",
        "mesh.context=1",
        "mesh.tensor=1",
        "rules.preset=auto",
        "model.remat=full",
    ]
    with pytest.raises(
        ValueError, match="unknown mesh axis 'pipe'.*data, stage, fsdp, context, tensor"
    ):
        sweep.layout_overrides("pipe=2")


def test_sweep_command_writes_csv_md_and_png_and_reports_invalid_layouts(tmp_path, capsys):
    out = tmp_path / "lab"
    code = main(
        [
            "sweep",
            *GPT_SMALL,
            "--layouts",
            "data=8",
            "fsdp=8",
            "tensor=8",
            "data=3",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "tensor=8" in printed and "invalid" in printed
    with (out / "sweep.csv").open() as f:
        table = list(csv.DictReader(f))
    header = list(table[0])
    assert header[: len(sweep_files.COLUMNS)] == list(sweep_files.COLUMNS)
    assert [r["layout"] for r in table] == ["data=8", "fsdp=8", "tensor=8", "data=3"]
    good, bad = table[:2], table[2:]
    for r in good:
        assert float(r["step_time_s"]) > 0 and float(r["mem_total_bytes"]) > 0
        assert r["fits"] == "true" and r["error"] == "" and r["timed_on"] == "cpu"
    assert "heads" in bad[0]["error"] and bad[0]["mem_total_bytes"] == ""
    assert "mesh" in bad[1]["error"] and "8" in bad[1]["error"]
    assert float(good[1]["mem_args_bytes"]) < float(good[0]["mem_args_bytes"]) / 4
    md = (out / "sweep.md").read_text()
    assert sum(line.startswith("| ") for line in md.splitlines()) == 5  # header + 4 rows
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "sweep.png").stat().st_mode & 0o777 == 0o644  # readable by others


def _stopping_after(monkeypatch, first: int | None, asked: list, out=None):
    """``measure_all`` that gives each layout an invalid row (its reason names it), records
    the layouts it was asked for, and stops (Ctrl-C) after ``first`` rows (None: never);
    each row is on disk in ``out`` as soon as it is measured (SIGKILL loses none)."""
    from jaxpar.lab.measure import Row
    from jaxpar.lab.resume import PARTIAL

    def measure_all(config, layouts, hw, memory, task, done, steps):
        asked.append(list(layouts))
        rows = []
        for i, layout in enumerate(layouts):
            if i == first:
                raise KeyboardInterrupt
            rows.append(Row(layout, hardware=hw.key, error=f"reason of {layout}"))
            done(rows[-1])
            assert out is None or f"reason of {layout}" in (out / PARTIAL).read_text()
        return rows

    monkeypatch.setattr(sweep, "measure_all", measure_all)


def test_a_stopped_sweep_keeps_its_rows_and_the_same_command_measures_the_rest(
    monkeypatch, tmp_path, capsys
):
    """Ctrl-C after a sweep's first layout: the rows measured are printed and kept in the
    sweep's folder (a timed sweep's minutes are not lost), no output is written, the
    command stops as every command does (one line, status 130); the same command measures
    only the other layouts and writes all rows in order, the kept file gone."""
    from jaxpar.lab.resume import PARTIAL
    from jaxpar.lock import LOCK

    asked: list = []
    out = tmp_path / "sweep"
    _stopping_after(monkeypatch, 1, asked, out)
    command = ["sweep", *GPT_SMALL, "--layouts", "data=8", "fsdp=8", "tensor=8", "--out", str(out)]
    assert main(command) == 130
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == [LOCK, PARTIAL]  # the lock: emptied
    assert "measured before the stop (1 of 3 layouts, kept in" in captured.out
    assert "the same command measures only the other 2" in captured.out
    assert "data=8  invalid: reason of data=8" in captured.out and "fsdp=8 " not in captured.out
    assert captured.err.strip().endswith("before it finished: run the same command again")

    _stopping_after(monkeypatch, None, asked)
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert asked[-1] == ["fsdp=8", "tensor=8"]
    assert "resuming: 1 of 3 layouts were measured by a stopped run" in printed
    with open(out / "sweep.csv") as f:
        assert [r["layout"] for r in csv.DictReader(f)] == ["data=8", "fsdp=8", "tensor=8"]
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.md", "sweep.png"]


def test_a_stopped_sweeps_rows_are_not_mixed_into_another_commands(monkeypatch, tmp_path, capsys):
    """The kept rows name the command: an --out holding another command's is refused in one
    line naming the setting that differs; --overwrite measures every layout again; the
    default folder of another command passes over them to the next free folder, and that of
    the same command finishes them."""
    asked: list = []
    _stopping_after(monkeypatch, 1, asked)
    run = tmp_path / "run"

    def sweep_(*more: str) -> int:
        return main(["sweep", *GPT_SMALL, f"run.dir={run}", *more, "--layouts", "data=8", "fsdp=8"])

    assert sweep_() == 130
    capsys.readouterr()
    assert sweep_("train.batch_size=8", "--out", str(run / "sweep")) == 2
    err = capsys.readouterr().err.strip()
    assert "of another command (config.train.batch_size was 16 there, is 8 here)" in err
    assert err.endswith("or pass --overwrite to measure these layouts afresh") and "\n" not in err

    _stopping_after(monkeypatch, None, asked)
    assert sweep_("train.batch_size=8") == 0
    assert asked[-1] == ["data=8", "fsdp=8"] and (run / "sweep-2" / "sweep.csv").exists()
    # another list of layouts is another command: its rows stay for the stopped one (they
    # were dropped from the file, and lost)
    other = ["sweep", *GPT_SMALL, f"run.dir={run}", "--layouts", "tensor=8", "tensor=8"]
    assert main(other) == 0
    assert asked[-1] == ["tensor=8"]  # named twice, measured once (with a note)
    assert "a layout named twice in --layouts is measured once" in capsys.readouterr().out
    assert (run / "sweep-3" / "sweep.csv").exists()
    # a write a SIGKILL cut short leaves its temporary file: the rows are still resumed
    (run / "sweep" / ".sweep.partial.json.x1y2.tmp").write_text("{")
    assert sweep_() == 0
    assert asked[-1] == ["fsdp=8"] and (run / "sweep" / "sweep.csv").exists()
    assert sweep_("--overwrite") == 0
    assert asked[-1] == ["data=8", "fsdp=8"]


@pytest.fixture
def hold():
    """``hold(folder)``: another live process takes ``folder``'s lock, as a running sweep
    holds its folder (:func:`jaxpar.lab.resume.holding`); the holders are stopped after
    the test."""
    holders = []

    def take(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        code = (
            "import sys, time; from jaxpar.lock import RunDirLock; "
            "RunDirLock(sys.argv[1], '--out').acquire(); print('held', flush=True); "
            "time.sleep(120)"
        )
        holders.append(
            subprocess.Popen(
                [sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True
            )
        )
        assert holders[-1].stdout.readline().strip() == "held"

    yield take
    for process in holders:
        process.kill()
        process.wait()


def test_a_sweep_into_the_folder_a_running_sweep_holds_is_refused(
    monkeypatch, tmp_path, hold, capsys
):
    """The same command started again while the first still runs (a job submitted twice)
    would measure every layout again and write over the first's rows: refused in one line
    naming the holder, before anything is measured — at its --out, and at the default
    folder, whether the first has measured a row there yet or not."""
    asked: list = []
    _stopping_after(monkeypatch, 1, asked)
    stopped, fresh = tmp_path / "stopped", tmp_path / "fresh"

    def sweep_(*more: str) -> int:
        return main(["sweep", *GPT_SMALL, *more, "--layouts", "data=8", "fsdp=8"])

    assert sweep_(f"run.dir={stopped}") == 130  # a row kept in stopped/sweep
    hold(tmp_path / "out")
    hold(fresh / "sweep")  # no row measured yet
    hold(stopped / "sweep")  # the same command's row there
    capsys.readouterr()
    for more in (["--out", str(tmp_path / "out")], [f"run.dir={fresh}"], [f"run.dir={stopped}"]):
        assert sweep_(*more) == 2
        err = capsys.readouterr().err.strip()
        assert "is being written by another jaxpar sweep (pid" in err and "\n" not in err, err
        assert err.endswith("or give this sweep another --out")
    assert len(asked) == 1 and not {*tmp_path.glob("*/sweep-2")}
    # another command's default folder passes over the held one, whose rows name the first
    _stopping_after(monkeypatch, None, asked)
    assert sweep_(f"run.dir={stopped}", "train.batch_size=8") == 0
    assert (stopped / "sweep-2" / "sweep.csv").exists()
    # what the sweep's lock protects is its folder's files, not the runs below it
    assert holder(tmp_path / "out" / "a_run") is None
    assert holder(tmp_path / "out") is not None


def test_a_sweep_refuses_a_folder_it_cannot_hold(tmp_path, capsys):
    """A system folder and a run's directory are refused as --out before anything is
    planned, each in one line with the fix (a run's directory holds the run's lock)."""
    run = tmp_path / "run"
    assert main(["train", *GPT_SMALL, f"run.dir={run}", "train.steps=1"]) == 0
    capsys.readouterr()
    for out, says in (("/tmp", "system folder"), (str(run), f"e.g. --out {run / 'sweep'}")):
        command = ["sweep", *GPT_SMALL, "--layouts", "data=8", "--out", out, "--overwrite"]
        assert main(command) == 2
        err = capsys.readouterr()
        assert says in err.err and "\n" not in err.err.strip() and "sweeping" not in err.out


def test_a_sweep_holds_its_folder_while_it_measures(monkeypatch, tmp_path):
    """While a sweep measures, another process cannot take its folder (the second of two
    identical jobs is refused, as above); when it ends, the folder holds its outputs only."""
    from jaxpar.lab.measure import Row

    out = tmp_path / "sweep"
    tried = []

    def measure_all(config, layouts, hw, memory, task, done, steps):
        code = (
            "import sys; from jaxpar.lock import RunDirLock, RunDirBusy\n"
            "try: RunDirLock(sys.argv[1], '--out').acquire()\n"
            "except RunDirBusy as err: print(err)"
        )
        probe = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True)
        tried.append(probe.stdout.decode())
        return [Row(layout, hardware=hw.key, error="not measured") for layout in layouts]

    monkeypatch.setattr(sweep, "measure_all", measure_all)
    assert main(["sweep", *GPT_SMALL, "--layouts", "data=8", "--out", str(out)]) == 0
    assert f"--out '{out}' is in use by another jaxpar run (pid" in tried[0], tried
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.md", "sweep.png"]


def test_a_stopped_sweep_of_a_task_file_since_edited_is_another_commands(
    monkeypatch, tmp_path, capsys
):
    """A --task file edited after a stop is another model: its stopped rows are not mixed
    in — an --out holding them is refused naming the file's content, and the default
    folder passes over them."""
    asked: list = []
    _stopping_after(monkeypatch, 1, asked)
    task = tmp_path / "my_task.py"
    task.write_text(Path("examples/research_cnn.py").read_text())
    out = tmp_path / "sweep"
    command = ["sweep", "--task", f"{task}:TASK", "train.batch_size=16", "--out", str(out)]
    assert main([*command, "--layouts", "data=8", "fsdp=8"]) == 130
    capsys.readouterr()
    task.write_text(task.read_text() + "\n# edited\n")
    assert main([*command, "--layouts", "data=8", "fsdp=8"]) == 2
    err = capsys.readouterr().err
    assert "of another command (task.file_sha256 was '" in err, err
    assert asked == [["data=8", "fsdp=8"]]
    # by default: a stop, the file edited, and the same command measures afresh elsewhere
    default = [*command[:-2], f"run.dir={tmp_path / 'run'}", "--layouts", "data=8", "fsdp=8"]
    assert main(default) == 130
    task.write_text(task.read_text() + "# edited again\n")
    _stopping_after(monkeypatch, None, asked)
    assert main(default) == 0
    assert asked[-1] == ["data=8", "fsdp=8"] and (tmp_path / "run" / "sweep-2").is_dir()


def test_sweep_needs_layouts_or_all(capsys):
    assert main(["sweep", *GPT_SMALL]) == 2
    assert "--layouts" in capsys.readouterr().err


def test_plan_ranks_fitting_layouts_and_fixes_one_that_does_not(h100, rows):
    config = load_config([], GPT_SMALL)
    # fsdp=8's compiled peak, as the planned fixture measured it (the same config and
    # profile): room for it, not for data=8
    memory = rows["fsdp=8"].mem_total_bytes * 1.02
    planned = plan(config, 8, h100, memory, ["data=8", "fsdp=8", "tensor=8"])
    by = {p.row.layout: p for p in planned}
    assert by["fsdp=8"].row.fits and not by["data=8"].row.fits
    assert [p.row.layout for p in planned] == ["fsdp=8", "data=8", "tensor=8"]
    fix = by["data=8"]
    assert "arguments" in fix.why and "temporaries" in fix.why
    assert fix.suggestion_row is not None and fix.suggestion_row.fits
    assert fix.suggestion_row.mem_total_bytes <= memory < fix.row.mem_total_bytes
    text = format_plan(planned, h100, memory)
    assert f"fits as `{fix.suggestion}`" in text and "tensor=8: cannot run" in text
    top = best(planned)
    assert top[1].fits and top[1].predicted_step_time_s == min(
        r.predicted_step_time_s for r in (by["fsdp=8"].row, fix.suggestion_row)
    )
    assert f"fastest that fits: `{top[0]}`" in text


def test_tiny_model_ranks_data_parallel_first(planned):
    """For a model this small every layout computes for about a microsecond: what tells
    them apart is how many collectives a step runs, each costing the profile's latency
    (α). Data parallelism runs the fewest and comes first; without the α term it would
    not (the bytes alone favour the layouts that shard the most)."""
    assert planned[0].row.layout == "data=8"
    counts = {p.row.layout: p.row.collective_ops for p in planned}
    assert counts["data=8"] == min(counts.values()) < counts["fsdp=8"]
    bytes_only = min(planned, key=lambda p: p.row.predicted_step_time_s - p.row.predicted_latency_s)
    assert bytes_only.row.layout != "data=8"


def test_latency_term_is_the_collectives_the_hlo_executes_times_alpha(h100, rows):
    """FSDP's latency term: the collectives of the compiled step, those inside the
    forward and backward scans counted once per layer, times the profile's α."""
    from jaxpar import hlo
    from jaxpar.lab.measure import compile_lowered, lower, read

    config = load_config([], GPT_SMALL)
    lowered = lower(config, "fsdp=8", h100)
    compiled, seconds = compile_lowered(lowered)
    text = compiled.as_text()
    module = hlo.parse(text)
    loops = [
        (hlo.trip_count(i), re.search(r"body=%?([\w.\-]+)", i.attrs).group(1))
        for insts in module.computations.values()
        for i in insts
        if i.opcode == "while"
    ]
    holding = {
        trips
        for trips, body in loops
        if any(i.opcode in hlo.COLLECTIVES for i in module.computations[body])
    }
    assert holding == {config.model.n_layers}  # the scans over the layers hold them all
    count = sum(
        hlo.count_ops(text, kind, in_loops=False)
        + config.model.n_layers * hlo.count_ops(text, kind, in_loops=True)
        for kind in hlo.COLLECTIVES
    )
    row = read(lowered, compiled, seconds, h100)
    assert row.collective_ops == count == rows["fsdp=8"].collective_ops  # a worker's too
    assert row.predicted_latency_s == pytest.approx(count * h100.collective_latency)
    assert count > 20  # per-layer gathers: the term the bytes alone would leave out


def test_predicted_times_read_in_three_digits(planned, h100):
    from jaxpar.lab.plan_text import fmt_time

    assert [fmt_time(t) for t in (4.2e-5, 1.234e-4, 9.9996e-4, 0.0012345, 0.5, 12.34)] == [
        "42.0 µs",
        "123 µs",
        "1.00 ms",
        "1.23 ms",
        "500 ms",
        "12.3 s",
    ]
    text = format_plan(planned, h100, 80e9)
    assert "0.00 ms" not in text and "fastest that fits: `data=8`, predicted " in text
    assert "µs" in text.splitlines()[2]


def test_a_task_without_a_pipeline_split_is_one_note_not_a_row_per_stage_layout(h100):
    from jaxpar.user_code import load_task

    cnn = load_task("examples/research_cnn.py:TASK")
    config = load_config([], ["train.batch_size=16"])
    planned = plan(
        config, 8, h100, layouts=["data=8", "data=4,stage=2", "data=2,stage=4", "stage=8"], task=cnn
    )
    assert [p.row.layout for p in planned] == ["data=8"]
    assert planned.notes == [
        "note: 3 layouts with mesh.stage > 1 left out: research_cnn "
        "cannot be split into pipeline stages (its task declares "
        "neither Task.layers nor a StageSplit; docs/pipelines.md)"
    ]
    text = format_plan(planned, h100, 80e9)
    assert text.count("note: ") == 1 and "stage=" not in text and "cannot run" not in text


@pytest.mark.parametrize(
    "stderr,error",
    [
        ("", r"its worker process died \(killed by SIGABRT\)"),
        (
            "F0101 00:00:00.0 1 spmd.cc:1] Check failed: a == b",
            r"the XLA compiler aborted compiling this layout \(F0101 .*Check failed: a == b\): "
            r"a compiler bug, not a setting; plan the other layouts, or report it",
        ),
    ],
)
def test_a_worker_that_dies_costs_its_layout_not_the_plan(monkeypatch, h100, stderr, error):
    """A layout on which the compiler aborts its process (an XLA ``Check failed``) is a row
    saying so; the other layouts go on in new workers, in the order given."""
    import sys

    dies = (
        f"import os, sys; sys.stdin.buffer.read(1); sys.stderr.write({stderr!r}); "
        "sys.stderr.flush(); os.abort()"
    )
    monkeypatch.setattr(workers, "WORKER", [sys.executable, "-c", dies])
    found = workers.measure_all(
        load_config([], GPT_SMALL), ["data=8", "fsdp=8", "data=2"], h100, processes=True, workers=2
    )
    assert [r.layout for r in found] == ["data=8", "fsdp=8", "data=2"]
    for row in found:
        assert re.fullmatch(error, row.error), row.error


def test_a_program_xla_cpu_refuses_is_its_layouts_row(monkeypatch, h100):
    """XLA:CPU refuses some programs of thousands of simulated devices (Llama-3-70B's at
    fsdp=512,tensor=8 on 4,096: "Multiprocess computations aren't implemented on the CPU
    backend"): that layout's row says so and where to estimate it; the others are read."""
    import jax

    real, by_layout, compiling = jax.stages.Lowered.compile, workers.compile_lowered, []

    def compile_(self, *args, **kwargs):
        if compiling[-1] == "fsdp=8":
            raise jax.errors.JaxRuntimeError(
                "INVALID_ARGUMENT: Multiprocess computations aren't implemented on the CPU backend."
            )
        return real(self, *args, **kwargs)

    def compile_lowered(lowered, *args):
        compiling.append(lowered.row.layout)
        return by_layout(lowered, *args)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)
    monkeypatch.setattr(workers, "compile_lowered", compile_lowered)
    found = workers.measure_all(
        load_config([], GPT_SMALL), ["data=8", "fsdp=8"], h100, processes=False, workers=1
    )
    assert found[0].ok and found[0].error == ""
    assert found[1].error == (
        "XLA:CPU could not compile this layout's step for 8 simulated devices "
        "(INVALID_ARGUMENT: Multiprocess computations aren't implemented on the CPU backend.); "
        "estimate it from the model's shape instead: jaxpar plan … --devices 8 --analytic"
    )


def test_hardware_profiles_load_and_extend(tmp_path):
    profiles = hardware.load_profiles()
    assert {"h100", "h200", "a100", "a100_40", "b200", "gb200"} <= set(profiles)
    h100, a100 = profiles["h100"], profiles["a100"]
    assert h100.peak_flops("bfloat16") == 989.4e12 and h100.interconnect_bandwidth == 450e9
    assert a100.peak_flops("float32") < h100.peak_flops("float32")
    extra = tmp_path / "hw.yaml"
    text = (
        "mychip:\n  name: My chip\n  flops_bf16: 1e15\n  flops_f32: 5e14\n"
        "  hbm_bandwidth: 2e12\n  memory_bytes: 4e10\n  link_bandwidth: 1e11\n"
        "  links: 4\n  network_bandwidth: 1e10\n  collective_latency: 0.125\n"
    )
    extra.write_text(text)
    mine = hardware.get_profile("mychip", extra)
    assert mine.memory_bytes == 4e10 and mine.links == 4
    t = hardware.roofline(
        mine, flops=1e15, traffic_bytes=1e12, comm_bytes=4e11, dtype="bfloat16", collectives=4
    )
    assert (t.compute_s, t.memory_s, t.comm_s, t.latency_s, t.total_s) == (1.0, 0.5, 1.0, 0.5, 2.5)
    assert all(p.collective_latency == 10e-6 for p in profiles.values())  # NCCL's model
    known = "a100, a100_40, a3_high, b200, gb200, h100, h200"
    with pytest.raises(ValueError, match=f"unknown hardware 'tpu'; choose one of {known} or"):
        hardware.get_profile("tpu")
    extra.write_text("bad:\n  name: x\n")
    with pytest.raises(ValueError, match="'bad' lacks .*flops_bf16"):
        hardware.load_profiles(extra)
    # a misspelt field would be left unread: refused, naming the field it resembles
    extra.write_text(text.replace("links: 4", "links: 4\n  link_eficiency: 0.5"))
    with pytest.raises(
        ValueError,
        match="'mychip': unknown field 'link_eficiency' \\(did you mean 'link_efficiency'\\?\\)",
    ):
        hardware.load_profiles(extra)
    with pytest.raises(ValueError, match="unknown hardware 'H100' \\(did you mean 'h100'\\?\\)"):
        hardware.get_profile("H100")


# extended: a timed sweep's workers are the plan's (jaxpar.lab.workers._in_processes), whose
# dead worker costs its layout in the suite's test_a_worker_that_dies_costs_its_layout_not_
# the_plan; the suite times layouts in worker processes in the sweep command's test above
@pytest.mark.exhaustive
def test_a_timed_sweep_loses_only_the_layout_xla_aborts_on(monkeypatch, h100):
    """``jaxpar sweep --steps N`` times each layout in a worker process, one at a time: a
    layout on which the compiler aborts (``context=2,tensor=2,stage=2`` of gpt_tiny under
    JAX 0.10) is a row saying so, and the layouts after it are timed."""
    import sys

    aborts = (
        "import os\nfrom jaxpar.lab import workers\nreal = workers.measure\n"
        "def measure(config, layout, *args, **kwargs):\n"
        "    if layout == 'fsdp=8':\n        os.abort()\n"
        "    return real(config, layout, *args, **kwargs)\n"
        "workers.measure = measure\nworkers._serve()\n"
    )
    monkeypatch.setattr(workers, "WORKER", [sys.executable, "-c", aborts])
    rows = sweep.sweep(load_config([], GPT_SMALL), ["fsdp=8", "data=8"], h100, steps=1)
    assert [r.layout for r in rows] == ["fsdp=8", "data=8"]
    assert re.fullmatch(r"its worker process died \(killed by SIGABRT\)", rows[0].error)
    assert rows[1].ok and rows[1].step_time_s > 0
    assert rows[1].comm_ratio == pytest.approx(1, abs=0.01)


def test_a_users_family_registers_what_the_lab_knows_of_it():
    """The lab's knowledge is registered by family name from the lab's side: a user's
    family gets the base lab until it registers its own; a second, different lab for the
    same name is refused in one line, the same one again is not."""
    from jaxpar.errors import TaskError
    from jaxpar.lab import families
    from jaxpar.lab.terms import LabModel
    from jaxpar.models.family import Family

    class MyLab(LabModel):
        pass

    mine = Family("my_test_family", object, lambda cfg, data: None, lambda cfg: None)
    assert type(families.lab_for(mine)) is LabModel
    assert type(families.lab_for(None)) is LabModel
    lab = MyLab()
    try:
        assert families.register("my_test_family", lab) is lab
        assert families.lab_for(mine) is lab
        assert families.register("my_test_family", lab) is lab
        with pytest.raises(TaskError, match="knows model family 'my_test_family' already"):
            families.register("my_test_family", MyLab())
        with pytest.raises(TaskError, match="knows model family 'gpt' already"):
            families.register("gpt", MyLab())
    finally:
        families._LABS.pop("my_test_family", None)


def test_each_layout_says_its_throughput_utilisation_and_bound(planned, h100):
    """Per layout: tokens per second per device = the global batch's tokens / predicted
    step / devices; MFU = the model's FLOPs for the step (its family's count: the same for
    every layout, pipelines and recomputation included) per device / predicted step / peak;
    the bound is the roofline's largest term, and the terms add up to the predicted step."""
    tokens = 16 * 16  # train.batch_size × data.seq_len
    run = build(load_config([], GPT_SMALL))
    model = run.family.counts(run.config.model, run.data).train_flops_per_example * 16
    for p in planned:
        r = p.row
        step = r.predicted_step_time_s
        assert r.predicted_tokens_per_s_per_device == pytest.approx(tokens / step / 8)
        assert r.predicted_mfu == pytest.approx(model / 8 / step / h100.flops_f32)
        kernels = r.predicted_compute_s + r.predicted_elementwise_s
        terms = {
            "kernels": kernels,
            "memory": r.predicted_memory_s,
            "communication": r.predicted_comm_s,
            "latency": r.predicted_latency_s,
            "hidden": r.predicted_hidden_s,
        }
        busy = max(kernels, r.predicted_memory_s, r.predicted_hidden_s)
        assert step == pytest.approx(busy + r.predicted_comm_s + r.predicted_latency_s)
        largest = max(terms, key=terms.__getitem__)
        if largest == "kernels":  # named by the larger of its two parts
            parts = {"compute": r.predicted_compute_s, "elementwise": r.predicted_elementwise_s}
            largest = max(parts, key=parts.__getitem__)
        assert r.predicted_bound == largest


def test_plan_out_writes_the_ranking_as_csv(tmp_path, capsys):
    """``plan --out DIR`` writes ``plan.csv``: the layouts in the printed ranking's order,
    with the issue's columns; a second run into the same folder needs --overwrite."""
    args = ["plan", *GPT_SMALL, "--devices", "8", "--layouts", "fsdp=8", "data=8"]
    main([*args, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    with open(tmp_path / "plan.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["layout"] for r in rows] == ["data=8", "fsdp=8"]  # data=8 runs fewer collectives
    assert printed.index("1  data=8") < printed.index("2  fsdp=8")
    for column in ("predicted_step_time_s", "predicted_tokens_per_s_per_device", "predicted_mfu"):
        assert all(float(r[column]) > 0 for r in rows)
    assert {r["predicted_bound"] for r in rows} <= {"compute", "memory", "communication", "latency"}
    assert main([*args, "--out", str(tmp_path)]) != 0
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--longest", "--out", str(tmp_path / "longest")]) != 0
    assert "--longest writes no plan.csv: leave out --out" in capsys.readouterr().err


def test_a_fix_keeps_the_layouts_settings_and_two_changes_are_tried_together(h100):
    """Llama-3-70B on 1,024 H100s, estimated: the fix of a layout with sequence parallelism
    and collective matmuls keeps them (moving data into fsdp dropped them, suggesting a
    slower layout); a layout no single change fits is fixed by two together (the plan said
    none fits, though its fsdp twin fits with accumulation)."""
    config = load_config(["configs/llama3_70b.yaml"], ["train.batch_size=1024"])
    sp = "tensor.sequence=true"
    overlapped = f"data=256,tensor=4,{sp},tensor.overlap=collective_matmul"
    two = f"data=128,tensor=8,{sp}"
    ranking = plan(config, 1024, h100, analytic=True, layouts=[overlapped, two])
    by = {p.row.layout: p for p in ranking}
    assert not by[overlapped].row.fits and not by[two].row.fits
    assert by[overlapped].suggestion == f"fsdp=256,tensor=4,{sp},tensor.overlap=collective_matmul"
    fixed = by[two].suggestion_row
    assert fixed is not None and fixed.fits, by[two].suggestion
    assert fixed.layout == f"fsdp=128,tensor=8,{sp},train.grad_accum=2"


def test_a_plan_where_no_layout_can_run_says_so(h100):
    """Every layout refused (a batch the devices do not divide): "no layout can run", not
    "no layout fits"."""
    config = load_config([], GPT_SMALL)
    ranking = plan(config, 8, h100, analytic=True, layouts=["data=3", "tensor=8"])
    text = format_plan(ranking, h100, h100.memory_bytes)
    assert not any(p.row.ok for p in ranking)
    assert text.rstrip().endswith("no layout can run (each row says why)")


def test_a_compiled_plan_of_a_bfloat16_model_for_a_gpu_says_whose_memory_it_is(h100):
    """Compiled here, a bfloat16 model's memory is XLA:CPU's program's (bfloat16 activations
    held as float32): the plan says so for a GPU profile, not for an estimate or float32."""
    bf16 = load_config([], [*GPT_SMALL, "model.dtype=bfloat16"])
    says = "holds bfloat16 activations as float32"
    for config, analytic, noted in ((bf16, False, True), (bf16, True, False)):
        ranking = plan(config, 8, h100, layouts=["data=8"], analytic=analytic)
        assert (says in format_plan(ranking, h100, h100.memory_bytes)) is noted
    ranking = plan(load_config([], GPT_SMALL), 8, h100, layouts=["data=8"])
    assert says not in format_plan(ranking, h100, h100.memory_bytes)


def test_a_plans_hardware_file_and_mesh_overrides_are_not_ignored(tmp_path, capsys):
    """A --hardware-file without --hardware is refused naming its profiles (the plan ran on
    the H100's); mesh.* overrides, which a plan replaces with each layout's, are warned of
    with the --layouts that plans them."""
    profile = hardware.load_profiles()["h100"]
    entry = {k: v for k, v in dataclasses.asdict(profile).items() if k != "key"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"mine": entry}))
    base = ["plan", *GPT_SMALL, "--devices", "8", "--analytic", "--layouts", "data=8"]
    assert main([*base, "--hardware-file", str(tmp_path / "mine.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no --hardware: name the profile to plan on, e.g. --hardware mine" in err
    with pytest.warns(UserWarning, match=r"mesh.tensor=2 has no effect.*--layouts tensor=2"):
        assert main([*base[:4], "mesh.tensor=2", *base[4:]]) == 0


def test_a_rule_some_planned_layouts_cannot_split_is_one_note(h100, recwarn):
    """8 K/V heads over tensor=16 (layouts a plan chose): held whole on each device of the
    group, as the rows count them. A run that names such a layout is warned; a plan says
    it once, as a note, and passes other warnings on."""
    config = load_config(["configs/llama3_8b.yaml"], [])
    ranking = plan(config, 16, h100, analytic=True, layouts=["tensor=16", "data=2,tensor=8"])
    text = format_plan(ranking, h100, h100.memory_bytes)
    assert "note: where a layout splits kv_heads 16 ways, its 8 kv_heads are held whole" in text
    assert not [w for w in recwarn if "do not split" in str(w.message)]
