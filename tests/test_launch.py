"""`jaxpar launch` and the distributed settings, without starting JAX in the children."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from jaxpar.config import DistributedConfig
from jaxpar.distributed import settings
from jaxpar.launch import launch, process_env
from tests.helpers import GPT_SMALL, ROOT, child_env


def test_process_env_sets_coordinator_devices_and_cores():
    env = process_env(
        1,
        2,
        1234,
        4,
        cpus_per_process=1,
        base={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo",
            "JAX_NUM_CPU_DEVICES": "8",
        },
    )
    assert env["JAXPAR_COORDINATOR"] == "127.0.0.1:1234"
    assert env["JAXPAR_NUM_PROCESSES"] == "2" and env["JAXPAR_PROCESS_ID"] == "1"
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert "JAX_NUM_CPU_DEVICES" not in env and env["JAXPAR_CPUS"] == "1"
    # the coordinator listens on the loopback address unless --bind says otherwise
    assert env["JAXPAR_COORDINATOR_BIND"] == "127.0.0.1:1234"
    assert "JAXPAR_LAUNCH_RETRY_PORT" not in env  # a port the user chose is not retried
    env = process_env(0, 2, 99, 0, bind="::", retry_port=True, base={})
    assert env["JAXPAR_COORDINATOR_BIND"] == "[::]:99" and env["JAXPAR_LAUNCH_RETRY_PORT"] == "1"


def test_launch_forwards_output_with_prefixes(tmp_path):
    """Two processes of a command that needs no JAX (the config reference): both run,
    exit 0, and every line arrives prefixed with its process, each process's lines whole
    and in order."""
    from jaxpar.config_reference import reference

    out = io.StringIO()
    code = launch(2, ["train", "--help-config"], out=out)
    lines = out.getvalue().splitlines()
    assert code == 0
    expected = [line for line in reference().splitlines() if line.strip()]
    for process in ("[0] ", "[1] "):
        mine = [line[4:] for line in lines if line.startswith(process)]
        assert [line for line in mine if line.strip()] == expected
    assert all(line[:4] in ("[0] ", "[1] ") for line in lines)


def test_launch_returns_the_failed_status_and_stops_the_rest(tmp_path):
    """A bad config fails every process with status 2 before JAX starts: the launch says 2."""
    out = io.StringIO()
    code = launch(2, ["train", "mesh.data=3", f"run.dir={tmp_path}"], out=out, grace_s=5)
    assert code == 2
    assert "mesh degrees" in out.getvalue()


def test_a_process_killed_by_a_signal_is_named_before_a_peer_that_failed_after_it():
    """Both ended before the launcher looked: the peer (rank 0) failed with status 5 on
    its next collective because rank 1 was killed. The launch names rank 1 and says 137."""
    import threading

    from jaxpar.launch import _watch

    peer = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    victim.kill()
    victim.wait(), peer.wait()
    err, stopped = io.StringIO(), []
    code = _watch([peer, victim], [], 1.0, (io.StringIO(), err), threading.Lock(), stopped)
    assert code == 128 + signal.SIGKILL
    assert stopped == [(1, [])]
    assert (
        f"process 1 (pid {victim.pid}) ended: killed by SIGKILL; "
        f"process 0 (pid {peer.pid}) ended too: exit status 5\n"
    ) in err.getvalue()


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="-n 0"):
        launch(0, ["train"])
    with pytest.raises(ValueError, match="nothing to launch"):
        launch(2, [])
    with pytest.raises(ValueError, match="--cpus-per-process"):
        launch(2, ["train"], cpus_per_process=(os.cpu_count() or 1))


def test_distributed_settings_precedence_and_errors(monkeypatch):
    for var in (
        "JAXPAR_COORDINATOR",
        "JAXPAR_NUM_PROCESSES",
        "JAXPAR_PROCESS_ID",
        "JAXPAR_COORDINATOR_BIND",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
        "JAX_COORDINATOR_ADDRESS",
    ):
        monkeypatch.delenv(var, raising=False)
    assert settings(DistributedConfig()) is None  # one process
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert settings(DistributedConfig()) == {}  # JAX detects SLURM itself
    monkeypatch.setenv("JAXPAR_COORDINATOR", "127.0.0.1:9")
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "0")
    assert settings(DistributedConfig()) == {
        "coordinator_address": "127.0.0.1:9",
        "num_processes": 2,
        "process_id": 0,
    }
    monkeypatch.setenv("JAXPAR_COORDINATOR_BIND", "127.0.0.1:9")  # as jaxpar launch sets it
    assert settings(DistributedConfig())["coordinator_bind_address"] == "127.0.0.1:9"
    monkeypatch.delenv("JAXPAR_COORDINATOR_BIND")
    cfg = DistributedConfig(
        coordinator="host:1", num_processes=4, process_id=3, local_device_ids="0,1"
    )
    assert settings(cfg) == {
        "coordinator_address": "host:1",
        "num_processes": 4,
        "process_id": 3,
        "local_device_ids": [0, 1],
    }  # config wins
    monkeypatch.delenv("JAXPAR_PROCESS_ID")
    with pytest.raises(ValueError, match="missing: distributed.process_id"):
        settings(DistributedConfig())
    with pytest.raises(ValueError, match=r"process_id=5 must be in \[0, .*num_processes=2\)"):
        settings(DistributedConfig(process_id=5))


def test_too_late_and_unreachable_coordinator_are_clear_errors():
    """In this process JAX's backend already runs: initializing now is an error saying to
    initialize first. A coordinator nobody listens on is an error naming the address within
    the timeout (checked before JAX, which would abort the process instead)."""
    import jax

    from jaxpar.distributed import _rendezvous_peer, initialize
    from jaxpar.launch import free_port

    jax.devices()
    with pytest.raises(ValueError, match="before any JAX computation"):
        initialize(
            DistributedConfig(coordinator=f"127.0.0.1:{free_port()}", num_processes=2, process_id=0)
        )
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(
        ValueError,
        match=f"no coordinator answered at {address} within distributed.init_timeout=1 s",
    ):
        _rendezvous_peer(address, 1, 2, 1)


#: stands in for ``python -m jaxpar …``: process 1 dies by SIGKILL; process 0 answers the
#: launcher's SIGTERM as JAX's distributed runtime does when its peer is gone — a glog
#: fatal line and a native stack trace, then SIGABRT
FAKE_RANKS = r"""
import os, signal, sys, time

rank = int(os.environ["JAXPAR_PROCESS_ID"])
print(f"rank {rank} up", flush=True)
if rank == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)

def abort(signum, frame):
    print("F1125 18:12:54.370208   12389 client.cc:90] Terminating process because the JAX "
          "distributed service detected fatal errors", file=sys.stderr)
    print("*** Check failure stack trace: ***", file=sys.stderr)
    print("    @     0x7f5e2b1c3d4e  absl::log_internal::LogMessageFatal::~LogMessageFatal()",
          file=sys.stderr, flush=True)
    os.abort()

signal.signal(signal.SIGTERM, abort)
time.sleep(60)
"""


def test_a_failed_rank_is_reported_on_stderr_and_its_peer_stopped_without_native_traces(
    tmp_path, monkeypatch, capsys
):
    """Process 1 is SIGKILLed: the launcher's failure line is on stderr (not among the
    processes' output), process 0 is stopped, and the native stack trace it prints as it
    goes is replaced by one line saying it was stopped because process 1 failed."""
    script = tmp_path / "ranks.py"
    script.write_text(FAKE_RANKS)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.delenv("JAXPAR_DEBUG", raising=False)
    out = io.StringIO()
    code = launch(2, ["train"], out=out, grace_s=5)
    assert code == 128 + signal.SIGKILL
    stdout, stderr = out.getvalue(), capsys.readouterr().err
    assert "[0] rank 0 up" in stdout and "[1] rank 1 up" in stdout
    assert (
        "[launch] process 1 (pid " in stderr
        and "ended: killed by SIGKILL; stopping the other 1 (grace 5 s)" in stderr
    )
    assert (
        "process 0 (pid " in stderr
        and "was stopped because process 1 failed (killed by SIGABRT)" in stderr
    )
    assert "[launch]" not in stdout and len(stderr.splitlines()) == 2
    for native in ("Check failure stack trace", "F1125", "@     0x"):
        assert native not in stdout + stderr


KILL_RANK_1 = """
import os, signal
import jax
import jaxpar

class KillRank1(jaxpar.Hook):
    def on_step(self, ctx, step, metrics):
        if step == 2 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jaxpar_launch_of_a_run_whose_rank_is_killed_says_so_on_stderr(tmp_path):
    """A real 2-process training run whose process 1 is SIGKILLed at step 2: the launch
    exits 137, its failure line is on stderr and not on stdout, and no native stack trace
    of process 0 comes through."""
    hook = tmp_path / "kill.py"
    hook.write_text(KILL_RANK_1)
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "1",
        "--grace",
        "5",
        "--",
        "train",
        *GPT_SMALL,
        "train.steps=1000",
        "train.progress=false",
        f"train.hooks=[{hook}:KillRank1]",
        f"run.dir={tmp_path / 'run'}",
    ]
    env = {k: v for k, v in child_env(None).items() if k != "JAXPAR_DEBUG"}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGKILL, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[launch] process 1 (pid " in done.stderr and "killed by SIGKILL" in done.stderr
    assert "was stopped because process 1 failed" in done.stderr
    assert "[launch]" not in done.stdout
    assert "Check failure stack trace" not in done.stdout + done.stderr
    assert "internal error" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize(
    "text",
    [
        "INTERNAL: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:40195",
        "UNAVAILABLE: The coordination service has stopped: the heartbeat of task 1 timed out",
    ],
)
def test_a_collective_failed_by_a_lost_peer_is_one_line_not_an_internal_error(text):
    """A surviving process whose collective fails because another process died says so in
    one line (exit 7), not as jaxpar's internal error with a native message."""
    from jaxpar.cli.failures import failure_of
    from jaxpar.errors import PEER_LOST

    status, line = failure_of(RuntimeError(text))
    assert status == PEER_LOST == 7
    assert line.startswith(
        "jaxpar: error: another process of this run stopped or cannot be "
        "reached (a collective failed: "
    )
    assert line.endswith("run the same command to resume from the last checkpoint")
    assert "\n" not in line and len(line) < 400
    assert failure_of(RuntimeError("a model's own bug")) is None  # still an internal error


def test_one_voice_gloo_lines_and_repeated_warnings_are_muted(monkeypatch):
    """What a 2-process launch relays: process 0's lines, process 1's own (its progress,
    its errors) but not its copies of the warnings, and nobody's [Gloo] connection lines;
    everything with JAXPAR_ALL_RANKS=1."""
    import threading

    from jaxpar.launch import _forward, muted

    # two connection lines whose pieces the runtime's threads interleaved (seen in a run)
    gloo = [
        "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected "
        "peer ranks is : 1\n",
        "1[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
        "ranks is : 1\n",
        " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
    ]
    chatter = [
        "".join(gloo),
        "jaxpar: warning: optim.warmup_steps=20 is not shorter than train.steps=4\n",
        "jaxpar: note: took over the lock\n",
        "jaxpar: error: another process of this run stopped\n",
        "step 4/4  loss 5.1\n",
        # a stop: every process's runtime notes the SIGTERM, and each says it checkpointed
        "W1202 08:01:02.123456 4242 preemption_notifier.cc:90] SIGTERM caught at "
        "2026-12-02T08:01:02+00:00\n",
        "jaxpar: preempted (SIGTERM): checkpoint of step 11 written to runs/mh/checkpoints; "
        "run the same command to resume\n",
    ]
    for everything, expect in (
        (False, {0: [1, 2, 3, 4, 6], 1: [3, 4]}),
        (True, {0: [0, 1, 2, 3, 4, 5, 6], 1: [0, 1, 2, 3, 4, 5, 6]}),
    ):
        for index in (0, 1):
            out = io.StringIO()
            _forward(
                io.StringIO("".join(chatter)),
                f"[{index}] ",
                out,
                threading.Lock(),
                lambda: False,
                lambda line, i=index, everything=everything: muted(i, line, everything),
            )
            assert out.getvalue() == "".join(
                f"[{index}] {line}" for i in expect[index] for line in chatter[i].splitlines(True)
            )


def test_the_python_api_does_not_print_orbax_handler_warnings(caplog):
    """jaxpar replaces Orbax's stock jax.Array handler in one process: without absl's
    'Type handler registry … overriding' warning."""
    import logging

    import jax
    import orbax.checkpoint as ocp

    from jaxpar.checkpoint import _write_whole_shards_in_one_process

    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(), override=True
    )
    caplog.clear()  # that warning was this test's own
    with caplog.at_level(logging.WARNING):
        _write_whole_shards_in_one_process()
    assert not [r for r in caplog.records if "overriding" in r.getMessage()], caplog.text


@pytest.mark.parametrize(
    "env,shown",
    [
        ({}, True),
        ({"JAXPAR_PROCESS_ID": "0"}, True),
        ({"JAXPAR_PROCESS_ID": "1"}, False),
        ({"SLURM_PROCID": "3"}, False),
        ({"SLURM_PROCID": "3", "JAXPAR_ALL_RANKS": "1"}, True),
    ],
)
def test_warnings_are_printed_by_process_0_only(env, shown, monkeypatch):
    """Under srun or jaxpar launch every process warns alike: one voice, process 0's."""
    from jaxpar.cli.failures import _warning_line

    for name in ("JAXPAR_PROCESS_ID", "SLURM_PROCID", "JAXPAR_ALL_RANKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = _warning_line(UserWarning("config key 'optim.momentum' has no effect"))
    assert line == ("jaxpar: warning: config key 'optim.momentum' has no effect\n" if shown else "")
