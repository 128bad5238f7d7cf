"""Fault injection (issue 16): damaged checkpoints, non-finite updates, shared run dirs,
Ctrl-C, bad inputs and multi-process faults — each through ``jaxpar train`` (or
``launch``, ``export``, ``prepare-data``) with its exit status and its one-line message.

Fast cases run in-process; cases that need a signal, a second process or a look at
everything a process prints start real processes (bounded by timeouts, always cleaned
up) and the slowest are marked ``slow``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import OptimConfig, load_config
from jaxpar.errors import CorruptCheckpoint
from jaxpar.run import build
from tests.helpers import GPT_SMALL, small_file_system
from tests.test_checkpoint import RESUMABLE

ROOT = Path(__file__).resolve().parents[1]
# 8 steps, a checkpoint every 2 (steps 2, 4, 6, 8 all kept)
RUN8 = [*RESUMABLE, "train.steps=8", "checkpoint.keep=4"]


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows(run_dir) if "loss" in r]


def env8() -> dict[str, str]:
    """A child's environment: this process's XLA flags (8 devices, the same compiler
    settings, so its losses equal in-process ones bit for bit)."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def one_line(err: str) -> str:
    """The error output of a failed command, checked to be exactly one line."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("jaxpar: warning")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- damage ------------------------------------------------------------------------------
def _largest_array_file(step_dir: Path) -> Path:
    return max(
        (p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )


def flip(step_dir: Path) -> Path:
    """64 flipped bytes in the middle of the checkpoint's largest array file."""
    path = _largest_array_file(step_dir)
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))
    return path


def truncate(step_dir: Path) -> Path:
    path = _largest_array_file(step_dir)
    os.truncate(path, path.stat().st_size // 2)
    return path


def delete(step_dir: Path) -> Path:
    path = _largest_array_file(step_dir)
    path.unlink()
    return path


DAMAGE = {
    "flipped": (flip, "contents differ from the recorded sha256 (corrupt)"),
    "truncated": (truncate, "bytes, recorded"),
    "deleted": (delete, ": missing"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An 8-step run with checkpoints 2, 4, 6, 8, started in a directory that already held
    an earlier run's metrics and config (but no checkpoint): those are kept aside."""
    run_dir = tmp_path_factory.mktemp("trained")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (run_dir / "config.yaml").write_text("old: true\n")
    out = io.StringIO()
    with _stdout(out):
        assert main(["train", *RUN8, f"run.dir={run_dir}"]) == 0
    assert (
        "held the metrics of an earlier run (steps 1–1) but no checkpoint to continue "
        "it: starting from step 1; the earlier files are kept as metrics.old-1.jsonl and "
        "config.old-1.yaml"
    ) in out.getvalue()
    assert (run_dir / "metrics.old-1.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert (run_dir / "config.old-1.yaml").read_text() == "old: true\n"
    assert [s for s, _ in losses(run_dir)] == list(range(1, 9))
    return run_dir


class _stdout:
    def __init__(self, out: io.StringIO):
        self.out = out

    def __enter__(self):
        self.saved, sys.stdout = sys.stdout, self.out

    def __exit__(self, *exc):
        sys.stdout = self.saved


def test_damaged_checkpoints_fall_back_to_the_newest_good_one_bitwise(
    trained, tmp_path, capsys, recwarn
):
    """Flipped bytes in step 8, a truncated array file in step 6 and a deleted one in step
    4: resume=auto reports each (step, path, what), sets them aside, continues from step 2
    and logs steps 3…8 with the losses of the uninterrupted run, bit for bit. The resumed
    run also drops a cut-short last line of metrics.jsonl, keeps the rows it re-logs in
    metrics.discarded.jsonl, and keeps its changed setting in config.2.yaml."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(trained, run_dir)
    ckpts = run_dir / "checkpoints"
    for step, kind in ((8, "flipped"), (6, "truncated"), (4, "deleted")):
        DAMAGE[kind][0](ckpts / str(step))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # the writer died mid-line
    capsys.readouterr()
    assert main(["train", *RUN8, "checkpoint.keep=5", f"run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    warned = "\n".join(str(w.message) for w in recwarn)
    for step, kind in ((8, "flipped"), (6, "truncated"), (4, "deleted")):
        assert (
            f"the checkpoint of step {step} in {ckpts / str(step)} failed verification: state/"
        ) in warned
        assert DAMAGE[kind][1] in warned
        assert f"moved to {ckpts / f'{step}.corrupt'}" in warned
        assert (ckpts / f"{step}.corrupt").is_dir()
    assert "training continues from step 2" in warned
    assert 'the last line is cut short (\'{"step": 9, "lo\'' in warned
    assert f"resumed from the checkpoint of step 2 in {ckpts}" in out
    assert losses(run_dir) == losses(trained)  # steps 1…8 once each, the same floats
    assert [r["step"] for r in rows(run_dir, "metrics.discarded.jsonl")] == list(range(3, 9))
    assert "checkpoint.keep: 4 → 5 (kept as config.2.yaml; config.yaml is unchanged)" in out
    assert "keep: 5" in (run_dir / "config.2.yaml").read_text()
    assert (run_dir / "config.yaml").read_text() == (trained / "config.yaml").read_text()
    assert sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) == [2, 4, 6, 8]


def test_an_emptied_checkpoint_falls_back_like_a_corrupt_one(trained, tmp_path, capsys, recwarn):
    """Step 8 with every file gone (its directories kept) and step 6 without its record and
    Orbax's metadata (a partial copy): both fail verification, are set aside, and the run
    continues from step 4 to the losses of the uninterrupted run."""
    run_dir = tmp_path / "emptied"
    shutil.copytree(trained, run_dir)
    ckpts = run_dir / "checkpoints"
    for path in (ckpts / "8").rglob("*"):
        if path.is_file():
            path.unlink()
    for name in ("jaxpar_integrity.json", "state/_METADATA"):
        (ckpts / "6" / name).unlink()
    capsys.readouterr()
    assert main(["train", *RUN8, f"run.dir={run_dir}"]) == 0
    warned = "\n".join(str(w.message) for w in recwarn)
    assert (
        f"the checkpoint of step 8 in {ckpts / '8'} failed verification: "
        "jaxpar_integrity.json and state/_METADATA, meta/metadata are missing (the "
        "checkpoint was emptied or only partly copied)"
    ) in warned
    assert (
        f"the checkpoint of step 6 in {ckpts / '6'} failed verification: "
        "jaxpar_integrity.json and state/_METADATA are missing"
    ) in warned
    assert "training continues from step 4" in warned
    assert f"resumed from the checkpoint of step 4 in {ckpts}" in capsys.readouterr().out
    assert losses(run_dir) == losses(trained)


@pytest.fixture(scope="module")
def trainer(trained):
    return build(load_config([], RUN8)).trainer


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_each_damage_is_named_by_step_path_and_file(trained, trainer, tmp_path, kind):
    damage, reason = DAMAGE[kind]
    shutil.copytree(trained / "checkpoints", tmp_path / "ckpt")
    path = damage(tmp_path / "ckpt" / "8")
    ckpt = Checkpointer(tmp_path / "ckpt", trainer.plan)
    try:
        with pytest.raises(CorruptCheckpoint) as err:
            ckpt.restore(8)
        name = str(path.relative_to(tmp_path / "ckpt" / "8"))
        assert str(err.value).startswith(
            f"the checkpoint of step 8 in {tmp_path / 'ckpt' / '8'} failed verification: {name}"
        )
        assert reason in str(err.value)
        state, meta = ckpt.restore(6)  # the others are untouched
        assert meta["step"] == 6 and int(state.step) == 6
    finally:
        ckpt.close()


def test_verification_reads_each_file_once_and_a_missing_record_warns(
    trained, trainer, tmp_path, recwarn
):
    """Restoring hashes every recorded byte exactly once (then Orbax reads them from the
    page cache); a checkpoint without a record (an older jaxpar's) restores with a
    warning; a damaged record fails."""
    shutil.copytree(trained / "checkpoints", tmp_path / "ckpt")
    ckpt = Checkpointer(tmp_path / "ckpt", trainer.plan)
    try:
        ckpt.restore(8)
        record = json.loads((tmp_path / "ckpt" / "8" / "jaxpar_integrity.json").read_text())
        assert ckpt.last_verification.bytes_read == sum(s for s, _ in record["files"].values())
        assert {f.split("/")[0] for f in record["files"]} == {"state", "meta"}
        (tmp_path / "ckpt" / "6" / "jaxpar_integrity.json").unlink()
        state, _ = ckpt.restore(6)
        assert int(state.step) == 6
        assert any("has no integrity record" in str(w.message) for w in recwarn)
        (tmp_path / "ckpt" / "4" / "jaxpar_integrity.json").write_text('{"format": "x"}')
        with pytest.raises(CorruptCheckpoint, match="jaxpar_integrity.json is damaged"):
            ckpt.restore(4)
    finally:
        ckpt.close()


def test_non_finite_values_in_a_checkpoint_fail_verification(trainer, tmp_path):
    state = trainer.init()
    bad = jax.tree.map(lambda x: x, state.params)
    bad["blocks"]["w_in"] = bad["blocks"]["w_in"].at[0, 0, 0].set(np.inf)
    ckpt = Checkpointer(tmp_path / "ckpt", trainer.plan)
    try:
        ckpt.save(1, dataclasses.replace(state, params=bad), {"step": 1})
        ckpt.wait()
        with pytest.raises(
            CorruptCheckpoint,
            match=r"non-finite values \(inf or NaN\) in "
            r"params/blocks/w_in",
        ):
            ckpt.restore(1)
    finally:
        ckpt.close()


def test_a_named_checkpoint_that_fails_is_exit_2_without_fallback(trained, tmp_path, capsys):
    run_dir = tmp_path / "named"
    shutil.copytree(trained, run_dir)
    flip(run_dir / "checkpoints" / "8")
    assert (
        main(["train", *RUN8, "train.steps=10", "checkpoint.resume=8", f"run.dir={run_dir}"]) == 2
    )
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"jaxpar: error: checkpoint.resume=8: the checkpoint of step 8 in "
        f"{run_dir / 'checkpoints' / '8'} failed verification: state/"
    )
    assert "(also held, not verified yet: [2, 4, 6])" in line
    assert (run_dir / "checkpoints" / "8").is_dir()  # nothing is moved for a named one
    assert main(["export", *RUN8, f"run.dir={run_dir}", "--out", str(tmp_path / "p.npz")]) == 2
    assert "failed verification" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "p.npz").exists()


def test_a_refused_resume_changes_nothing(trained, tmp_path, capsys):
    """A resume refused after reading the checkpoint (another seed) leaves config.yaml,
    metrics.jsonl and the checkpoints as they were."""
    run_dir = tmp_path / "refused"
    shutil.copytree(trained, run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert main(["train", *RUN8, "train.steps=10", "run.seed=7", f"run.dir={run_dir}"]) == 2
    assert "saved with run.seed=0" in one_line(capsys.readouterr().err)
    assert {
        p.name: p.read_bytes()
        for p in run_dir.iterdir()
        if p.is_file() and p.name != ".jaxpar.lock"
    } == {k: v for k, v in before.items() if k != ".jaxpar.lock"}
    assert sorted(os.listdir(run_dir / "checkpoints")) == [".jaxpar.lock", "2", "4", "6", "8"]


# ---- guarded updates ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting,text",
    [
        ("optim.lr=1e39", "'optim.lr'=1e+39 overflows float32 (largest 3.403e+38)"),
        ("optim.clip_norm=5e38", "'optim.clip_norm'=5e+38 overflows float32"),
        ("optim.weight_decay=1e40", "'optim.weight_decay'=1e+40 overflows float32"),
        ("optim.eps=1e-50", "'optim.eps'=1e-50 is 0 in float32"),
    ],
)
def test_settings_that_overflow_float32_are_refused(setting, text, capsys):
    """Through `jaxpar train` (exit 2, the key named), and for an OptimConfig built in
    Python, which is validated by the same declaration."""
    assert main(["train", setting]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"jaxpar: error: config key {text}")
    from jaxpar.optim import make_optimizer

    key, value = setting.split("=")
    if key != "optim.eps":  # the float32 zero: its own message, checked above
        with pytest.raises(ValueError, match=f"config key '{key}'=.* overflows float32"):
            make_optimizer(OptimConfig(**{key.split(".")[1]: float(value)}), 10)


NAN_TASK = """
import dataclasses
import jax
import jax.numpy as jnp
import optax
from jaxpar.user_code import load_task

BASE = load_task("{root}/examples/research_cnn.py:TASK")


def nan_updates(first):
    # finite gradients in, NaN updates out from the optimizer's step FIRST on (the count
    # of applied steps: a skipped step does not advance it)
    def init(params):
        return {{"count": jnp.zeros((), jnp.int32)}}

    def update(updates, state, params=None):
        count = state["count"] + 1
        return (jax.tree.map(lambda u: jnp.where(count >= first, jnp.nan, u), updates),
                {{"count": count}})

    return optax.GradientTransformation(init, update)


TASK = dataclasses.replace(BASE, optimizer=optax.chain(BASE.optimizer, nan_updates(2)),
                           name="nan_update")
"""


@pytest.mark.parametrize(
    "policy,status,text",
    [
        (
            "stop",
            3,
            (
                "jaxpar: stopped: non-finite update or new parameters (the loss and "
                "gradients were finite) at step 2"
            ),
        ),
        (
            "skip",
            6,
            (
                "jaxpar: stopped: train.nonfinite=skip: 4 steps were skipped, more than "
                "train.max_skipped=0.1 of train.steps=30, i.e. 3, up to step 5. The first "
                "bad step of this run was 2 (non-finite update or new parameters"
            ),
        ),
    ],
)
def test_a_non_finite_update_is_caught(tmp_path, capsys, policy, status, text):
    """An optimizer that turns finite gradients into NaN updates from step 2 on: the guard
    (on the update and the new parameters) catches it — stop: exit 3 naming step 2; skip:
    every later step is skipped, and the run fails with exit 6 once over train.max_skipped,
    naming the first bad step."""
    task_file = tmp_path / "nan_task.py"
    task_file.write_text(NAN_TASK.format(root=ROOT))
    run_dir = tmp_path / policy
    code = main(
        [
            "train",
            "--task",
            f"{task_file}:TASK",
            "train.batch_size=16",
            "train.log_every=1",
            "train.eval_every=0",
            "train.progress=false",
            "train.steps=30",
            f"train.nonfinite={policy}",
            f"run.dir={run_dir}",
        ]
    )
    assert code == status
    assert one_line(capsys.readouterr().err).startswith(text)
    logged = [r for r in rows(run_dir) if "loss" in r]
    assert logged[0]["finite"] is True or logged[0]["finite"] == 1
    assert all(np.isfinite(r["loss"]) for r in logged)


# ---- one run per directory ---------------------------------------------------------------
# a second end-to-end scenario of a held lock: the lock's refusals (the run dir, a checkpoint
# dir, a folder inside one; the holder named) in every suite in
# tests/test_writes.py::test_a_lock_protects_its_run_not_unrelated_runs_below, a command
# refused in one line with nothing written in
# tests/test_writes.py::test_nothing_is_written_into_a_running_runs_directory
@pytest.mark.exhaustive
def test_a_second_run_in_a_busy_run_dir_is_refused_and_the_first_is_unharmed(tmp_path, capsys):
    """A second run in the run dir, in its checkpoint dir (``checkpoint.dir=<A>/checkpoints``
    from another run dir) or in a directory inside it is refused; the first keeps every
    step."""
    run_dir = (tmp_path / "shared").resolve()
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            *RESUMABLE,
            "train.steps=12",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=env8(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    holder = f"(pid {first.pid} on host {socket.gethostname()}, started "
    ckpts = run_dir / "checkpoints"
    try:
        lock = ckpts / ".jaxpar.lock"
        deadline = time.time() + 120
        while time.time() < deadline and not (lock.exists() and lock.read_text()):
            time.sleep(0.1)
        for where, text in (
            ([f"run.dir={run_dir}"], f"run.dir '{run_dir}' is in use by another jaxpar run "),
            (
                [f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={ckpts}"],
                f"checkpoint.dir '{ckpts}' is in use by another jaxpar run ",
            ),
            (
                [f"run.dir={tmp_path / 'c'}", f"checkpoint.dir={ckpts / 'mine'}"],
                f"checkpoint.dir '{ckpts / 'mine'}' lies inside '{ckpts}', which another "
                "jaxpar run holds ",
            ),
        ):
            assert main(["train", *RESUMABLE, "train.steps=12", *where]) == 2
            line = one_line(capsys.readouterr().err)
            assert line.startswith(f"jaxpar: error: {text}{holder}"), line
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    assert [s for s, _ in losses(run_dir)] == list(range(1, 13))  # each step exactly once
    assert (run_dir / ".jaxpar.lock").read_text() == ""  # released
    assert not (ckpts / "mine").exists()


def test_a_run_refused_before_it_begins_leaves_no_directory_behind(tmp_path, capsys):
    """A layout refused while the run is built (after its directories were locked): no run
    dir, no checkpoint dir is left holding only the lock; an existing one is kept."""
    run_dir, ckpts = tmp_path / "runs" / "bad", tmp_path / "elsewhere" / "ckpts"
    args = ["train", "mesh.data=3", f"run.dir={run_dir}", f"checkpoint.dir={ckpts}"]
    assert main(args) == 2
    assert "mesh" in one_line(capsys.readouterr().err)
    assert not run_dir.exists() and not ckpts.exists()
    run_dir.mkdir()
    assert main(args) == 2
    assert run_dir.is_dir() and os.listdir(run_dir) == [".jaxpar.lock"]


def test_the_lock_of_a_dead_run_is_taken_over_with_a_note(tmp_path, capsys):
    from jaxpar.rundir import RunDirLock

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".jaxpar.lock").write_text(
        json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": time.time()})
    )
    with RunDirLock(tmp_path) as lock:
        assert lock.took_over["pid"] == dead.pid
        assert json.loads((tmp_path / ".jaxpar.lock").read_text())["pid"] == os.getpid()
    assert (
        f"took over the lock {tmp_path / '.jaxpar.lock'} left by a run that is no longer "
        f"running (pid {dead.pid} on host"
    ) in capsys.readouterr().out


# ---- bad inputs: one line, exit status, --debug -------------------------------------------
@pytest.fixture
def readonly_dir(tmp_path):
    """A directory nothing can be written to (a read-only tmpfs for root, whom file modes
    do not stop)."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    ).returncode:
        pytest.skip("running as root without mount: no read-only directory to test with")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, check=False)


def _token_file(tmp_path: Path, change=None) -> Path:
    from jaxpar.data.prepare import prepare_data

    (tmp_path / "text.txt").write_text("hello world, " * 400)
    out = tmp_path / "corpus.tokens"
    prepare_data([tmp_path / "text.txt"], out)
    if change:
        change(out)
    return out


def _high_id(path: Path) -> None:
    tokens = np.fromfile(path, "<u2")
    tokens[123] = 300
    tokens.tofile(path)


def _as_uint32(path: Path) -> None:
    np.fromfile(path, "<u2").astype("<u4").tofile(path)


YAML_CASES = {
    "malformed": (
        b"train:\n  steps: [1, 2\n",
        "line 3, column 1: invalid YAML: expected ',' or ']'",
    ),
    "not_utf8": (b"run:\n  dir: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at line 2)"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "is a binary file, not YAML text"),
    "duplicate": (
        b"train:\n  steps: 3\n  batch_size: 4\n  steps: 5\n",
        "line 4, column 3: key 'steps' appears twice in one mapping (lines 2 and 4)",
    ),
    "tag": (b"train:\n  steps: !foo 3\n", "line 2, column 10: unknown YAML tag '!foo'"),
}


def test_bad_config_file_messages(tmp_path, capsys):
    for case, (content, text) in YAML_CASES.items():
        path = tmp_path / f"{case}.yaml"
        path.write_bytes(content)
        assert main(["train", str(path), f"run.dir={tmp_path / 'run'}"]) == 2, case
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"jaxpar: error: config file '{path}'"), line
        assert text in line, (case, line)
    assert not (tmp_path / "run").exists()  # nothing was written


def test_bad_paths_are_one_line_errors(tmp_path, readonly_dir, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["train", f"run.dir={a_file}"], f"run.dir '{a_file}' is a file, not a directory"),
        (
            ["train", f"run.dir={a_file / 'run'}"],
            f"run.dir '{a_file / 'run'}' cannot be created: '{a_file}' is a file, not a directory",
        ),
        (
            ["train", f"run.dir={readonly_dir / 'run'}"],
            f"run.dir '{readonly_dir / 'run'}' cannot be created: ",
        ),
        (["train", f"run.dir={readonly_dir}"], f"run.dir '{readonly_dir}' is not writable: "),
        (
            ["train", f"run.dir={tmp_path / 'ok'}", f"checkpoint.dir={readonly_dir / 'c'}"],
            f"checkpoint.dir '{readonly_dir / 'c'}' cannot be created: ",
        ),
        (
            ["export", f"checkpoint.dir={tmp_path}", "--out", str(tmp_path)],
            f"--out '{tmp_path}' is a directory",
        ),
        (
            ["export", f"checkpoint.dir={tmp_path}", "--out", str(readonly_dir / "p.npz")],
            f"the folder of --out '{readonly_dir}' is not writable: ",
        ),
        (
            ["prepare-data", str(a_file), "--out", str(tmp_path)],
            f"--out '{tmp_path}' is a directory",
        ),
        (
            ["prepare-data", str(a_file), "--out", str(readonly_dir / "x.tokens")],
            f"the folder of --out '{readonly_dir}' is not writable: ",
        ),
        (
            ["prepare-data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.tokens")],
            f"input '{tmp_path / 'missing.txt'}' does not exist",
        ),
    ]
    why = "permission denied" if os.geteuid() else "it is on a read-only file system"
    for args, text in cases:
        assert main(args) == 2, args
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"jaxpar: error: {text}"), (args, line)
        if str(readonly_dir) in text:
            assert why in line, line


@pytest.mark.parametrize(
    "change,text",
    [
        (_high_id, "holds token id 300 (its largest), at or above its metadata's vocab_size 256"),
        (lambda p: os.truncate(p, p.stat().st_size - 2), "it is truncated"),
        (
            _as_uint32,
            (
                "it holds 5200 uint32 ids: it was written with another dtype than its "
                "metadata's uint16"
            ),
        ),
    ],
    ids=["id_above_vocab", "truncated", "wrong_dtype"],
)
def test_bad_token_files_are_found_when_the_data_is_opened(tmp_path, capsys, change, text):
    path = _token_file(tmp_path, change)
    assert main(["train", *GPT_SMALL, f"data.path={path}", f"run.dir={tmp_path / 'run'}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(path) in line and text in line, line


def test_debug_shows_the_traceback_with_the_same_status(capsys, monkeypatch):
    monkeypatch.setenv("JAXPAR_DEBUG", "0")  # restored afterwards: --debug sets it to 1
    assert main(["train", "optim.lr=1e39", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("jaxpar: error: config key 'optim.lr'")
    monkeypatch.setenv("JAXPAR_DEBUG", "1")
    assert main(["train", "optim.lr=1e39"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (a tmpfs; needs root and mount)."""
    with small_file_system(tmp_path / "small", "1m") as path:
        yield path


# a second end-to-end scenario of a full disk under the checkpoint writer: its handling
# (exit 5, one line naming the directory and its free space, no traceback) in every suite in
# tests/test_checkpoint.py::test_failed_async_save_exits_nonzero_with_the_error, a real full
# tmpfs in tests/test_writes.py::test_a_full_disk_while_plotting_is_exit_5_naming_the_image
@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_full_disk_is_one_line_and_exit_5(small_disk):
    """The checkpoints do not fit a 1 MiB disk: exit 5, one line naming the directory and
    the free space, no traceback from Orbax's writer or anyone else."""
    run_dir = small_disk / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar", "train", *RUN8, f"run.dir={run_dir}"],
        cwd=ROOT,
        env=env8(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 5, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith(("jaxpar: checkpoint error: disk full: ", "jaxpar: disk full: ")), line
    assert str(run_dir) in line and " free there" in line and "No space left on device" in line


# ---- Ctrl-C ------------------------------------------------------------------------------
def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            *RESUMABLE,
            "train.steps=100000",
            *extra,
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=env8(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_rows(run_dir: Path, n: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while (
        time.time() < deadline
        and proc.poll() is None
        and not ((run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= n)
    ):
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()


@pytest.mark.slow
def test_ctrl_c_once_checkpoints_and_the_run_resumes_bitwise(trained, tmp_path):
    run_dir = tmp_path / "ctrl_c"
    proc = _start(run_dir)
    try:
        _wait_rows(run_dir, 2, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 4, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    line = [x for x in err.splitlines() if "checkpoint of step" in x][-1]
    step = int(line.split("checkpoint of step ")[1].split()[0])
    assert line == (
        f"jaxpar: interrupted (Ctrl-C): checkpoint of step {step} written to "
        f"{run_dir / 'checkpoints'}; run the same command to resume"
    )
    target = max(8, step + 2)
    # the resume in this process: it starts from the interrupted child's files alone, with
    # the same floats a child would compute (env8), without a second interpreter's start-up
    assert main(["train", *RUN8, f"train.steps={target}", f"run.dir={run_dir}"]) == 0
    reference = trained
    if target > 8:  # a fast machine ran past the 8-step reference: make a longer one
        reference = tmp_path / "straight"
        assert main(["train", *RUN8, f"train.steps={target}", f"run.dir={reference}"]) == 0
    assert losses(run_dir) == losses(reference)  # each step once, bit for bit


SLOW_STOP_HOOK = """
import time
import jaxpar


class SlowStop(jaxpar.Hook):
    # keeps the process alive for a while after the first Ctrl-C's checkpoint is started
    def on_save(self, ctx, step):
        if ctx.stopping:
            time.sleep(30)
"""


@pytest.mark.slow
def test_ctrl_c_twice_stops_at_once(tmp_path):
    """A second Ctrl-C while the first one's checkpoint is being handled (a hook holds the
    process there for 30 s, so the test does not race the exit): the process ends at once,
    killed by SIGINT, without a traceback."""
    (tmp_path / "slow_stop.py").write_text(SLOW_STOP_HOOK)
    run_dir = tmp_path / "twice"
    proc = _start(run_dir, f"train.hooks=[{tmp_path / 'slow_stop.py'}:SlowStop]")
    try:
        _wait_rows(run_dir, 2, proc)
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:
            if "Ctrl-C: finishing this step" in line:
                break
        time.sleep(1)  # the step finishes, the save starts, the hook sleeps
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        second = time.time()
        _, err = proc.communicate(timeout=60)
        assert time.time() - second < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGINT, err
    assert "Traceback" not in err


# ---- multi-process -----------------------------------------------------------------------
def test_rendezvous_names_missing_processes_busy_ports_and_strangers():
    """jaxpar's rendezvous before jax.distributed (which would abort the process): a
    missing peer is named to everyone who came, a taken port is a clear error, a program
    that is not process 0 is recognised — each within its timeout."""
    from jaxpar.distributed import _rendezvous_coordinator, _rendezvous_peer
    from jaxpar.errors import PortInUse
    from jaxpar.launch import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    errors: dict[str, str] = {}

    def peer():
        try:
            _rendezvous_peer(address, 1, 3, 10)
        except ValueError as err:
            errors["peer"] = str(err)

    thread = threading.Thread(target=peer)
    thread.start()
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        _rendezvous_coordinator(address, address, 3, 2)
    thread.join(timeout=30)
    assert time.monotonic() - start < 10
    assert (
        "only 2 of 3 processes joined the run at "
        + address
        + " within distributed.init_timeout=2 s; missing: process 2"
    ) in str(err.value)
    assert errors["peer"] == str(err.value)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(
            PortInUse, match=f"port {busy.getsockname()[1]} is in use by another program"
        ):
            _rendezvous_coordinator(taken, taken, 2, 5)
        start = time.monotonic()
        with pytest.raises(ValueError, match="did not answer jaxpar's check-in"):
            _rendezvous_peer(taken, 1, 2, 2)
        assert time.monotonic() - start < 10


def test_busy_port_and_missing_peer_through_jaxpar_train(tmp_path):
    """Process 0 of a 2-process run, through `jaxpar train`: on a taken port it exits 2 at
    once; alone it exits 2 after distributed.init_timeout naming process 1 — instead of
    JAX's SIGSEGV / SIGABRT."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        from jaxpar.launch import free_port

        procs = {
            name: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxpar",
                    "train",
                    f"run.dir={tmp_path / name}",
                    f"distributed.coordinator=127.0.0.1:{port}",
                    "distributed.num_processes=2",
                    "distributed.process_id=0",
                    "distributed.init_timeout=1",
                ],
                cwd=ROOT,
                env=env8(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, port in (("busy", taken), ("alone", free_port()))
        }
        try:
            out = {name: proc.communicate(timeout=120) for name, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert procs["busy"].returncode == 2, out["busy"]
    assert one_line(out["busy"][1]).startswith(
        f"jaxpar: error: the coordinator's port {taken} is in use by another program"
    )
    assert procs["alone"].returncode == 2, out["alone"]
    assert "within distributed.init_timeout=1 s; missing: process 1" in one_line(out["alone"][1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_launch_retries_a_port_taken_before_the_coordinator_binds(tmp_path, monkeypatch):
    """The launcher's free port is taken by another program before process 0 binds it:
    the launch starts again on another port and succeeds."""
    from jaxpar import launch as launch_lib

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = iter([taken])
        real = launch_lib.free_port
        monkeypatch.setattr(launch_lib, "free_port", lambda: next(ports, None) or real())
        monkeypatch.setenv("PYTHONPATH", str(ROOT))
        monkeypatch.delenv("XLA_FLAGS", raising=False)
        out = io.StringIO()
        code = launch_lib.launch(
            2,
            ["inspect", *GPT_SMALL, "mesh.fsdp=8", "mesh.data=1"],
            devices_per_process=4,
            out=out,
            grace_s=5,
        )
    text = out.getvalue()
    assert code == 0, text[-3000:]
    assert (
        f"[launch] port {taken} was taken by another program before the "
        "coordinator could listen on it; starting again on another port"
    ) in text


def test_out_of_device_memory_is_one_line_naming_the_fixes():
    """XLA's own out-of-memory error (a real one: 2 TiB asked of this host) is one line
    with what to change (exit 2), not jaxpar's internal error."""
    import jax.numpy as jnp

    from jaxpar.cli.failures import failure_of

    with pytest.raises(Exception) as raised:
        jnp.zeros((2**41,), jnp.uint8).block_until_ready()
    status, line = failure_of(raised.value)
    assert status == 2 and "\n" not in line
    assert line.startswith(
        "jaxpar: error: out of device memory (RESOURCE_EXHAUSTED: Out of "
        "memory allocating 2199023255552 bytes"
    )
    assert "lower train.batch_size" in line and "jaxpar plan" in line
