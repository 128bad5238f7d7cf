"""Multi-process runs with real processes: `jaxpar launch` on this machine (CPU collectives).

Every test here starts JAX processes that join one `jax.distributed` run over free local
ports, and cleans them up (the launcher stops its processes; a timeout bounds each run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import GPT_SMALL, child_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
ROOT = Path(__file__).resolve().parents[1]
RUN = [
    *GPT_SMALL,
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "optim.schedule=cosine",
    "optim.decay_steps=6",
    "checkpoint.every_steps=2",
]


def launch(n: int, run_dir: Path, steps: int, *extra: str, timeout: float = 400):
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "launch",
        "-n",
        str(n),
        "--devices-per-process",
        str(8 // n),
        "--",
        "train",
        *RUN,
        *extra,
        f"train.steps={steps}",
        f"run.dir={run_dir}",
    ]
    return subprocess.run(
        cmd, env=child_env(None), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def single(run_dir: Path, steps: int, *extra: str):
    env = child_env(8)
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "train",
        *RUN,
        *extra,
        f"train.steps={steps}",
        f"run.dir={run_dir}",
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


# data × fsdp × tensor: the data-parallel axis (across the processes) and the sharded ones
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
STRAIGHT_STEPS = 12


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Losses of an uninterrupted 1-process × 8-device run of LAYOUT, the reference of the
    tests below (one run for the module)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    out = single(run_dir, STRAIGHT_STEPS, *LAYOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return losses(run_dir)


def reference(straight, tmp_path, steps: int) -> dict[int, float]:
    """The module's straight run, or (when a preemption landed later) a longer one."""
    if steps <= STRAIGHT_STEPS:
        return straight
    assert single(tmp_path / "longer", steps, *LAYOUT).returncode == 0
    return losses(tmp_path / "longer")


def test_two_processes_match_one_and_hand_over_to_one(tmp_path, straight):
    """2 processes × 4 devices give the per-step losses of 1 process × 8 devices; their
    checkpoint, resumed by 1 process (the loader position is global), continues with the
    losses of the uninterrupted run."""
    run_dir = tmp_path / "two_then_one"
    two = launch(2, run_dir, 4, *LAYOUT, "optim.momentum=0.5")  # no effect: warned
    assert two.returncode == 0, two.stdout[-3000:]
    assert "[0] steps: 4" in two.stdout and "[1] steps" not in two.stdout  # process 0 reports
    # one voice: no connection chatter, each warning once (process 0's)
    warned = [line for line in two.stdout.splitlines() if "jaxpar: warning:" in line]
    assert "[Gloo]" not in two.stdout and warned, two.stdout[-3000:]
    assert all(line.startswith("[0] ") for line in warned) and len(set(warned)) == len(warned)
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [got[s] for s in range(1, 5)], [straight[s] for s in range(1, 5)], rtol=1e-6
    )
    one = single(run_dir, 6, *LAYOUT, "optim.momentum=0.5")  # resumes the checkpoint of 4
    assert one.returncode == 0, one.stderr[-3000:]
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # each step once
    np.testing.assert_allclose([got[s] for s in (5, 6)], [straight[s] for s in (5, 6)], rtol=1e-6)


def test_bucketed_data_parallelism_two_processes_match_one(tmp_path):
    """``mesh.data=8`` over 2 processes × 4 devices: the step sums its gradients over
    ``data`` in one bucket (``train.grad_bucket_mb=25``), across the processes over gloo;
    the losses of 3 steps equal 1 process × 8 devices' to rtol 1e-6."""
    one = single(tmp_path / "one", 3, "mesh.data=8", "train.grad_bucket_mb=25")
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(2, tmp_path / "two", 3, "mesh.data=8", "train.grad_bucket_mb=25")
    assert two.returncode == 0, two.stdout[-3000:]
    got, want = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-6)


def test_user_task_two_processes_match_one(tmp_path):
    """`jaxpar launch -n 2 -- train --task …`: a user's model (BatchNorm, dropout) with its own
    data function, each process loading its rows, gives the losses of one process."""
    task = [
        "--task",
        "examples/research_cnn.py:TASK",
        "train.batch_size=16",
        "train.log_every=1",
        "train.eval_every=2",
        "train.progress=false",
        "train.steps=4",
    ]
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "4",
        "--",
        "train",
        *task,
        f"run.dir={tmp_path / 'two'}",
    ]
    two = subprocess.run(
        cmd, env=child_env(None), cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert two.returncode == 0, two.stdout[-3000:]
    env = child_env(8)
    one = subprocess.run(
        [sys.executable, "-m", "jaxpar", "train", *task, f"run.dir={tmp_path / 'one'}"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3, 4]
    # BatchNorm's batch statistics are summed across the processes (gloo) in another order
    # than on one: f32 summation noise, as in the suite's other BatchNorm layout tests
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], rtol=1e-5)
    evals = lambda d: [
        json.loads(line)["eval_loss"]
        for line in (d / "metrics.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    np.testing.assert_allclose(evals(tmp_path / "two"), evals(tmp_path / "one"), rtol=1e-5)


def _processes_with(marker: str) -> dict[int, int]:
    """pid → JAXPAR_PROCESS_ID of the live processes whose command line holds ``marker``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and "\0train\0" in cmdline:
            for var in environ.split("\0"):
                if var.startswith("JAXPAR_PROCESS_ID="):
                    found[int(pid)] = int(var.split("=", 1)[1])
    return found


def test_killing_one_process_stops_the_launch(tmp_path):
    """SIGKILL one of 2 training processes: the launcher says which one died and how,
    exits non-zero within a bounded time, and no process of the run is left behind."""
    run_dir = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "4",
        "--grace",
        "5",
        "--",
        "train",
        *RUN,
        "train.steps=100000",
        f"run.dir={run_dir}",
    ]
    launcher = subprocess.Popen(
        cmd,
        env=child_env(None),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (
            (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 2
        ):
            time.sleep(0.2)
        workers = _processes_with(str(run_dir))
        assert sorted(workers.values()) == [0, 1], workers
        victim = next(pid for pid, index in workers.items() if index == 1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + signal.SIGKILL, out[-3000:]
        assert time.time() - killed_at < 60
        # Rank 0 is stopped by the launcher, or fails its next collective first and is
        # named beside the killed one.
        said = re.search(
            rf"\[launch\] process 1 \(pid {victim}\) ended: killed by SIGKILL; "
            r"(stopping the other 1 \(grace 5 s\)|process 0 \(pid \d+\) ended too: .+)\n",
            out,
        )
        assert said, out[-3000:]
        time.sleep(0.5)
        assert _processes_with(str(run_dir)) == {}
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _processes_with(str(run_dir)):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_to_a_launch_checkpoints_an_agreed_step(tmp_path, straight):
    """SIGTERM to the launcher reaches both processes; JAX's preemption sync point makes
    them save the same step and exit 4; the launch exits 4 and resuming continues with the
    losses of an uninterrupted run."""
    run_dir = tmp_path / "preempted"
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "4",
        "--grace",
        "60",
        "--",
        "train",
        *RUN,
        *LAYOUT,
        "train.steps=100000",
        f"run.dir={run_dir}",
    ]
    launcher = subprocess.Popen(
        cmd,
        env=child_env(None),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (
            (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 3
        ):
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 4, out[-3000:]
    steps = {
        int(line.split("checkpoint of step ")[1].split()[0])
        for line in out.splitlines()
        if "checkpoint of step " in line
    }
    assert len(steps) == 1, out[-3000:]  # both processes name the same step
    step = steps.pop()
    assert (run_dir / "checkpoints" / str(step)).is_dir()
    assert single(run_dir, step + 2, *LAYOUT).returncode == 0  # resume in one process
    got, want = losses(run_dir), reference(straight, tmp_path, step + 2)
    assert sorted(got) == list(range(1, step + 3))
    np.testing.assert_allclose(
        [got[s] for s in (step + 1, step + 2)], [want[s] for s in (step + 1, step + 2)], rtol=1e-6
    )


SLOW_STOP_HOOK = """
import time
import jaxpar


class SlowStop(jaxpar.Hook):
    def on_save(self, ctx, step):
        if ctx.stopping:
            time.sleep(60)
"""


def test_ctrl_c_to_a_launch_checkpoints_once_and_kills_twice(tmp_path):
    """A first Ctrl-C (SIGINT) to the launcher: every process checkpoints the same step and
    the launch exits 4; on another launch, a second Ctrl-C kills every process at once
    (exit 130) and none is left behind."""
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "4",
        "--grace",
        "60",
        "--",
        "train",
        *RUN,
        "train.steps=100000",
    ]
    outputs = {}
    (tmp_path / "slow_stop.py").write_text(SLOW_STOP_HOOK)
    for presses in (1, 2):
        run_dir = tmp_path / f"ctrl_c_{presses}"
        # with 2 presses, a hook holds the processes after their checkpoint starts, so the
        # second Ctrl-C surely finds them running
        hook = [f"train.hooks=[{tmp_path / 'slow_stop.py'}:SlowStop]"] if presses == 2 else []
        launcher = subprocess.Popen(
            [*cmd, *hook, f"run.dir={run_dir}"],
            env=child_env(None),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.time() + 300
            while time.time() < deadline and not (
                (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 2
            ):
                time.sleep(0.2)
            launcher.send_signal(signal.SIGINT)
            if presses == 2:
                time.sleep(2)
                assert launcher.poll() is None
                launcher.send_signal(signal.SIGINT)
                second = time.time()
            outputs[presses], _ = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
            for pid in _processes_with(str(run_dir)):
                os.kill(pid, signal.SIGKILL)
        if presses == 2:
            assert time.time() - second < 15
            assert launcher.returncode == 130, outputs[2][-3000:]
            assert "[launch] killing every process now" in outputs[2]
            time.sleep(0.5)
            assert _processes_with(str(run_dir)) == {}
        else:
            out = outputs[1]
            assert launcher.returncode == 4, out[-3000:]
            assert "[launch] Ctrl-C: asking every process to checkpoint and stop" in out
            steps = {
                int(line.split("checkpoint of step ")[1].split()[0])
                for line in out.splitlines()
                if "checkpoint of step " in line
            }
            assert len(steps) == 1, out[-3000:]
            assert (run_dir / "checkpoints" / str(steps.pop())).is_dir()
            assert "Traceback" not in out


def test_sub_mesh_pipeline_two_processes_match_one(tmp_path):
    """The GPT under the sub-mesh executor (stage=2 × data=4) from 2 processes: each stage
    has devices in both, and each process moves its own shards between the stages; the
    losses are one process's. Processes split along stage instead are refused in one line
    (this executor moves each process's own shards between the stages)."""
    mpmd = [
        "mesh.stage=2",
        "mesh.data=4",
        "pipeline.executor=mpmd",
        "pipeline.microbatches=4",
        "checkpoint.every_steps=0",
    ]
    two_match_one(tmp_path, mpmd)
    across = launch(2, tmp_path / "across", 1, *mpmd, "mesh.hosts_stage=2", "mesh.hosts_data=1")
    assert across.returncode == 2
    assert (
        "pipeline.executor=mpmd moves each process's own shards between the stages, but the "
        "processes hold different places of the stages" in across.stdout
    )


@pytest.mark.parametrize(
    "layout",
    [
        ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2", "pipeline.microbatches=2"],
        ["mesh.context=2", "mesh.data=2", "mesh.tensor=2"],
        ["mesh.tensor=2", "mesh.data=2", "mesh.fsdp=2"],
    ],
    ids=["stage", "context", "tensor"],
)
def test_axes_that_do_not_split_the_rows_across_processes_match_one(tmp_path, layout):
    """The one-program pipeline with its stages across 2 processes (each a stage, data and
    tensor within it), as Megatron-LM's pipelines cross servers, ring attention's context
    axis and the tensor groups across them: both processes load the same rows, the ones
    their devices hold, and the losses are one process's."""
    across = layout[0].replace("mesh.", "mesh.hosts_")  # mesh.hosts_stage=2 …
    two_match_one(tmp_path, [*layout, "checkpoint.every_steps=0"], across, "mesh.hosts_data=1")


def two_match_one(tmp_path, layout: list[str], *placement: str) -> None:
    """3 steps of ``layout`` from 2 processes placed by ``placement`` have the losses of
    one process's."""
    two = launch(2, tmp_path / "two", 3, *layout, *placement)
    assert two.returncode == 0, two.stdout[-3000:]
    one = single(tmp_path / "one", 3, *layout)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3]
    np.testing.assert_allclose([a[s] for s in (1, 2, 3)], [b[s] for s in (1, 2, 3)], rtol=1e-6)
