"""Writes never destroy (issue 46): a command that writes refuses an existing file or a
folder holding files unless told (``--overwrite``), never writes a run's own files or into
a running run's directory, and every refusal is one line (exit 2) with every byte of what
was there unchanged; ``run.dir`` is never a system folder, and a run's lock protects its
own directory, not unrelated runs below it. Also the numbers and files the command line
takes, checked as it reads them. (The export's cases are in tests/test_hf.py.)"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import stat
import time
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.lab import sweep_files
from jaxpar.rundir import RunDirBusy, RunDirLock
from tests.helpers import GPT_SMALL, small_file_system

LAYOUT = ["--layouts", "data=8", "--steps", "0"]


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` and its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A finished run's directory: its config, metrics and a checkpoint folder."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "checkpoints" / "2" / "state").write_bytes(b"\x00weights")
    (run / "config.yaml").write_text("train: {steps: 2}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    return run


def hold(directory: Path, what: str | None = "run.dir") -> int:
    """Takes ``directory``'s lock as another live run would (not this process's own): an
    exclusive flock, the holder's line inside (``what``: its setting; None: a lock file
    that names none)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".jaxpar.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    info = {"pid": 4242, "host": "elsewhere", "started": time.time()}
    os.write(fd, json.dumps(info | ({"what": what} if what else {})).encode())
    return fd


# ---- existing files: refused unless --overwrite ---------------------------------------------
def test_sweep_refuses_a_folder_holding_files_and_overwrite_replaces_only_its_own(tmp_path, capsys):
    out = tmp_path / "lab"
    out.mkdir()
    (out / "notes.txt").write_bytes(b"mine")
    (out / "sweep.csv").write_bytes(b"an earlier sweep")
    before = snapshot(out)
    assert main(["sweep", *GPT_SMALL, *LAYOUT, "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: --out '{out}' is not empty (it holds notes.txt, sweep.csv); choose "
        "an empty or new folder, or pass --overwrite to replace its sweep.csv, sweep.md, "
        "sweep.png"
    )
    assert snapshot(out) == before
    os.umask(old := os.umask(0o077))  # files written through a temporary are 0644 anyway
    try:
        assert main(["sweep", *GPT_SMALL, *LAYOUT, "--out", str(out), "--overwrite"]) == 0
    finally:
        os.umask(old)
    assert (out / "notes.txt").read_bytes() == b"mine"
    assert (out / "sweep.csv").read_text().startswith("layout,")
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt",
        "sweep.csv",
        "sweep.md",
        "sweep.png",
    ]
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.name != "notes.txt"} == {
        0o644
    }


def test_the_default_sweep_folder_is_never_an_earlier_sweeps(tmp_path):
    run = tmp_path / "run"
    (run / "sweep").mkdir(parents=True)
    (run / "sweep" / "sweep.csv").write_bytes(b"first")
    assert sweep_files.output_folder(None, str(run)) == run / "sweep-2"
    assert (run / "sweep-2").is_dir() and (run / "sweep" / "sweep.csv").read_bytes() == b"first"
    assert sweep_files.output_folder(None, str(run), overwrite=True) == run / "sweep"


def test_plot_refuses_an_existing_file_unless_told(run_dir, tmp_path, capsys):
    image = tmp_path / "loss.png"
    image.write_bytes(b"my picture")
    assert main(["plot", str(run_dir), "--out", str(image)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: --out '{image}' exists; choose another path, or pass --overwrite to "
        "replace it"
    )
    assert image.read_bytes() == b"my picture"
    assert main(["plot", str(run_dir), "--out", str(image), "--overwrite"]) == 0
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_pipeline_png_refuses_an_existing_file(tmp_path, capsys):
    png = tmp_path / "schedule.png"
    png.write_bytes(b"my chart")
    assert main(["pipeline", *GPT_SMALL, "mesh.stage=2", "--png", str(png)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: --png '{png}' exists; choose another path, or pass --overwrite to "
        "replace it"
    )
    assert png.read_bytes() == b"my chart"


def test_a_full_disk_while_plotting_is_exit_5_naming_the_image(run_dir, tmp_path, capsys):
    """On a full file system the image is not half-written: exit 5, one line naming it,
    the file it was to replace (--overwrite) unchanged, no temporary file left."""
    with small_file_system(tmp_path / "small", "4k") as small:
        image = small / "loss.png"
        image.write_bytes(b"my picture")
        assert main(["plot", str(run_dir), "--out", str(image), "--overwrite"]) == 5
        assert one_line(capsys.readouterr().err).startswith(
            f"jaxpar: disk full: writing '{image}' failed: No space left on device ("
        )
        assert [p.name for p in small.iterdir()] == ["loss.png"]
        assert image.read_bytes() == b"my picture"


# ---- a run's own files: never, --overwrite or not ---------------------------------------------
@pytest.mark.parametrize(
    "args,target,text",
    [
        (
            ["plot", "{run}", "--out", "{run}/checkpoints/loss.png"],
            "{run}/checkpoints/loss.png",
            "lies in '{run}/checkpoints', a folder of the run in '{run}'",
        ),
        (
            ["sweep", *GPT_SMALL, *LAYOUT, "--out", "{run}/checkpoints"],
            "{run}/checkpoints",
            "lies in '{run}/checkpoints', a folder of the run in '{run}'",
        ),
        (
            ["export", "run.dir={tmp}/other", "--out", "{run}/metrics.jsonl"],
            "{run}/metrics.jsonl",
            "is a file of the run in '{run}'",
        ),
        (
            ["export", "run.dir={tmp}/other", "--out", "{run}/config.yaml"],
            "{run}/config.yaml",
            "is a file of the run in '{run}'",
        ),
    ],
    ids=["plot", "sweep", "export_metrics", "export_config"],
)
def test_a_runs_own_files_are_never_written(run_dir, tmp_path, capsys, args, target, text):
    before = snapshot(run_dir)
    fill = {"run": run_dir, "tmp": tmp_path}
    assert main([a.format(**fill) for a in args] + ["--overwrite"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: --out '{target.format(**fill)}' {text.format(**fill)}, which that "
        "run owns; write it elsewhere"
    )
    assert snapshot(run_dir) == before


# ---- run.dir: never a system folder; the lock's scope --------------------------------------
@pytest.mark.parametrize(
    "setting,what",
    [
        ("run.dir=/", "run.dir '/' is the file system root"),
        ("run.dir=/tmp/..", "run.dir '/tmp/..' is the file system root"),
        ("run.dir=/usr", "run.dir '/usr' is the system folder '/usr'"),
        ("run.dir=~", "run.dir '{home}' is the home folder '{home}'"),
        ("checkpoint.dir=/", "checkpoint.dir '/' is the file system root"),
    ],
    ids=["root", "root_dotdot", "usr", "home", "checkpoint_dir"],
)
def test_a_run_never_takes_a_system_folder(tmp_path, capsys, setting, what):
    home = os.path.expanduser("~")
    setting = setting.replace("~", home)
    key = setting.split("=")[0]
    run = tmp_path / "run"
    args = ["train", *GPT_SMALL, setting] + ([f"run.dir={run}"] if key != "run.dir" else [])
    assert main(args) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: {what.format(home=home)}: a run writes its files into its {key} and "
        f"locks it; give it a folder of its own, e.g. {key}=runs/NAME"
    )
    assert not run.exists() and not Path("/.jaxpar.lock").exists()


def test_a_lock_protects_its_run_not_unrelated_runs_below(tmp_path):
    """A running run's run dir and the folders it writes are refused to a second run; an
    unrelated run in another folder below it is not. A checkpoint dir's lock (or a lock
    file naming no setting) protects everything below it."""
    held, ckpts, old = tmp_path / "held", tmp_path / "ckpts", tmp_path / "old"
    fds = [hold(held), hold(ckpts, "checkpoint.dir"), hold(old, None)]
    try:
        with RunDirLock(held / "runs" / "mine") as lock:  # unrelated: its own run
            assert lock.path.is_file()
        assert not (held / "runs" / "mine").exists()  # removed again: nothing was written
        with pytest.raises(
            RunDirBusy,
            match=(
                f"^run.dir '{held}' is in use by another jaxpar run \\(pid 4242 on host "
                "elsewhere, started "
            ),
        ):
            RunDirLock(held).acquire()
        for inside, parent in [
            (held / "checkpoints" / "x", held),
            (held / "profile", held),
            (ckpts / "mine", ckpts),
            (old / "a" / "b", old),
        ]:
            with pytest.raises(
                RunDirBusy,
                match=(
                    f"^run.dir '{inside}' lies inside '{parent}', which another jaxpar run "
                    "holds \\(pid 4242 on host elsewhere"
                ),
            ):
                RunDirLock(inside).acquire()
            assert not inside.exists()
    finally:
        for fd in fds:
            os.close(fd)


def test_nothing_is_written_into_a_running_runs_directory(run_dir, tmp_path, capsys):
    fd = hold(run_dir)
    try:
        before = snapshot(run_dir)
        out = run_dir / "loss.png"
        assert main(["plot", str(run_dir), "--out", str(out)]) == 2
        assert one_line(capsys.readouterr().err).startswith(
            f"jaxpar: error: --out '{out}' lies in '{run_dir}', which a running jaxpar run "
            "holds (pid 4242 on host elsewhere, started "
        )
        assert snapshot(run_dir) == before
        beside = run_dir / "plots" / "loss.png"  # a folder of its own below the run dir
        assert main(["plot", str(run_dir), "--out", str(beside)]) == 0
        assert beside.read_bytes()[:4] == b"\x89PNG"
    finally:
        os.close(fd)


# ---- what the command line reads: checked as it reads it ------------------------------------
@pytest.mark.parametrize(
    "args,text",
    [
        (
            ["plan", "--devices", "8", "--memory-gb", "-1"],
            "argument --memory-gb: expects a memory size in GB, a number above 0 to 1_000_000, "
            "got '-1'",
        ),
        (
            ["plan", "--devices", "8", "--memory-gb", "nan"],
            "argument --memory-gb: expects a memory size in GB, a number above 0 to 1_000_000, "
            "got 'nan'",
        ),
        (
            ["sweep", "--all", "--memory-gb", "0"],
            "argument --memory-gb: expects a memory size in GB, a number above 0 to 1_000_000, "
            "got '0'",
        ),
        (
            ["launch", "-n", "2", "--grace", "-1", "--", "train"],
            "argument --grace: expects a time in seconds, a number from 0 to 86_400, got '-1'",
        ),
        (
            ["launch", "-n", "2", "--grace", "inf", "--", "train"],
            "argument --grace: expects a time in seconds, a number from 0 to 86_400, got 'inf'",
        ),
        (
            ["plan", "--devices", "8", "--layouts", "data=8", "fsdp=4,pipe=2"],
            "argument --layouts: layout 'fsdp=4,pipe=2': unknown mesh axis 'pipe'; the axes are "
            "data, stage, fsdp, context, tensor (or give a section.key=value override)",
        ),
        (
            ["sweep", "--layouts", "data"],
            "argument --layouts: layout 'data': 'data' must look like axis=N, e.g. fsdp=8",
        ),
    ],
    ids=[
        "memory_negative",
        "memory_nan",
        "memory_zero",
        "grace_negative",
        "grace_inf",
        "unknown_axis",
        "not_axis_n",
    ],
)
def test_command_line_numbers_are_checked_as_they_are_read(capsys, args, text):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: {text}; see jaxpar {args[0]} --help"
    )


@pytest.mark.parametrize("command", ["sweep", "plan"])
@pytest.mark.parametrize(
    "layout,text",
    [
        (
            "data=8,model.remmat=full",
            "unknown config key 'model.remmat' for model.name=gpt: did you mean 'model.remat'?",
        ),
        ("data=eight", "config key 'mesh.data' expects int, got 'eight' (str)"),
    ],
    ids=["key", "value"],
)
def test_a_layout_no_config_takes_is_refused_before_anything_compiles(
    capsys, tmp_path, command, layout, text
):
    """A typo in a layout's key or value is bad input, as an unknown axis is: one line
    naming the layout, exit 2, no folder written (it was an "invalid" row, exit 0)."""
    out = tmp_path / "out"
    devices = ["--devices", "8"] if command == "plan" else ["--steps", "0"]
    code = main([command, *GPT_SMALL, *devices, "--layouts", "data=8", layout, "--out", str(out)])
    assert code == 2 and not out.exists()
    assert one_line(capsys.readouterr().err).startswith(f"jaxpar: error: layout '{layout}': {text}")


@pytest.mark.parametrize(
    "content,text",
    [
        (
            b'mine:\n  name: "My chip\n  flops_bf16: 1',
            ", line 3, column 16: invalid YAML: found unexpected end of stream; fix the file",
        ),
        (b"mine: [1, 2", ", line 1, column 12: invalid YAML: expected ',' or ']'"),
        (b"\xff\xfe", " cannot be read: it is not UTF-8 text"),
    ],
    ids=["truncated_string", "truncated_list", "not_utf8"],
)
def test_a_bad_hardware_file_is_one_line_naming_it(tmp_path, capsys, content, text):
    path = tmp_path / "chips.yaml"
    path.write_bytes(content)
    assert main(["plan", *GPT_SMALL, "--devices", "8", "--hardware-file", str(path)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"jaxpar: error: --hardware-file '{path}'{text}"), line


def test_a_hardware_profile_number_must_be_positive_and_finite(tmp_path, capsys):
    chip = {
        "name": "mine",
        "flops_bf16": 1e15,
        "flops_f32": 5e14,
        "hbm_bandwidth": 3e12,
        "memory_bytes": -80e9,
        "link_bandwidth": 25e9,
        "links": 18,
        "network_bandwidth": 50e9,
        "collective_latency": 1e-5,
    }
    path = tmp_path / "chips.yaml"
    path.write_text(json.dumps({"mine": chip}))
    assert (
        main(
            [
                "plan",
                *GPT_SMALL,
                "--devices",
                "8",
                "--hardware-file",
                str(path),
                "--hardware",
                "mine",
            ]
        )
        == 2
    )
    assert one_line(capsys.readouterr().err) == (
        "jaxpar: error: hardware profile 'mine': memory_bytes=-80000000000.0 must be a "
        "finite number above 0"
    )


def test_the_lock_file_keeps_the_users_umask(tmp_path):
    """The holder record (pid, host) is as private as the user's other files."""
    old = os.umask(0o077)
    try:
        with RunDirLock(tmp_path / "run") as lock:
            mode = stat.S_IMODE(lock.path.stat().st_mode)
    finally:
        os.umask(old)
    assert mode == 0o600


def test_release_empties_the_lock_it_took_even_after_the_folder_moved(tmp_path):
    """A run dir renamed while the run holds it: release empties the moved lock file (no
    false 'took over' note later) and leaves a new file at the old path alone."""
    lock = RunDirLock(tmp_path / "run").acquire()
    (tmp_path / "run").rename(tmp_path / "moved")
    (tmp_path / "run").mkdir()
    other = tmp_path / "run" / lock.path.name
    other.write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    lock.release()
    assert (tmp_path / "moved" / lock.path.name).read_text() == ""
    assert json.loads(other.read_text()) == {"pid": 1, "host": "elsewhere"}


@pytest.mark.parametrize(
    "field,value,unit",
    [
        ("memory_bytes", 48, "bytes, e.g. 80.0e9"),
        ("collective_latency", 15, "seconds, e.g. 1.0e-5"),
        ("flops_bf16", 400, "FLOP/s, e.g. 989.4e12"),
    ],
)
def test_a_hardware_figure_in_the_wrong_unit_is_refused(tmp_path, capsys, field, value, unit):
    """48 for 48 GB, 15 for 15 µs, 400 for 400 TFLOP/s: each planned every layout as NO or
    at steps of minutes; refused naming the field and its unit."""
    from jaxpar.lab import hardware

    entry = dataclasses.asdict(hardware.get_profile("h100")) | {field: value}
    entry.pop("key")
    path = tmp_path / "chips.yaml"
    path.write_text(json.dumps({"mine": entry}))
    command = ["plan", *GPT_SMALL, "--devices", "8", "--hardware-file", str(path)]
    assert main([*command, "--hardware", "mine"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: hardware profile 'mine': {field}={value} is not a machine's figure "
        f"in {unit}; a profile's figures are in FLOP/s, bytes, bytes/s and seconds"
    )
