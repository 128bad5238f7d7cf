"""``python tests/stop_child.py HOW SIGNAL ARGS…``: the ``jaxpar ARGS…`` command, sent
``SIGNAL`` (``SIGINT``, ``SIGTERM``) by itself as its run starts being built — a moment
every command that builds a run reaches, after JAX is imported. ``HOW``: ``plain`` (the
signal arrives in the command's own code), or ``gc`` (it arrives while a garbage-collection
callback runs, as during ``jaxpar inspect`` of a large model: Python drops the exception
the handler raises there, printing "Exception ignored in …")."""

from __future__ import annotations

import gc
import os
import signal
import sys

import jaxpar.plan.sizes
from jaxpar.cli import console


def main() -> None:
    how, sig, args = sys.argv[1], signal.Signals[sys.argv[2]], sys.argv[3:]
    armed: list[int] = []

    def in_gc(phase: str, info: dict) -> None:
        if armed and phase == "start":
            armed.clear()
            os.kill(os.getpid(), sig)
            for _ in range(1000):  # the handler runs here, and gc drops what it raises
                pass

    check_settings = jaxpar.plan.sizes.check_settings

    def signalled(*a, **k):  # the first thing jaxpar.run.build does
        if how == "gc":
            armed.append(1)
            gc.collect()
        else:
            os.kill(os.getpid(), sig)
        return check_settings(*a, **k)

    gc.callbacks.append(in_gc)
    jaxpar.plan.sizes.check_settings = signalled
    sys.argv = ["jaxpar", *args]
    console()


if __name__ == "__main__":
    main()
