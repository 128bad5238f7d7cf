"""Multi-process runs on JAX's own distributed runtime (``jax.distributed``).

Where the settings come from, first match wins:

1. the ``distributed`` config section (``coordinator``, ``num_processes``,
   ``process_id``, ``local_device_ids``), from YAML or ``distributed.key=value``;
2. ``JAXPAR_COORDINATOR`` / ``JAXPAR_NUM_PROCESSES`` / ``JAXPAR_PROCESS_ID``, which
   ``jaxpar launch`` sets;
3. a cluster JAX detects itself — SLURM with more than one task, Open MPI with more than
   one rank, or ``JAX_COORDINATOR_ADDRESS`` set (e.g. by a Kubernetes JobSet) — started
   with ``jax.distributed.initialize()`` and no arguments.

Otherwise the run is a single process. Initialization must come before anything touches
a device; ``jaxpar`` does it first thing.

JAX ends the whole process (SIGABRT: no Python exception) when the processes do not all
arrive in time, and a taken coordinator port is a SIGSEGV or an error that does not say
so (tests/test_rendezvous.py). So with explicit settings jaxpar first holds its own
rendezvous on the coordinator's address: process 0 binds the port (a port in use is a
one-line error) and waits ``distributed.init_timeout`` seconds for every other process to
check in; then each starts ``jax.distributed``. When some do not arrive, every process that
did fails with a message naming the missing ones, and a coordinator that cannot be reached
is an error naming the address.
"""

from __future__ import annotations

import errno
import os
import socket
import time

import jax

from jaxpar.config import DistributedConfig
from jaxpar.environ import ENV_BIND, ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from jaxpar.errors import ConfigError, PortInUse


def _cluster_detected() -> bool:
    env = os.environ
    return (
        int(env.get("SLURM_NTASKS", "1") or 1) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
        or bool(env.get("JAX_COORDINATOR_ADDRESS"))
    )


def settings(cfg: DistributedConfig) -> dict | None:
    """The arguments for ``jax.distributed.initialize`` (``{}``: let JAX detect the
    cluster), or None for a single-process run.

    Raises:
      ConfigError: for an incomplete explicit setting, naming the missing keys.
    """
    env = os.environ
    coordinator = cfg.coordinator or env.get(ENV_COORDINATOR, "")
    count = cfg.num_processes or int(env.get(ENV_NUM_PROCESSES) or 0)
    index = cfg.process_id if cfg.process_id >= 0 else int(env.get(ENV_PROCESS_ID) or -1)
    if not coordinator and not count and index < 0:
        return {} if _cluster_detected() else None
    missing = [
        key
        for key, unset in (
            ("distributed.coordinator", not coordinator),
            ("distributed.num_processes", not count),
            ("distributed.process_id", index < 0),
        )
        if unset
    ]
    if missing:
        raise ConfigError(
            "a multi-process run needs distributed.coordinator (host:port), "
            "distributed.num_processes and distributed.process_id; missing: "
            + ", ".join(missing)
            + " (or start the processes with jaxpar launch)"
        )
    if not 0 <= index < count:
        raise ConfigError(
            f"distributed.process_id={index} must be in [0, distributed.num_processes={count})"
        )
    _host_port(coordinator, "distributed.coordinator")
    kwargs = {"coordinator_address": coordinator, "num_processes": count, "process_id": index}
    if cfg.local_device_ids:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    bind = cfg.bind_address or env.get(ENV_BIND, "")
    if bind:
        _host_port(bind, "distributed.bind_address")
        kwargs["coordinator_bind_address"] = bind
    return kwargs


def _host_port(address: str, key: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{key}={address!r} must be host:port")
    return host.strip("[]"), int(port)


def _bind(address: str) -> socket.socket:
    """A listening socket on ``host:port`` (what the coordinator will bind).

    Raises:
      PortInUse: when another program listens there.
    """
    host, port = _host_port(address, "distributed.bind_address")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError:  # no IPv6 here: the coordinator's [::] becomes every IPv4 interface
        host = "0.0.0.0"
        sock = socket.socket(socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"the coordinator's port {port} is in use by another program (binding "
                f"{address}: {err.strerror}); choose another port in distributed.coordinator "
                "(jaxpar launch picks a free one)"
            ) from err
        raise ConfigError(
            f"the coordinator cannot listen on {address}: {err.strerror}; "
            "check distributed.bind_address / distributed.coordinator"
        ) from err
    return sock


def _recv_line(conn: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _rendezvous_coordinator(address: str, bind: str, count: int, timeout_s: float) -> None:
    """Process 0: waits until processes 1…count-1 have checked in, then lets them go.

    Raises:
      PortInUse: when the port is taken.
      ConfigError: naming the processes that did not arrive in ``timeout_s``, or a
        process id claimed twice.
    """
    server = _bind(bind)
    deadline = time.monotonic() + timeout_s
    arrived: dict[int, tuple[socket.socket, str]] = {}
    error = None
    try:
        while len(arrived) < count - 1 and error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            server.settimeout(remaining)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            error = _check_in(conn, count, arrived, deadline)
        missing = [i for i in range(1, count) if i not in arrived]
        if error is None and missing:
            error = _missing(address, count, timeout_s, arrived, missing)
        reply = "go\n" if error is None else f"fail {error}\n"
        for conn, _ in arrived.values():
            try:
                conn.sendall(reply.encode())
            except OSError:
                pass
    finally:
        for conn, _ in arrived.values():
            conn.close()
        server.close()
    if error is not None:
        raise ConfigError(f"distributed: {error}")


def _check_in(
    conn: socket.socket, count: int, arrived: dict[int, tuple[socket.socket, str]], deadline: float
) -> str | None:
    """Reads one process's check-in into ``arrived`` (a connection that is not one of
    ours is closed); returns what is wrong with it, or None."""
    try:
        parts = _recv_line(conn, min(deadline, time.monotonic() + 5)).split()
    except OSError:
        conn.close()
        return None
    if len(parts) != 5 or parts[0] != "jaxpar-join" or not parts[1].isdigit():
        conn.close()  # not one of ours
        return None
    index, n, who = int(parts[1]), parts[2], f"{parts[3]} pid {parts[4]}"
    error = None
    if n != str(count):
        error = (
            f"process {index} ({who}) was started with num_processes={n}, "
            f"process 0 with {count}; start every process with the same "
            "distributed.num_processes"
        )
    elif index in arrived or not 0 < index < count:
        error = (
            f"process_id {index} was claimed twice ({who} and {arrived[index][1]})"
            if index in arrived
            else f"process_id {index} is not in [1, {count})"
        )
    arrived.setdefault(index, (conn, who))
    try:
        conn.sendall(b"wait\n")  # "this is process 0": the wait for the rest begins
    except OSError:
        pass
    return error


def _missing(
    address: str,
    count: int,
    timeout_s: float,
    arrived: dict[int, tuple[socket.socket, str]],
    missing: list[int],
) -> str:
    shown = ", ".join(map(str, missing))
    came = ", ".join(f"{i} ({arrived[i][1]})" for i in sorted(arrived)) or "none"
    return (
        f"only {len(arrived) + 1} of {count} processes joined the run at {address} "
        f"within distributed.init_timeout={timeout_s:g} s; missing: process"
        f"{'es' * (len(missing) > 1)} {shown} (arrived besides process 0: "
        f"{came}). Start the missing ones with the same coordinator and "
        "num_processes, check their logs, or raise distributed.init_timeout"
    )


def _rendezvous_peer(address: str, index: int, count: int, timeout_s: float) -> None:
    """A process other than 0: checks in with process 0 and waits for all to arrive.

    Raises:
      ConfigError: when process 0 cannot be reached within ``timeout_s``, or reports
        that the run cannot start (naming the missing processes).
    """
    host, port = _host_port(address, "distributed.coordinator")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=1.0)
            break
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"no coordinator answered at {address} within distributed.init_timeout="
                    f"{timeout_s:g} s ({err.strerror or err}); start process 0 there first, "
                    "check the address and the network, or raise distributed.init_timeout"
                ) from err
            time.sleep(0.2)
    with conn:
        conn.sendall(f"jaxpar-join {index} {count} {socket.gethostname()} {os.getpid()}\n".encode())
        reader = conn.makefile("rb")
        ack = reply = ""
        try:  # process 0 acknowledges at once, then answers by its own deadline
            conn.settimeout(min(timeout_s, 15))
            ack = reader.readline().decode(errors="replace").strip()
            reply = ack
            if ack == "wait":
                conn.settimeout(timeout_s + 30)
                reply = reader.readline().decode(errors="replace").strip()
        except OSError:
            pass
        if not ack:
            raise ConfigError(
                f"distributed: the program listening at {address} did not answer jaxpar's "
                "check-in: it is not process 0 of this run (another program may use the "
                "port); check distributed.coordinator and that process 0 runs there"
            )
    if reply == "go":
        return
    if reply.startswith("fail "):
        raise ConfigError(f"distributed: {reply[5:]}")
    raise ConfigError(
        f"distributed: the coordinator at {address} stopped before every "
        "process joined (see process 0's output)"
    )


def initialize(cfg: DistributedConfig) -> bool:
    """Starts ``jax.distributed`` when asked to; returns whether the run is multi-process.

    With explicit settings (config or ``jaxpar launch``), the processes first meet in
    jaxpar's rendezvous (see the module docstring).

    Raises:
      PortInUse: when process 0 finds the coordinator's port taken.
      ConfigError: when JAX's backend already started, when the coordinator is not
        reached or not every process arrives in ``distributed.init_timeout``, or for
        incomplete settings.
    """
    kwargs = settings(cfg)
    if kwargs is None:
        return False
    where = kwargs.get("coordinator_address", "the cluster's coordinator")
    timeout = cfg.init_timeout
    if kwargs and not jax.distributed.is_initialized():  # (twice: JAX's error below)
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise ConfigError(
                "jax.distributed could not start: JAX's backend is already running. Initialize "
                "it before any JAX computation — jaxpar does it first thing in `jaxpar train`; "
                "in a script call jaxpar.distributed.initialize(config.distributed) before "
                "jaxpar.setup_devices()"
            )
        if kwargs["process_id"] == 0:
            port = _host_port(where, "distributed.coordinator")[1]
            bind = kwargs.get("coordinator_bind_address", f"[::]:{port}")
            _rendezvous_coordinator(where, bind, kwargs["num_processes"], timeout)
        else:
            _rendezvous_peer(where, kwargs["process_id"], kwargs["num_processes"], timeout)
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=timeout)
    except RuntimeError as err:
        text = str(err)
        if "before" in text or "already" in text:
            raise ConfigError(
                f"jax.distributed could not start: {text}. Initialize it before any JAX "
                "computation — jaxpar does it first thing in `jaxpar train`; in a script "
                "call jaxpar.distributed.initialize(config.distributed) before "
                "jaxpar.setup_devices()"
            ) from err
        raise ConfigError(
            f"could not join the distributed run at {where} within distributed.init_timeout="
            f"{timeout} s ({text.splitlines()[0] if text else type(err).__name__}); "
            "check that process 0 is running and the address is reachable"
        ) from err
    return True
