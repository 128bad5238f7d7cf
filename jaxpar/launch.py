"""``jaxpar launch``: N jaxpar processes on this machine, one JAX distributed run.

    jaxpar launch -n 2 --devices-per-process 4 -- train configs/gpt_tiny.yaml mesh.fsdp=8

Each process gets ``JAXPAR_COORDINATOR`` (a free local port), ``JAXPAR_NUM_PROCESSES``
and ``JAXPAR_PROCESS_ID`` (read by :mod:`jaxpar.distributed`), ``JAXPAR_COORDINATOR_BIND``
(the coordinator listens on the loopback address only, unless ``--bind`` says otherwise)
and, with ``--devices-per-process K``, K simulated CPU devices (with
``--cpus-per-process C``, process i is pinned to cores ``[i*C, (i+1)*C)``). Their output
is forwarded line by line with a ``[i]`` prefix — one voice: the runtime's ``[Gloo]``
connection lines and its note of a SIGTERM are left out, and the warnings and the
"preempted" line every process repeats are relayed from process 0 only (everything with
``--debug`` or ``JAXPAR_ALL_RANKS=1``). When a process fails, the launcher
prints its rank and status on stderr, stops the others (SIGTERM, then SIGKILL after
``--grace`` seconds), says on stderr that each was stopped because of it, and exits with
the failed process's status. What the others' native runtime then prints (glog lines, a
"Check failure stack trace" and its frames, as JAX's distributed runtime aborts when a
peer dies) is not relayed, unless ``--debug`` or ``JAXPAR_DEBUG=1``. When the port it
picked is taken by another program before process 0 binds it, it starts again on another
port.

A SIGTERM or a first Ctrl-C to the launcher becomes a SIGTERM to every process: jaxpar
processes agree on a step, checkpoint it and exit 4, as a single process does, and the
launcher waits for them (however long the save takes) and exits with their status. A
second Ctrl-C kills them at once (exit 130). This is how to rehearse a multi-host layout
on one machine; clusters start processes with their own tools (see docs/multi-host.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from jaxpar.environ import (
    ENV_BIND,
    ENV_COORDINATOR,
    ENV_CPUS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RETRY_PORT,
    PORT_TAKEN,
    force_device_count,
)
from jaxpar.errors import ConfigError

_PORT_TRIES = 5
#: a line of a native runtime's crash report: glog (``F1125 12:00:00.123 42 client.cc:88]``),
#: ``*** Check failure stack trace: ***``, ``@ 0x…`` frames, Python's faulthandler dump
_NATIVE = re.compile(
    r"[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] |\*\*\* |\s*@ +0x[0-9a-f]+"
    r"|.*Check failure stack trace|Fatal Python error: |Extension modules: "
    r"|(Current thread|Thread) 0x[0-9a-f]+ |  File \".*\", line \d+ in "
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(
    index: int,
    count: int,
    port: int,
    devices_per_process: int,
    cpus_per_process: int = 0,
    base: dict[str, str] | None = None,
    bind: str = "127.0.0.1",
    retry_port: bool = False,
) -> dict[str, str]:
    """The environment of process ``index`` of ``count`` (``retry_port``: the launcher
    picked the port and starts again on another when it is taken)."""
    env = dict(os.environ if base is None else base)
    host = f"[{bind}]" if ":" in bind else bind
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(count),
            ENV_PROCESS_ID: str(index),
            ENV_BIND: f"{host}:{port}",
        }
    )
    env.pop(ENV_RETRY_PORT, None)
    if retry_port:
        env[ENV_RETRY_PORT] = "1"
    if cpus_per_process:
        first = index * cpus_per_process
        env[ENV_CPUS] = ",".join(str(c) for c in range(first, first + cpus_per_process))
    if devices_per_process:
        force_device_count(env, devices_per_process)
    return env


def pin_from_env() -> None:
    """Restricts this process to the CPU cores in ``JAXPAR_CPUS`` (set by ``--cpus-per-
    process``) — call before JAX starts, so its thread pools see only those cores."""
    cpus = os.environ.get(ENV_CPUS)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


#: What the runtime prints while the processes connect (``[Gloo] Rank 0 is connected to 1
#: peer ranks. Expected number of connected peer ranks is : 1``, on stdout; a process's
#: stdout and stderr are read apart): relayed only with ``--debug`` or
#: ``JAXPAR_ALL_RANKS=1``. Its threads write these in pieces, so two may interleave
#: (``1[Gloo] Rank 1 is connected …`` then `` is connected …``): a line holding either
#: part is chatter.
_CONNECTING = re.compile(
    r"\[Gloo\] |connected peer ranks is : \d+$"
    # JAX's preemption notifier as each process gets the launcher's SIGTERM (glog, stderr)
    r"|preemption_notifier\.cc:\d+\] SIGTERM caught"
)
#: What every process of a run says alike (its warnings and notes, and that the run was
#: checkpointed at the stop all agreed on): relayed from process 0 only, unless
#: ``JAXPAR_ALL_RANKS=1``.
_ECHOED = re.compile(r"jaxpar: (warning|note): |jaxpar: preempted \(")


def muted(index: int, line: str, everything: bool) -> bool:
    """Whether the launcher leaves out ``line`` of process ``index``: the runtime's
    connection chatter, and what another process than 0 repeats of process 0's warnings
    (one voice), unless ``everything`` (``--debug``, ``JAXPAR_ALL_RANKS=1``)."""
    if everything:
        return False
    return bool(_CONNECTING.search(line.rstrip("\n"))) or (index > 0 and bool(_ECHOED.match(line)))


def _forward(
    stream: IO[str],
    prefix: str,
    out: IO[str],
    lock: threading.Lock,
    peer_failed: Callable[[], bool],
    mute: Callable[[str], bool] = bool,
) -> None:
    """Relays ``stream`` line by line with ``prefix``, less what ``mute`` leaves out and
    native crash reports once ``peer_failed()`` (the launcher then says why the process
    was stopped)."""
    for line in stream:
        if (_NATIVE.match(line) and peer_failed()) or mute(line):
            continue
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()


def _stop(procs: list[subprocess.Popen], grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Sends ``sig`` to every live process group, then SIGKILL to what is left after
    ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited in the meantime
        os.killpg(proc.pid, sig)


def launch(
    count: int,
    args: Sequence[str],
    *,
    devices_per_process: int = 0,
    cpus_per_process: int = 0,
    port: int = 0,
    grace_s: float = 10.0,
    out: IO[str] | None = None,
    bind: str = "127.0.0.1",
    err: IO[str] | None = None,
) -> int:
    """Runs ``python -m jaxpar ARGS`` in ``count`` processes; returns the launch's status.

    0 when every process exits 0; otherwise the status of the first process that failed
    (the others are stopped), or 128 + the signal number when the launcher was signalled
    and its processes had to be killed. The processes' output goes to ``out`` (stdout),
    the launcher's lines about a failed process to ``err`` (stderr).

    Raises:
      ConfigError: for a count below 1, a negative device count or no command.
    """
    if count < 1:
        raise ConfigError(f"-n {count}: launch at least one process")
    if devices_per_process < 0:
        raise ConfigError(f"--devices-per-process {devices_per_process} must be ≥ 0")
    cores = os.cpu_count() or 1
    if cpus_per_process < 0 or count * cpus_per_process > cores:
        raise ConfigError(
            f"--cpus-per-process {cpus_per_process} × -n {count} must be within "
            f"the {cores} CPU cores of this machine"
        )
    if not args:
        raise ConfigError(
            "nothing to launch: give a jaxpar command after --, e.g. jaxpar launch -n 2 -- train"
        )
    out = out or sys.stdout
    err = err or sys.stderr
    lock = threading.Lock()
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)  # acted on (and reported) by _watch, outside the handler

    main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        if main_thread
        else {}
    )
    try:
        for _ in range(_PORT_TRIES):
            chosen = port or free_port()
            status = _run_once(
                count,
                args,
                chosen,
                devices_per_process,
                cpus_per_process,
                bind,
                grace_s,
                received,
                (out, err),
                lock,
                retry_port=not port,
            )
            if status != PORT_TAKEN or port or received:
                return status
            _say(
                out,
                lock,
                f"port {chosen} was taken by another program before the "
                "coordinator could listen on it; starting again on another port",
            )
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(out: IO[str], lock: threading.Lock, text: str) -> None:
    with lock:
        out.write(f"[launch] {text}\n")
        out.flush()


def _run_once(
    count: int,
    args: Sequence[str],
    port: int,
    devices_per_process: int,
    cpus_per_process: int,
    bind: str,
    grace_s: float,
    received: list[int],
    streams: tuple[IO[str], IO[str]],
    lock: threading.Lock,
    retry_port: bool,
) -> int:
    out, err = streams
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    stopped: list[tuple[int, list[int]]] = []  # the failed process and those it stopped
    debug = os.environ.get("JAXPAR_DEBUG", "") not in ("", "0")
    everything = debug or os.environ.get("JAXPAR_ALL_RANKS", "") not in ("", "0")

    def peer_failed(index: int) -> bool:
        return not debug and (
            any(i != index for i, _ in stopped)
            or any(i != index and p.poll() not in (None, 0, 4) for i, p in enumerate(procs))
        )

    try:
        for index in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxpar", *args],
                env=process_env(
                    index,
                    count,
                    port,
                    devices_per_process,
                    cpus_per_process,
                    bind=bind,
                    retry_port=retry_port,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
                start_new_session=True,
            )  # its own process group: stopping it stops its children
            procs.append(proc)
            for stream in (proc.stdout, proc.stderr):  # apart: their lines arrive whole
                thread = threading.Thread(
                    target=_forward,
                    daemon=True,
                    args=(
                        stream,
                        f"[{index}] ",
                        out,
                        lock,
                        lambda index=index: peer_failed(index),
                        lambda line, index=index: muted(index, line, everything),
                    ),
                )
                thread.start()
                threads.append(thread)
        return _watch(procs, received, grace_s, streams, lock, stopped)
    finally:
        _stop(procs, grace_s)
        for thread in threads:
            thread.join(timeout=5)
        for index, others in stopped:
            for other in others:
                _say(
                    err,
                    lock,
                    f"process {other} (pid {procs[other].pid}) was stopped because "
                    f"process {index} failed ({describe_status(procs[other].poll())})",
                )


def describe_status(code: int) -> str:
    """``'exit status 3'`` or ``'killed by SIGKILL'`` for a Popen return code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _watch(
    procs: list[subprocess.Popen],
    received: list[int],
    grace_s: float,
    streams: tuple[IO[str], IO[str]],
    lock: threading.Lock,
    stopped: list[tuple[int, list[int]]],
) -> int:
    """Waits until all processes succeed, one fails, or the launcher gets a signal.

    A failure (one killed by a signal first, where several ended within a poll) is
    reported on stderr (rank, pid, status), recorded in ``stopped`` with the
    processes still running, and those are stopped within ``grace_s``. A first SIGTERM or
    Ctrl-C becomes a SIGTERM to every process (jaxpar processes checkpoint an agreed step
    and exit 4), and the launcher waits for them however long that takes; a second signal
    kills them at once. Then the children's status counts, or 128 + the signal for those
    that had to be killed."""
    out, err = streams
    forwarded = False
    while True:
        if received and not forwarded:
            what = "Ctrl-C" if received[0] == signal.SIGINT else signal.Signals(received[0]).name
            _say(
                out,
                lock,
                f"{what}: asking every process to checkpoint and stop (Ctrl-C "
                "again to kill them at once)",
            )
            for proc in procs:
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGTERM)
            forwarded = True
        if len(received) > 1:
            _say(out, lock, "killing every process now")
            _stop(procs, 0.0, signal.SIGKILL)
            return 128 + received[-1]
        codes = [proc.poll() for proc in procs]
        fine = (0, 4) if forwarded else (0,)
        failed = [(i, c) for i, c in enumerate(codes) if c is not None and c not in fine]
        if failed:
            # A process killed by a signal is the likelier cause when two ended within
            # one poll: its peers fail on their next collective (gloo: connection reset).
            index, code = min(failed, key=lambda failure: failure[1] >= 0)
            alive = [i for i, c in enumerate(codes) if c is None]
            if code != PORT_TAKEN:
                stopped.append((index, alive))
                text = f"process {index} (pid {procs[index].pid}) ended: {describe_status(code)}"
                text += "".join(
                    f"; process {i} (pid {procs[i].pid}) ended too: {describe_status(c)}"
                    for i, c in failed
                    if i != index
                )
                if alive:
                    text += f"; stopping the other {len(alive)} (grace {grace_s:g} s)"
                _say(err, lock, text)
            _stop(procs, grace_s)
            return code if code > 0 else 128 - code
        if all(c is not None for c in codes):
            return next((c for c in codes if c > 0), 0)
        time.sleep(0.1)
