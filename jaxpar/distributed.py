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
a device; ``jaxpar`` does it first thing. A coordinator that cannot be reached within
``distributed.timeout_s`` is an error naming the address.
"""

from __future__ import annotations

import os
import socket
import time

import jax

from jaxpar.config import DistributedConfig
from jaxpar.launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def _cluster_detected() -> bool:
    env = os.environ
    return (int(env.get("SLURM_NTASKS", "1") or 1) > 1
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
            or bool(env.get("JAX_COORDINATOR_ADDRESS")))


def settings(cfg: DistributedConfig) -> dict | None:
    """The arguments for ``jax.distributed.initialize`` (``{}``: let JAX detect the
    cluster), or None for a single-process run.

    Raises:
      ValueError: for an incomplete explicit setting, naming the missing keys.
    """
    env = os.environ
    coordinator = cfg.coordinator or env.get(ENV_COORDINATOR, "")
    count = cfg.num_processes or int(env.get(ENV_NUM_PROCESSES) or 0)
    index = cfg.process_id if cfg.process_id >= 0 else int(env.get(ENV_PROCESS_ID) or -1)
    if not coordinator and not count and index < 0:
        return {} if _cluster_detected() else None
    missing = [key for key, unset in (("distributed.coordinator", not coordinator),
                                      ("distributed.num_processes", not count),
                                      ("distributed.process_id", index < 0)) if unset]
    if missing:
        raise ValueError(
            "a multi-process run needs distributed.coordinator (host:port), "
            "distributed.num_processes and distributed.process_id; missing: "
            + ", ".join(missing) + " (or start the processes with jaxpar launch)")
    if not 0 <= index < count:
        raise ValueError(f"distributed.process_id={index} must be in "
                         f"[0, distributed.num_processes={count})")
    kwargs = {"coordinator_address": coordinator, "num_processes": count, "process_id": index}
    if cfg.local_device_ids:
        kwargs["local_device_ids"] = [int(i) for i in cfg.local_device_ids.split(",")]
    return kwargs


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once ``host:port`` accepts TCP connections.

    JAX aborts the whole process (a C++ fatal error, no Python exception) when it cannot
    register with the coordinator in time, so processes other than 0 check first.

    Raises:
      ValueError: naming the address, when nothing listens there within ``timeout_s``.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"distributed.coordinator={address!r} must be host:port")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"no coordinator answered at {address} within distributed.timeout_s="
                    f"{timeout_s:g} s ({err}); start process 0 there first, check the "
                    "address and the network, or raise distributed.timeout_s") from err
            time.sleep(0.2)


def initialize(cfg: DistributedConfig) -> bool:
    """Starts ``jax.distributed`` when asked to; returns whether the run is multi-process.

    Raises:
      ValueError: when JAX's backend already started, when the coordinator is not
        reached in ``distributed.timeout_s``, or for incomplete settings.
    """
    kwargs = settings(cfg)
    if kwargs is None:
        return False
    where = kwargs.get("coordinator_address", "the cluster's coordinator")
    if kwargs.get("process_id", 0) != 0:
        wait_for_coordinator(kwargs["coordinator_address"], cfg.timeout_s)
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=cfg.timeout_s)
    except RuntimeError as err:
        text = str(err)
        if "before" in text or "already" in text:
            raise ValueError(
                f"jax.distributed could not start: {text}. Initialize it before any JAX "
                "computation — jaxpar does it first thing in `jaxpar train`; in a script "
                "call jaxpar.distributed.initialize(config.distributed) before "
                "jaxpar.setup_devices()") from err
        raise ValueError(
            f"could not join the distributed run at {where} within distributed.timeout_s="
            f"{cfg.timeout_s} s ({text.splitlines()[0] if text else type(err).__name__}); "
            "check that process 0 is running and the address is reachable") from err
    return True
