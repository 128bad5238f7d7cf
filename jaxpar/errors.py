"""jaxpar's exception types: whose problem it is, and the ``jaxpar`` command's exit status.

Every failure jaxpar explains is a :class:`JaxparError`: its message is one line that
names the key, axis, path or file and says the fix, and ``exit_status`` is what the
``jaxpar`` command returns for it. The kinds a user can fix subclass ``ValueError`` too
(the public API raised ``ValueError`` for them before), so ``except ValueError`` keeps
working. Any other exception is a bug — in jaxpar, in JAX, or in a model's own code — and
the command reports it as an internal error, never as the user's bad input
(:data:`INTERNAL`).
"""

from __future__ import annotations

#: Exit status when the user's own code (a loss, a data function, a hook) raised.
USER_CODE = 1
#: Exit status of a user mistake (a bad setting, file, path or layout).
BAD_INPUT = 2
#: Exit status of a non-finite step under ``train.nonfinite=stop``.
NONFINITE_STOP = 3
#: Exit status after a SIGTERM or a first Ctrl-C: the checkpoint of the current step is
#: complete on disk.
PREEMPTED = 4
#: Exit status when writing a checkpoint or another file failed (disk full, I/O error).
WRITE_FAILED = 5
#: Exit status when ``train.nonfinite=skip`` skipped more steps than its limits allow.
TOO_MANY_SKIPPED = 6
#: Exit status of a process of a multi-process run whose collectives failed because another
#: process stopped or cannot be reached (that process's own status says why).
PEER_LOST = 7
#: Exit status of an unexpected exception: a bug, not the user's input (BSD's EX_SOFTWARE).
INTERNAL = 70
#: Exit status of a Ctrl-C before training began, or of a second Ctrl-C (128 + SIGINT).
INTERRUPTED = 130
#: Exit status of a SIGTERM before training began (128 + SIGTERM).
TERMINATED = 143


class JaxparError(Exception):
    """A failure jaxpar explains in one line; ``exit_status`` is the command's."""

    exit_status: int = BAD_INPUT


class ConfigError(JaxparError, ValueError):
    """A setting is wrong: an unknown key, a value of the wrong type or out of range, a
    malformed config file or override, or settings that contradict each other."""


class LayoutError(JaxparError, ValueError):
    """The mesh, the rules or the pipeline schedule do not fit the model, the batch or the
    devices (an axis that does not divide a dim, a rule naming no axis, an idle axis…)."""


class DataError(JaxparError, ValueError):
    """The data cannot be read or does not fit the model or the task: a missing or damaged
    file, a vocabulary or label range the model cannot hold, a batch of the wrong shape."""


class TaskError(JaxparError, ValueError):
    """A user's task, hook or model family is not what jaxpar needs: a file that does not
    import, a name it does not define, a loss or batch of the wrong form."""


class PathError(JaxparError, ValueError):
    """A path named by a setting or an option cannot be used: a run directory that cannot
    be created, an output file that would overwrite something, a directory another run
    holds."""


class PortInUse(JaxparError, ValueError):
    """A multi-process run's coordinator port is taken by another program
    (``jaxpar/distributed.py``)."""


class RestoreError(JaxparError, ValueError):
    """A checkpoint cannot be resumed or restored: none is there, it belongs to another
    model or seed, or its saved position does not fit this run."""


class CorruptCheckpoint(RestoreError):
    """A checkpoint failed verification: a file differs from its integrity record, is
    missing or cannot be decoded, or a restored value is not finite.

    Attributes:
      step: the checkpoint's step.
      path: its directory.
      reason: what is wrong.
    """

    def __init__(self, step: int, path: object, reason: str):
        super().__init__(f"the checkpoint of step {step} in {path} failed verification: {reason}")
        self.step = step
        self.path = path
        self.reason = reason


class CheckpointError(JaxparError, RuntimeError):
    """Writing a checkpoint failed (raised where the failure becomes known).

    ``disk_full`` is True when the cause is a full file system (``ENOSPC``)."""

    exit_status = WRITE_FAILED
    disk_full: bool = False


class Preempted(JaxparError):
    """A SIGTERM or a first Ctrl-C stopped training after a checkpoint of ``step`` was
    written; the same command resumes it."""

    exit_status = PREEMPTED

    def __init__(self, step: int, directory: object, signame: str = "SIGTERM"):
        what = "interrupted (Ctrl-C)" if signame == "SIGINT" else f"preempted ({signame})"
        super().__init__(
            f"{what}: checkpoint of step {step} written to {directory}; run "
            "the same command to resume"
        )
        self.step = step
        self.signame = signame


class Terminated(BaseException):
    """A SIGTERM before training began (or after it ended): nothing of this run's was
    being written, so none was checkpointed; the same command starts or resumes it.

    A ``BaseException`` as ``KeyboardInterrupt`` is, not a :class:`JaxparError`: code that
    catches ``Exception`` (a library's callback, the lab skipping a layout that cannot
    run) must not swallow a stop signal."""

    exit_status = TERMINATED

    def __init__(self) -> None:
        super().__init__(
            "stopped (SIGTERM) before training began: no checkpoint was written "
            "by this stop; run the same command to resume from the last complete "
            "checkpoint"
        )


class Paused(JaxparError):
    """A command that keeps what it finished (prepare-data) was stopped: by a Ctrl-C
    (exit 130), a SIGTERM or a worker process killed from outside (143). The same command
    continues from there."""

    def __init__(self, message: str, exit_status: int = INTERRUPTED):
        super().__init__(message)
        self.exit_status = exit_status


class UserCodeFailed(JaxparError):
    """The user's own code raised: a task's ``loss_fn``, its data, a hook. The message
    names the function, where (``at step 7``) and the exception's own message; the
    original is ``__cause__`` (``JAXPAR_DEBUG=1`` prints its traceback).

    Attributes:
      what: the function (``loss_fn (my_task.loss)``, ``hook Upload.on_save``);
      error: the exception it raised; at: where, or "" when not yet known.
    """

    exit_status = USER_CODE
    #: what the same command does next, as the message says it
    RESUMES = "it resumes from the last checkpoint"
    RESTARTS = (
        "no checkpoint was written, so it starts again from the first step: "
        "checkpoint.every_steps=N keeps the progress"
    )

    def __init__(self, what: str, error: BaseException, at: str = "", then: str = RESUMES):
        first = (str(error).strip().splitlines() or [""])[0]
        super().__init__(
            f"{what} raised {type(error).__name__}{' ' + at if at else ''}: "
            f"{first or '(no message)'} — fix it and run the same command ({then}); "
            "JAXPAR_DEBUG=1 shows the traceback"
        )
        self.what = what
        self.error = error
        self.at = at
        self.then = then

    def where(self, at: str = "", then: str = "") -> UserCodeFailed:
        """This failure, placed ``at`` (when it was not placed yet) and saying ``then``
        of what the same command does (when given)."""
        if (self.at or not at) and not then:
            return self
        placed = UserCodeFailed(self.what, self.error, self.at or at, then or self.then)
        placed.__cause__ = self.__cause__
        return placed


def code_name(fn: object) -> str:
    """``file.py:qualname`` of a function or a callable object's class (``module.qualname``
    when it has no file)."""
    import inspect
    import os

    target = fn if hasattr(fn, "__qualname__") else type(fn)
    name = getattr(target, "__qualname__", "?")
    try:
        return f"{os.path.basename(inspect.getfile(target))}:{name}"
    except (TypeError, OSError):
        return f"{getattr(target, '__module__', '?')}.{name}"


def is_own(fn: object) -> bool:
    """Whether ``fn`` (or its class) is jaxpar's own code, not the user's."""
    target = fn if hasattr(fn, "__module__") else type(fn)
    return (getattr(target, "__module__", "") or "").split(".")[0] == "jaxpar"


class NonFiniteStop(JaxparError, FloatingPointError):
    """A step had a non-finite loss, gradient or update under ``train.nonfinite=stop``."""

    exit_status = NONFINITE_STOP


class TooManySkipped(NonFiniteStop):
    """``train.nonfinite=skip`` skipped more steps than ``train.max_skipped`` or
    ``train.max_consecutive_skipped`` allow."""

    exit_status = TOO_MANY_SKIPPED
