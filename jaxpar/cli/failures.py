"""How the ``jaxpar`` command reports a failure: one line and an exit status for every
error jaxpar explains (:class:`jaxpar.errors.JaxparError`, OS errors, Ctrl-C), one line
saying "internal error" and where the traceback went for anything else (a bug), and the
quieting of libraries' background threads while a command runs."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from jaxpar.environ import ENV_PROCESS_ID
from jaxpar.errors import (
    BAD_INPUT,
    INTERNAL,
    INTERRUPTED,
    PEER_LOST,
    WRITE_FAILED,
    CheckpointError,
    JaxparError,
    NonFiniteStop,
    Paused,
    PortInUse,
    Preempted,
    Terminated,
)
from jaxpar.files import disk_full_cause, free_space, name_too_long, shorten

#: The longest report jaxpar prints (characters). A message embedding something long — a
#: path, a value's repr, a library's error text — keeps its start (the cause) and end
#: (the fix), each long word shortened in the middle, and the middle of what is left.
MAX_MESSAGE = 2000
#: The longest run of non-blank characters (a path, a repr) kept whole in a report.
_LONG_WORD = 200
_WORD = re.compile(rf"\S{{{_LONG_WORD + 1},}}")

_PATH_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.ENOTEMPTY,
}


@contextlib.contextmanager
def one_line_reports(debug: bool) -> Iterator[None]:
    """Keeps a failure's report to one line: warnings print as ``jaxpar: warning: …``, and
    the exceptions that libraries' background threads (Orbax's writer, grain's readers)
    log with tracebacks are left to the main thread, which reports the same error once.
    ``--debug`` keeps all of it. Everything is restored on return (``main`` may be called
    from Python)."""
    if debug:
        yield
        return
    saved_format = warnings.formatwarning
    saved_hook = threading.excepthook
    saved_levels = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
    saved_stderr = sys.stderr
    warnings.formatwarning = _warning_line
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)

    def excepthook(args: threading.ExceptHookArgs) -> None:
        if not issubclass(args.exc_type, Exception):
            saved_hook(args)

    threading.excepthook = excepthook
    # a library's native thread prints the traceback of its Python callback straight to
    # sys.stderr (tensorstore's write callbacks after Orbax's event loop closed on a failed
    # save): the main thread reports the failure itself
    sys.stderr = _QuietNativeThreads(saved_stderr)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        warnings.formatwarning = saved_format
        threading.excepthook = saved_hook
        if not failed:  # after a failure the writer's callbacks may still fire, at exit
            sys.stderr = saved_stderr
        for name, level in saved_levels.items():
            # after a failure, a failed background write's asyncio task is logged when it is
            # collected, at exit: that stays silent (the failure was reported once)
            if not (failed and name == "asyncio"):
                logging.getLogger(name).setLevel(level)


class _QuietNativeThreads:
    """``sys.stderr`` that drops what threads started outside Python write (native
    library threads, seen by Python as dummy threads); everything else passes through."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        if isinstance(threading.current_thread(), threading._DummyThread):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


#: What a collective's error says when the process at the other end went away (Gloo on CPU,
#: the coordination service's heartbeats, a closed socket).
_PEER_GONE = re.compile(
    r"\bGloo\b|gloo::|[Cc]onnection (closed|reset) by peer|"
    r"coordination service|heartbeat|[Bb]roken pipe"
)

_NOISY_LOGGERS = ("absl", "orbax", "jax._src.distributed", "grain", "asyncio")


def _warning_line(message: Warning | str, *_: Any) -> str:
    """A warning as one ``jaxpar: warning:`` line — on process 0 only (every process of a
    run warns alike: one voice), unless ``JAXPAR_ALL_RANKS=1``."""
    if _process_index() > 0 and os.environ.get("JAXPAR_ALL_RANKS", "") in ("", "0"):
        return ""
    return capped(f"jaxpar: warning: {message}") + "\n"


def _process_index() -> int:
    """This process's index in a multi-process run: JAX's once its distributed runtime is
    up, before that the launcher's (``JAXPAR_PROCESS_ID``, SLURM's ``SLURM_PROCID``)."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        return jax.process_index()
    for name in (ENV_PROCESS_ID, "SLURM_PROCID"):
        with contextlib.suppress(ValueError):
            return int(os.environ.get(name, ""))
    return 0


def capped(message: str, limit: int = MAX_MESSAGE) -> str:
    """``message`` as one line of at most ``limit`` characters: line breaks become spaces,
    each word longer than 200 characters (a path, a repr) is shortened in the middle with
    "…", then the middle of the whole if it is still too long — its start, which says the
    cause, is kept."""
    if len(message) > 16 * limit:  # a runaway text: only its ends can be shown anyway
        message = f"{message[: 8 * limit]} … {message[-8 * limit :]}"
    message = " ".join(message.splitlines())
    message = _WORD.sub(lambda m: shorten(m.group(0), _LONG_WORD), message)
    return shorten(message, limit)


def failure_of(err: BaseException) -> tuple[int, str] | None:
    """The exit status and the one-line message (at most :data:`MAX_MESSAGE` characters)
    of an error jaxpar explains, or None for one it does not (a bug: reported by
    :func:`internal`)."""
    failure = _failure(err)
    return None if failure is None else (failure[0], capped(failure[1]))


def _failure(err: BaseException) -> tuple[int, str] | None:
    if isinstance(err, KeyboardInterrupt):
        return INTERRUPTED, (
            "jaxpar: interrupted (Ctrl-C); no checkpoint was written by this "
            "interruption (the complete ones stay usable)"
        )
    if isinstance(err, Terminated):
        return err.exit_status, f"jaxpar: {err}"
    if isinstance(err, JaxparError):
        from jaxpar.launch import ENV_RETRY_PORT, PORT_TAKEN

        if isinstance(err, PortInUse) and os.environ.get(ENV_RETRY_PORT):
            return PORT_TAKEN, f"jaxpar: {err} (jaxpar launch tries another port)"
        kind = (
            ""
            if isinstance(err, (Paused, Preempted, Terminated))
            else "checkpoint error: "
            if isinstance(err, CheckpointError)
            else "stopped: "
            if isinstance(err, NonFiniteStop)
            else "error: "
        )
        return err.exit_status, f"jaxpar: {kind}{err}"
    if not isinstance(err, OSError) and str(err).startswith("RESOURCE_EXHAUSTED"):
        first = shorten(str(err).strip().splitlines()[0], 200)
        return BAD_INPUT, (
            f"jaxpar: error: out of device memory ({first}); lower train.batch_size or "
            "data.seq_len, or shard more (mesh.fsdp, mesh.tensor, model.remat=full): "
            "jaxpar plan --devices N --memory-gb G ranks the layouts that fit"
        )
    if not isinstance(err, OSError) and _PEER_GONE.search(str(err)):
        return PEER_LOST, (
            "jaxpar: error: another process of this run stopped or cannot be reached (a "
            f"collective failed: {shorten(str(err).strip().splitlines()[0], 160)}); its own "
            "message says why (jaxpar launch names it); run the same command to resume from "
            "the last checkpoint"
        )
    if isinstance(err, OSError):
        if err.errno == errno.ENAMETOOLONG and err.filename:
            why = name_too_long(str(err.filename), "path", room=0) or (
                f"File name too long: '{shorten(str(err.filename), 60)}' "
                f"({len(str(err.filename)):,} characters)"
            )
            return BAD_INPUT, f"jaxpar: error: {why}: choose a shorter path"
        where = f" '{shorten(str(err.filename))}'" if err.filename else ""
        if disk_full_cause(err) is not None:
            space = free_space(err.filename) if err.filename else "free space unknown"
            return WRITE_FAILED, (
                f"jaxpar: disk full: writing{where} failed: No space left on device ({space} "
                "there); free space and run the same command again (training resumes from "
                "its last checkpoint, prepare-data from the documents it kept)"
            )
        text = err.strerror or str(err)
        status = BAD_INPUT if err.errno in _PATH_ERRNOS else WRITE_FAILED
        return status, f"jaxpar: error: {text}:{where}" if where else f"jaxpar: error: {text}"
    return None


def internal(err: BaseException, debug: bool) -> tuple[int, str]:
    """An exception jaxpar does not explain is a bug — in jaxpar, in JAX or in a model's own
    code — never the user's bad input: one line saying so and where the traceback is."""
    text = "".join(traceback.format_exception(err))
    if debug:
        where = "above"
        print(text, file=sys.stderr, end="", flush=True)
    else:
        try:
            fd, path = tempfile.mkstemp(prefix="jaxpar-internal-error-", suffix=".txt")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            where = f"in {path} (or run with JAXPAR_DEBUG=1)"
        except OSError:  # no writable temporary directory: the traceback goes to stderr
            print(text, file=sys.stderr, end="", flush=True)
            where = "above (it could not be written to a file)"
    first = shorten(str(err).strip().split("\n", 1)[0], 500)
    return INTERNAL, capped(
        f"jaxpar: internal error: {type(err).__name__}: {first} — not a "
        "setting jaxpar checks, but a bug in jaxpar, JAX or the model's own "
        f"code; the traceback is {where}"
    )
