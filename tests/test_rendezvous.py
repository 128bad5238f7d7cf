"""Why jaxpar/distributed.py keeps its own rendezvous before ``jax.distributed``: JAX's
``initialize`` (with its ``initialization_timeout``) raises no Python exception when a
process is missing: it ends the whole process with SIGABRT and a native stack trace, the
process that came as well as the one whose coordinator never answered. A taken coordinator
port is either a SIGSEGV or a ``RuntimeError`` that does not say the port is taken
("Failed to start RPC server"; which of the two varies from run to run), so neither the
user nor ``jaxpar launch`` (which retries on another port) could tell. jaxpar's rendezvous
turns each into one line naming the port or the missing processes (tests/test_faults.py).
Should JAX one day raise an exception for a missing process, this test fails: the
rendezvous can then go (docs/architecture.md says what is kept and why)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from jaxpar.launch import free_port

JOIN = """
import sys, jax
address, count, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    jax.distributed.initialize(
        coordinator_address=address, num_processes=count, process_id=index,
        initialization_timeout=2,
    )
except Exception as err:
    print("raised", type(err).__name__, err, flush=True)
    sys.exit(1)
"""


def _join(address: str, count: int, index: int) -> subprocess.Popen:
    """One process of ``jax.distributed.initialize`` alone, without jaxpar's rendezvous."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-c", JOIN, address, str(count), str(index)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# JAX's own behaviour; jaxpar's: test_faults.py's test_rendezvous_names_missing_processes_…
@pytest.mark.exhaustive
def test_jax_distributed_alone_ends_the_process_on_a_taken_port_or_a_missing_peer():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        procs = {
            "port taken": _join(f"127.0.0.1:{port}", 2, 0),
            "peer missing": _join(f"127.0.0.1:{free_port()}", 2, 0),
            "no coordinator": _join(f"127.0.0.1:{free_port()}", 2, 1),
        }
        try:
            out = {name: proc.communicate(timeout=120) for name, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    ended = {name: proc.returncode for name, proc in procs.items()}
    shown = {name: (o, e[-600:]) for name, (o, e) in out.items()}
    assert ended["peer missing"] == ended["no coordinator"] == -signal.SIGABRT, shown
    assert not any("raised" in out[name][0] for name in ("peer missing", "no coordinator"))
    said = out["port taken"][0]
    assert ended["port taken"] == -signal.SIGSEGV or (
        said.startswith("raised") and str(port) not in said and "in use" not in said
    ), shown
