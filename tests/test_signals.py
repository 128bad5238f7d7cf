"""Stop signals at any moment of start-up, and right after a resume: one line, the
documented exit status (130 for Ctrl-C, 143 for SIGTERM before training, 4 once a
checkpoint of the current step is written), never a traceback, never a lost interrupt;
the run stays resumable."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import child_env, grid
from tests.test_checkpoint import RESUMABLE, train_here

ROOT = Path(__file__).resolve().parents[1]
STARTING = {
    signal.SIGINT: (
        130,
        "jaxpar: interrupted (Ctrl-C) while starting; nothing was "
        "written: run the same command again",
    ),
    signal.SIGTERM: (
        143,
        "jaxpar: stopped (SIGTERM) while starting; nothing was written: run the same command again",
    ),
}
BEFORE_TRAINING = {
    signal.SIGINT: (
        130,
        "jaxpar: interrupted (Ctrl-C); no checkpoint was written by this "
        "interruption (the complete ones stay usable)",
    ),
    signal.SIGTERM: (
        143,
        "jaxpar: stopped (SIGTERM) before training began: no checkpoint was "
        "written by this stop; run the same command to resume from the last "
        "complete checkpoint",
    ),
}


def _start(run_dir: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            *RESUMABLE,
            f"train.steps={steps}",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=child_env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _guarded(pid: int) -> bool:
    """Whether the command's start-up handlers are installed: SIGTERM, which Python leaves
    alone and ``jaxpar.signals.guard_imports`` sets after SIGINT, is caught (Linux's
    ``/proc/PID/status``). The command imports JAX after that, for seconds."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
    return bool(caught & 1 << (signal.SIGTERM - 1))


def _reached(moment: str, pid: int, run_dir: Path) -> bool:
    if moment == "importing":
        return _guarded(pid)
    lock = run_dir / ".jaxpar.lock"  # taken as the run starts being built
    return lock.exists() and bool(lock.read_text())


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "loss" in r]


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# every suite sends one signal at each moment; the other is `exhaustive` (the same handler)
SIGNALS = [pytest.param(signal.SIGINT, id="2"), pytest.param(signal.SIGTERM, id="15")]


@pytest.mark.parametrize("sig", grid(SIGNALS, {"2"}))
def test_a_stop_signal_during_start_up_is_one_line(tmp_path, sig):
    """Sent while the command imports jaxpar and JAX (as soon as its first statement has
    installed the start-up handlers, however slow the machine), and later while the run is
    built (once the run dir's lock is taken): one line, 130 / 143, nothing left to resume
    wrongly — the same command then trains every step once."""
    for i, moment in enumerate(("importing", "locked")):
        run_dir = tmp_path / f"run{i}"
        proc = _start(run_dir, 4)
        deadline = time.time() + 120
        while time.time() < deadline and not _reached(moment, proc.pid, run_dir):
            time.sleep(0.002)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        status, line = (STARTING if moment == "importing" else BEFORE_TRAINING)[sig]
        assert (proc.returncode, _lines(err)) == (status, [line]), (moment, err)
        train_here(run_dir, 4)  # the same command again, from what the signal left
        assert _steps(run_dir) == [1, 2, 3, 4]


def test_the_command_guards_its_start_up_before_its_own_imports():
    """The command's start-up handlers are installed before ``jaxpar.cli`` imports anything
    of its own: a module it imports already finds them. (On a busy CI machine a Ctrl-C sent
    0.5 s after start landed in those imports, before the handlers, as a traceback.)"""
    probe = textwrap.dedent(
        """
        import signal, sys
        sys.argv[0] = "jaxpar"  # what the console script's process is called
        class Probe:
            def find_spec(self, name, path=None, target=None):
                if name == "jaxpar.cli.failures":
                    print([signal.getsignal(s).__name__ for s in (signal.SIGINT, signal.SIGTERM)])
        sys.meta_path.insert(0, Probe())
        import jaxpar.cli
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.split("\n")[0] == "['_exit_now', '_exit_now']", out


@pytest.mark.parametrize("sig", grid(SIGNALS, {"15"}))
def test_a_stop_signal_right_after_a_resume_is_one_line_and_resumable(tmp_path, sig):
    run_dir = tmp_path / "run"
    train_here(run_dir, 4)  # the run to resume (checkpoints 2 and 4)
    proc = _start(run_dir, 8)
    seen = ""
    while "jaxpar: resumed from" not in seen:
        line = proc.stdout.readline()
        assert line, proc.communicate()
        seen += line
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in _lines(err) if not line.startswith("jaxpar: Ctrl-C: finishing")]
    assert "Traceback" not in err and len(lines) == 1, err
    if proc.returncode == 4:  # training had begun: the current step's checkpoint is written
        assert lines[0].startswith(
            "jaxpar: interrupted (Ctrl-C): checkpoint of step "
            if sig == signal.SIGINT
            else "jaxpar: preempted (SIGTERM): checkpoint of step "
        ), err
    else:
        assert (proc.returncode, lines) == BEFORE_TRAINING[sig][:1] + (
            [BEFORE_TRAINING[sig][1]],
        ), err
    train_here(run_dir, 8)  # the same command again resumes and finishes
    assert _steps(run_dir) == list(range(1, 9))


@pytest.mark.parametrize(
    "argv,loaded",
    [
        (["train", "--help-config"], True),
        (["prepare-data", "--out", "y", "x"], False),
        (["plot", "x"], False),
    ],
    ids=["train", "prepare-data", "plot"],
)
def test_a_command_loads_jax_before_its_own_phase(argv, loaded):
    """JAX's import (seconds) happens under the start-up handlers, never inside the
    command's phase, whose signal line would claim more than the start did; the commands
    that need no JAX never load it."""
    code = f"""
import contextlib, sys
from jaxpar import cli, signals
@contextlib.contextmanager
def phase():
    print("jax" in sys.modules, flush=True)
    raise SystemExit(0)
    yield
signals.raising = phase
cli.main({argv!r})
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == str(loaded), out.stderr
