"""`jaxpar launch` and the distributed settings, without starting JAX in the children."""

from __future__ import annotations

import io
import os

import pytest

from jaxpar.config import DistributedConfig
from jaxpar.distributed import settings
from jaxpar.launch import launch, process_env


def test_process_env_sets_coordinator_devices_and_cores():
    env = process_env(1, 2, 1234, 4, cpus_per_process=1,
                      base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo",
                            "JAX_NUM_CPU_DEVICES": "8"})
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
    """Two processes of a command that needs no JAX (prepare-data): both run, exit 0, and
    every line arrives prefixed with its process."""
    (tmp_path / "a.txt").write_text("hello")
    out = io.StringIO()
    code = launch(2, ["prepare-data", str(tmp_path / "a.txt"), "--out",
                      str(tmp_path / "x.tokens")], out=out)
    lines = out.getvalue().splitlines()
    assert code == 0
    assert sorted(line[:4] for line in lines) == ["[0] ", "[1] "]
    assert all("5 tokens from 1 document" in line for line in lines)


def test_launch_returns_the_failed_status_and_stops_the_rest(tmp_path):
    """A bad config fails every process with status 2 before JAX starts: the launch says 2."""
    out = io.StringIO()
    code = launch(2, ["train", "mesh.data=3", f"run.dir={tmp_path}"], out=out, grace_s=5)
    assert code == 2
    assert "mesh degrees" in out.getvalue()


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="-n 0"):
        launch(0, ["train"])
    with pytest.raises(ValueError, match="nothing to launch"):
        launch(2, [])
    with pytest.raises(ValueError, match="--cpus-per-process"):
        launch(2, ["train"], cpus_per_process=(os.cpu_count() or 1))


def test_distributed_settings_precedence_and_errors(monkeypatch):
    for var in ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID",
                "JAXPAR_COORDINATOR_BIND", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert settings(DistributedConfig()) is None  # one process
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert settings(DistributedConfig()) == {}  # JAX detects SLURM itself
    monkeypatch.setenv("JAXPAR_COORDINATOR", "127.0.0.1:9")
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "0")
    assert settings(DistributedConfig()) == {"coordinator_address": "127.0.0.1:9",
                                             "num_processes": 2, "process_id": 0}
    monkeypatch.setenv("JAXPAR_COORDINATOR_BIND", "127.0.0.1:9")  # as jaxpar launch sets it
    assert settings(DistributedConfig())["coordinator_bind_address"] == "127.0.0.1:9"
    monkeypatch.delenv("JAXPAR_COORDINATOR_BIND")
    cfg = DistributedConfig(coordinator="host:1", num_processes=4, process_id=3,
                            local_device_ids="0,1")
    assert settings(cfg) == {"coordinator_address": "host:1", "num_processes": 4,
                             "process_id": 3, "local_device_ids": [0, 1]}  # config wins
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
        initialize(DistributedConfig(coordinator=f"127.0.0.1:{free_port()}", num_processes=2,
                                     process_id=0))
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"no coordinator answered at {address} within "
                                         "distributed.init_timeout=1 s"):
        _rendezvous_peer(address, 1, 2, 1)
