"""Stop signals before training begins: one line and an exit status at any moment, never a
traceback, never a lost interrupt.

Three phases, each with its own handlers for SIGINT (Ctrl-C) and SIGTERM:

* **Importing** (:func:`guard_imports`, the first thing ``jaxpar`` runs when it is the
  command): nothing is written yet, so a signal prints one line and ends the process at
  once — exit 130 (Ctrl-C) or 143 (SIGTERM, 128 + 15). Exceptions raised inside
  ``import jax`` would be tracebacks, or swallowed by a garbage-collection callback.
* **The command** (:func:`raising`, inside ``jaxpar.cli.main``): a signal raises
  ``KeyboardInterrupt`` or :class:`~jaxpar.errors.Terminated`, which the command reports
  in one line. A signal seen but swallowed on the way (Python drops exceptions raised in
  callbacks such as XLA's gc hook) is raised again by :func:`raise_pending` — where
  training takes the signals over, and when the command ends.
* **Training** (``jaxpar.resume.sigterm_checkpoints``): a checkpoint of the current step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from jaxpar.errors import Terminated

_STARTING = {signal.SIGINT: (130, "jaxpar: interrupted (Ctrl-C) while starting; nothing was "
                                  "written: run the same command again"),
             signal.SIGTERM: (143, "jaxpar: stopped (SIGTERM) while starting; nothing was "
                                   "written: run the same command again")}
_SEEN: list[int] = []  # signals seen by raising() and not yet raised where they count


def is_command() -> bool:
    """Whether this process is the ``jaxpar`` command (the console script, or
    ``python -m jaxpar`` / ``-m jaxpar.cli``), not a program that imports jaxpar."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] in ("jaxpar", "jaxpar.cli")
    return os.path.basename(sys.argv[0] if sys.argv else "") == "jaxpar"


def _exit_now(signum: int, frame: Any) -> None:
    status, line = _STARTING[signum]
    os.write(2, (line + "\n").encode())
    os._exit(status)


def guard_imports() -> None:
    """The importing phase's handlers, when this process is the command."""
    if is_command() and threading.current_thread() is threading.main_thread():
        for sig in _STARTING:
            signal.signal(sig, _exit_now)


def _raise(signum: int, frame: Any) -> None:
    _SEEN.append(signum)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()


def raise_pending() -> None:
    """Raises a signal :func:`raising` saw whose exception was swallowed on the way.

    Raises:
      KeyboardInterrupt: for a Ctrl-C; Terminated: for a SIGTERM.
    """
    if _SEEN:
        signum = _SEEN[0]
        _SEEN.clear()
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()


def clear() -> None:
    """Forgets the signals seen (their exception reached the command's report)."""
    _SEEN.clear()


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """The command's phase (see the module docstring); the handlers before it come back
    on exit. Outside the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _SEEN.clear()
    previous = {sig: signal.signal(sig, _raise) for sig in _STARTING}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
