"""The environment variables jaxpar reads and sets: ``jaxpar launch``'s per-process
settings (read by :mod:`jaxpar.distributed`) and XLA's simulated CPU device count (read by
:mod:`jaxpar.mesh`). Nothing here imports JAX: the launcher stays light."""

from __future__ import annotations

import re

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_CPUS = "JAXPAR_CPUS"
ENV_BIND = "JAXPAR_COORDINATOR_BIND"
#: set by the launcher: process 0 exits with PORT_TAKEN when the coordinator port is taken
ENV_RETRY_PORT = "JAXPAR_LAUNCH_RETRY_PORT"
#: exit status of process 0 when the launcher's port was taken (EX_TEMPFAIL): try again
PORT_TAKEN = 75
#: ``XLA_FLAGS``' simulated CPU device count (group 1: the count); :mod:`jaxpar.mesh` reads it.
FORCE_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def force_device_count(env: dict[str, str], devices: int | None) -> None:
    """Makes ``env``'s JAX see ``devices`` simulated CPU devices, or (``None``) as many as
    it would by itself: replaces the count in ``XLA_FLAGS``, keeps its other flags."""
    flags = FORCE_DEVICES_FLAG.sub("", env.get("XLA_FLAGS", ""))
    if devices:
        flags += f" --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = " ".join(flags.split())
    env.pop("JAX_NUM_CPU_DEVICES", None)
