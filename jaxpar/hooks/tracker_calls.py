"""How the trackers (:mod:`jaxpar.hooks.trackers`) call their libraries: each call in a
daemon thread, bounded by ``JAXPAR_TRACKER_TIMEOUT`` seconds (a library's own retries
can take minutes, and a blocked call would not see a stop signal); an http(s) server
probed first, so that one refusing connections fails at once; and the failures of the
library's own logging handlers (a full disk) turned into one warning of the tracker's
instead of a traceback per record."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import jax

from jaxpar import resume as resume_lib
from jaxpar.errors import ConfigError

#: the environment variable that bounds each tracker call
TIMEOUT_ENV = "JAXPAR_TRACKER_TIMEOUT"
#: its default (seconds)
TIMEOUT = 30.0


def timeout() -> float:
    """The seconds each tracker call may take: ``JAXPAR_TRACKER_TIMEOUT``, or 30.

    Raises:
      ConfigError: when the variable is not a number > 0.
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else TIMEOUT
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ConfigError(
            f"{TIMEOUT_ENV}={text!r}: give the seconds a tracker may take "
            f"to answer, a number > 0 (default {TIMEOUT:g})"
        )
    return value


class Stalled(TimeoutError):
    """A tracker call that did not return in time (it goes on in its daemon thread)."""


def stop_requested() -> bool:
    """Whether a SIGTERM or a Ctrl-C asked this run to stop. With several processes the
    loop agrees on the step; a tracker (process 0's) then waits out its bound."""
    return jax.process_count() == 1 and resume_lib.preempted(0)


def bounded(fn: Callable[[], Any], seconds: float, stoppable: bool = False) -> Any:
    """``fn()``'s result, run in a daemon thread.

    Raises:
      Stalled: when it takes over ``seconds``, or (``stoppable``) when a stop signal
        arrives meanwhile.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # raised again in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=work, name="jaxpar-tracker", daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    while thread.is_alive() and time.monotonic() < deadline:
        if stoppable and stop_requested():
            raise Stalled("a stop signal arrived")
        thread.join(0.05)
    if thread.is_alive():
        raise Stalled(f"no answer within {seconds:g} s; {TIMEOUT_ENV} sets the wait")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def probe(uri: str, seconds: float) -> None:
    """Raises OSError naming the address when the server of an http(s) ``uri`` cannot
    be reached: a refused connection fails at once, not after the library's retries."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=seconds).close()
    except OSError as err:
        raise OSError(f"cannot connect to {parts.hostname}:{port}: {err.strerror or err}") from None


#: top-level logger name → what to call with the error when one of its handlers fails
_WATCHED: dict[str, Callable[[BaseException | None], None]] = {}
_HANDLE_ERROR = logging.Handler.handleError


def _handle_error(handler: logging.Handler, record: logging.LogRecord) -> None:
    """A logging handler's failure: for a tracker library's record, its tracker's one
    warning (not logging's traceback, printed once per record); logging's otherwise."""
    report = _WATCHED.get(record.name.split(".")[0])
    if report is None:
        _HANDLE_ERROR(handler, record)
    else:
        report(sys.exc_info()[1])


def watch_logging(
    names: tuple[str, ...], report: Callable[[BaseException | None], None], on: bool
) -> None:
    """Sends the handler failures of the loggers ``names`` (and their children) to
    ``report`` (``on``), or stops that; logging's own handling comes back when no
    logger is watched."""
    for name in names:
        if on:
            _WATCHED[name] = report
        else:
            _WATCHED.pop(name, None)
    logging.Handler.handleError = _handle_error if _WATCHED else _HANDLE_ERROR  # type: ignore[method-assign]
