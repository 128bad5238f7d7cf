"""Stop signals outside the training loop (starting, and every command but training
itself): one line and an exit status at any moment, never a traceback, never a lost
interrupt.

Three phases, each with its own handlers for SIGINT (Ctrl-C) and SIGTERM:

* **Importing** (:func:`guard_imports`, the first statement of ``jaxpar.cli`` when the
  process is the command, before the command's imports and JAX's; ``import jaxpar``
  installs nothing): nothing is written yet, so a signal prints one line and ends the
  process at once — exit 130 (Ctrl-C) or 143 (SIGTERM, 128 + 15). Exceptions raised inside
  ``import jax`` would be tracebacks, or swallowed by a garbage-collection callback. Before
  that statement only Python's own start-up runs (about 0.15 s, ``python -X importtime``):
  a signal then is Python's default.
* **The command** (:func:`raising`, inside ``jaxpar.cli.main``): a signal raises
  ``KeyboardInterrupt`` or :class:`~jaxpar.errors.Terminated` (both ``BaseException``s:
  no ``except Exception`` catches them), which the command reports in one line. An
  exception dropped on the way — Python drops those raised in callbacks such as XLA's gc
  hook, printing "Exception ignored in …" — is noticed when it is freed before the report
  and the signal is delivered again (its "Exception ignored" line is not printed);
  :func:`raise_pending` raises one still pending where training takes the signals over,
  and when the command ends.
* **Training** (``jaxpar.resume.sigterm_checkpoints``): a checkpoint of the current step.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import queue
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from jaxpar.errors import Terminated

_STARTING = {
    signal.SIGINT: (
        130,
        "jaxpar: interrupted (Ctrl-C) while starting; nothing was "
        "written: run the same command again",
    ),
    signal.SIGTERM: (
        143,
        "jaxpar: stopped (SIGTERM) while starting; nothing was written: run the same command again",
    ),
}
_SEEN: list[int] = []  # signals seen by raising() and not yet raised where they count
_WATCHED: list[weakref.ref] = []  # the exceptions raised for them, until reported
#: signals whose exception was dropped, for :func:`_redeliver` (``SimpleQueue.put`` may be
#: called from a weakref callback, which runs wherever an object is freed)
_DROPPED: queue.SimpleQueue = queue.SimpleQueue()
_REDELIVERER: list[threading.Thread] = []


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
    """The importing phase's handlers: the command calls this first (outside the main
    thread, where Python installs no handler, nothing changes)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _STARTING:
            signal.signal(sig, _exit_now)


class _Interrupt(KeyboardInterrupt):
    """A Ctrl-C's ``KeyboardInterrupt`` that can be watched (a weak reference)."""


def _watched(signum: int) -> BaseException:
    """The exception of ``signum``, watched: freed before the report (dropped by a callback
    or an ``except`` that did not raise it again), the signal is delivered again."""
    err = _Interrupt() if signum == signal.SIGINT else Terminated()
    _WATCHED.append(weakref.ref(err, lambda _: _SEEN and _DROPPED.put(_SEEN[0])))
    return err


def _raise(signum: int, frame: Any) -> None:
    if signum not in _SEEN:
        _SEEN.append(signum)
    raise _watched(signum)  # not bound to a name here: no cycle keeps it alive


def _redeliver() -> None:
    """A daemon thread's loop: a signal whose exception was dropped reaches the main
    thread again, at its next Python instruction (``SIG_DFL`` or ``SIG_IGN``: nothing)."""
    while True:
        signum = _DROPPED.get()
        if _SEEN:  # not reported meanwhile
            _thread.interrupt_main(signum)


def _quiet_unraisable(hook: Any) -> Any:
    """``sys.unraisablehook`` that says nothing of a signal's exception dropped by a
    callback (it is raised again), and passes anything else to ``hook``."""

    def quiet(args: Any) -> None:
        if not (_SEEN and isinstance(args.exc_value, (KeyboardInterrupt, Terminated))):
            hook(args)

    return quiet


def raise_pending() -> None:
    """Raises a signal :func:`raising` saw whose exception was swallowed on the way.

    Raises:
      KeyboardInterrupt: for a Ctrl-C; Terminated: for a SIGTERM.
    """
    if _SEEN:
        signum = _SEEN[0]
        clear()
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()


def stopped_line(err: BaseException, command: str) -> str:
    """The one line of ``jaxpar COMMAND`` (other than ``train``) stopped by a signal."""
    what = "interrupted (Ctrl-C)" if isinstance(err, KeyboardInterrupt) else "stopped (SIGTERM)"
    return f"jaxpar: {what} during jaxpar {command}, before it finished: run the same command again"


def clear() -> None:
    """Forgets the signals seen (their exception reached the command's report)."""
    _SEEN.clear()
    _WATCHED.clear()


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """The command's phase (see the module docstring); the handlers before it come back
    on exit. Outside the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    clear()
    if not _REDELIVERER:
        _REDELIVERER.append(threading.Thread(target=_redeliver, daemon=True, name="jaxpar-signals"))
        _REDELIVERER[0].start()
    previous = {sig: signal.signal(sig, _raise) for sig in _STARTING}
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(hook)
    try:
        yield
        raise_pending()  # the command ended, but a signal it saw was dropped on the way
    finally:
        sys.unraisablehook = hook
        _WATCHED.clear()  # a dropped exception now no longer brings its signal back
        for sig, handler in previous.items():
            signal.signal(sig, handler)
