"""Ctrl-C and SIGTERM in every command — train, inspect, plan, sweep, export, sample,
eval — once the command runs (JAX imported, its run being built): one line, exit 130 or
143, no traceback, nothing more done or written; a signal whose exception a library
callback drops (XLA's gc hook during ``jaxpar inspect``) is raised again at once, not when
the command would have ended. (A signal during start-up and training: test_signals.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.config import load_config
from jaxpar.loop import train
from tests.helpers import Child, child_env, kill_all

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.batch_size=16",
    "optim.warmup_steps=0",
]
#: seconds from start to the one line (JAX starts in ~2 s; the children run side by side)
BOUND = 45
AGAIN = "before it finished: run the same command again"
STOPPED = {
    "SIGINT": (130, f"jaxpar: interrupted (Ctrl-C) during jaxpar {{}}, {AGAIN}"),
    "SIGTERM": (143, f"jaxpar: stopped (SIGTERM) during jaxpar {{}}, {AGAIN}"),
}
TRAINING = (
    143,
    (
        "jaxpar: stopped (SIGTERM) before training began: no checkpoint was "
        "written by this stop; run the same command to resume from the last "
        "complete checkpoint"
    ),
)

# case: (how the signal comes — see tests/stop_child.py; "header": sent from here once the
# command printed its first line —, the signal, the command, what it prints only if it ran
# on to its end)
CASES = {
    "train": ("plain", "SIGTERM", ["train", *TINY, "run.dir={tmp}/train"], "step"),
    "inspect": ("plain", "SIGINT", ["inspect", *TINY], "devices:"),
    "plan": (
        "plain",
        "SIGTERM",
        ["plan", *TINY, "--devices", "8", "--layouts", "data=8"],
        "ranked by",
    ),
    # its layouts are measured in worker processes: the signal reaches this one waiting
    "sweep": (
        "header",
        "SIGINT",
        [
            "sweep",
            *TINY,
            "--devices",
            "8",
            "--layouts",
            "data=8",
            "--steps",
            "1",
            "--out",
            "{tmp}/sweep",
        ],
        "wrote",
    ),
    "export": ("plain", "SIGTERM", ["export", "{run}", "--out", "{tmp}/params.npz"], "written to"),
    "sample": (
        "plain",
        "SIGINT",
        ["sample", "{run}", "--prompt-ids", "1,2", "--tokens", "2"],
        "1,2",
    ),
    "eval": ("plain", "SIGTERM", ["eval", "{run}"], "loss"),
    # the report of an 8B model takes a while: it must not be printed
    "inspect_gc": ("gc", "SIGTERM", ["inspect", "configs/llama3_8b.yaml"], "devices:"),
}

#: what a case would write had it not been stopped (sweep's folder may be made, empty)
OUTPUTS = {"export": "params.npz", "sweep": "sweep/*"}


def _start(how: str, sig: str, args: list[str], tmp: Path, run: Path) -> subprocess.Popen:
    args = [a.format(tmp=tmp, run=run) for a in args]
    child = ["tests/stop_child.py", how, sig] if how != "header" else ["-m", "jaxpar"]
    return subprocess.Popen(
        [sys.executable, *child, *args],
        cwd=ROOT,
        env=child_env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _selected(request) -> list[str]:
    """The cases this session runs (all of them in the suite; those ``-k`` or a node id
    chose otherwise): only their children are started."""
    name = test_a_stop_signal_in_a_command_is_one_line_and_its_status.__name__
    return [
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and getattr(item, "originalname", None) == name
    ]


def _signal_once_begun(sig: str):
    """The sweep's signal as soon as it has begun ("sweeping 1 layout of …": its layouts
    then still compile), sent from its reaper while the fixture trains, not after the
    training, by when it may have written its tables."""

    def first(proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith("sweeping"):
                proc.send_signal(signal.Signals[sig])
                return

    return first


@pytest.fixture(scope="module")
def stopped(request, tmp_path_factory):
    """The selected cases' children, started side by side: {case: Child}. Those that open
    a run dir start once a 1-step run, trained here while the others run, has written its
    checkpoint."""
    tmp = tmp_path_factory.mktemp("signals")
    run = tmp / "run"
    cases = _selected(request)
    children = {}
    for case in cases:
        how, sig, args, _ = CASES[case]
        if "{run}" not in args:
            first = _signal_once_begun(sig) if how == "header" else None
            children[case] = Child(_start(how, sig, args, tmp, run), first)
    if any("{run}" in CASES[case][2] for case in cases):
        train(
            load_config(
                [],
                [
                    *TINY,
                    "train.steps=1",
                    "run.devices=1",
                    "train.progress=false",
                    "checkpoint.async_save=false",
                    f"run.dir={run}",
                ],
            ),
            echo=False,
        )
        for case in cases:
            how, sig, args, _ = CASES[case]
            if "{run}" in args:
                children[case] = Child(_start(how, sig, args, tmp, run))
    yield tmp, children
    kill_all(child.proc for child in children.values())


@pytest.mark.parametrize("case", CASES)
def test_a_stop_signal_in_a_command_is_one_line_and_its_status(stopped, case):
    tmp, children = stopped
    child = children[case]
    out, err, elapsed = child.ended(f"{case} (signalled)", 90)
    proc = child.proc
    _, sig, args, finished = CASES[case]
    status, line = TRAINING if case == "train" else STOPPED[sig]
    assert (proc.returncode, err.strip()) == (status, line.format(args[0])), err
    assert finished not in out, out  # it did not run on
    assert elapsed < BOUND, f"{case}: stopped after {elapsed:.0f} s"
    written = list(tmp.glob(OUTPUTS.get(case, "-")))
    assert not written, written
