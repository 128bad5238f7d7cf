"""The run-dir lock: one run per directory, and what a run's lock protects.

A run holds ``.jaxpar.lock`` in its run dir and in its checkpoint dir (an exclusive
``flock`` on it, taken by the ``filelock`` library, and the holder's pid, host, start time
and setting inside) from before it reads a checkpoint until it exits. The kernel drops the
lock when the holder dies, however it dies, so a lock file left by a crashed run is taken
over, with a note naming the dead holder.

**What a lock protects** (:func:`holder`): a checkpoint dir's lock, everything below it
(every file there is the run's); a run dir's lock, the run dir itself — the files in it —
and the folders the run writes inside it (:data:`RUN_FOLDERS`), not the other folders
below it: an unrelated run in ``RUN/other`` is its own run. Paths are resolved through
symlinks. Neither may be the file system root, a system folder or the home folder.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Self

import filelock

from jaxpar.errors import PathError
from jaxpar.files import ensure_dir, system_folder_problem

LOCK = ".jaxpar.lock"
#: The folders a run writes inside its run dir (its default checkpoint dir, the profiler's
#: traces, TensorBoard's events, W&B's files): its lock protects them with the run dir.
RUN_FOLDERS = ("checkpoints", "profile", "tensorboard", "wandb")
#: What a ``jaxpar sweep``'s lock on its output folder is named as (:mod:`jaxpar.lab.resume`):
#: it protects the files in that folder, not the folders below it.
SWEEP = "--out"
#: what ``flock`` fails with on a file system without it (some network file systems)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirBusy(PathError):
    """Another live run holds the run directory."""


def _holder(text: str) -> dict[str, Any]:
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {}


def _read(fd: int) -> dict[str, Any]:
    """The holder record in the lock file open as ``fd``."""
    return _holder(os.pread(fd, 4096, 0).decode(errors="replace"))


def _read_path(path: Path) -> dict[str, Any]:
    """The holder record in the lock file ``path`` ({} when there is none)."""
    try:
        return _holder(path.read_bytes()[:4096].decode(errors="replace"))
    except OSError:
        return {}


def describe(info: dict[str, Any]) -> str:
    """``pid 123 on host h, started 2026-…`` for a lock file's content."""
    when = info.get("started")
    since = (
        f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}"
        if isinstance(when, (int, float))
        else ""
    )
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{since}"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """An exclusive lock on a run directory (see the module docstring).

    Where the file system has no ``flock`` (some network file systems), the lock falls
    back to the pid in the file: a holder on this host that no longer runs is taken
    over; one on another host must be removed by hand (the message says how).
    """

    def __init__(self, directory: str | Path, what: str = "run.dir"):
        self.directory = Path(directory).resolve()
        self.path = self.directory / LOCK
        self.what = what
        self._created = False
        self._held = False
        self._me: dict[str, Any] = {}
        self._fd: int | None = None  # the lock file as taken: emptied through it at release
        self.took_over: dict[str, Any] | None = None
        # held by the process, whichever thread releases it; no soft lock of the library's
        # own where flock is missing: the holder record below is the fallback. No mode=:
        # the file is created under the user's umask.
        self._lock = filelock.FileLock(
            self.path,
            thread_local=False,
            fallback_to_soft=False,
            on_acquired=self._record,
        )

    def acquire(self) -> Self:
        """Takes the lock.

        Raises:
          RunDirBusy: when another live run holds it, naming its pid and host.
          PathError: when the directory is a system folder, or cannot be created or
            written.
        """
        refuse_system_folder(self.directory, self.what)
        _refuse_held(self.directory, self.what)  # before anything is created
        self._created = not self.directory.exists()
        ensure_dir(self.directory, self.what)
        self._me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "what": self.what,
        }
        try:
            self._lock.acquire(blocking=False)  # writes the record: _record
        except filelock.Timeout:
            raise _busy(self.directory, self.what, info=_read_path(self.path)) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            self._without_flock()
        self._held = True
        _HELD.add(self.directory)
        if self.took_over:
            print(
                f"jaxpar: note: took over the lock {self.path} left by a run that is no "
                f"longer running ({describe(self.took_over)})",
                flush=True,
            )
        return self

    def _record(self, fd: int) -> None:
        """Writes the holder record into the lock file just taken (open as ``fd``), noting
        the holder it replaces."""
        old = _read(fd)
        me = self._me
        if old and old.get("pid") and (old.get("pid"), old.get("host")) != (me["pid"], me["host"]):
            self.took_over = old
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = os.dup(fd)  # the file itself, even if the folder moves meanwhile

    def _without_flock(self) -> None:
        """The pid check where the file system has no flock (see the class doc)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            info = _read(fd)
            if info and info.get("host") != socket.gethostname():
                raise RunDirBusy(
                    f"{self.what} '{self.directory}' has a lock file left by {describe(info)} "
                    "and this file system cannot tell whether that run still runs; if it "
                    f"does not, delete {self.path} and start again"
                )
            if info and _pid_alive(info.get("pid")) and info.get("pid") != os.getpid():
                raise _busy(self.directory, self.what, info=info)
            self._record(fd)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Empties the lock file (a clean exit leaves no holder behind) and unlocks; a
        directory the lock created and nothing else wrote into (the run stopped before it
        began: a bad task or layout) is removed again."""
        if not self._held:
            return
        try:
            if self._fd is not None:
                os.ftruncate(self._fd, 0)
            if self._created and self._still_here() and os.listdir(self.directory) == [LOCK]:
                self.path.unlink()
                self.directory.rmdir()
        except OSError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock.is_locked:
            self._lock.release()  # closing the descriptor drops the flock
        self._held = False
        _HELD.discard(self.directory)

    def _still_here(self) -> bool:
        """Whether the lock file at the path is the one taken (the folder was not moved or
        replaced meanwhile)."""
        if self._fd is None:
            return False
        return os.path.samestat(os.fstat(self._fd), os.stat(self.path))

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def refuse_system_folder(directory: str | Path, what: str) -> None:
    """Raises a one-line PathError when ``directory`` (named by ``what``: ``run.dir``) is
    the file system root, a system folder or the home folder: a run writes its files
    there, and its lock would cover every run below."""
    problem = system_folder_problem(directory, what)
    if problem:
        raise PathError(problem)


def _busy(directory: Path, what: str, info: dict[str, Any]) -> RunDirBusy:
    """The one line for a ``directory`` another live run holds (its holder record
    ``info``)."""
    return RunDirBusy(
        f"{what} '{directory}' is in use by another jaxpar run "
        f"({describe(info)}); wait for it to finish or stop it, or give this "
        f"run another {what}"
    )


_HELD: set[Path] = set()  # the directories this process holds locks on


def _covers(held: Path, info: dict[str, Any], directory: Path) -> bool:
    """Whether the lock of ``held`` (its file's content ``info``) protects ``directory``,
    ``held`` itself or a folder below it (see the module docstring; a sweep's folder
    (:data:`SWEEP`), that folder only; a lock file that names no setting — being written,
    or an older jaxpar's — everything below)."""
    what = info.get("what")
    if directory == held or what not in ("run.dir", SWEEP):
        return True
    return what == "run.dir" and directory.relative_to(held).parts[0] in RUN_FOLDERS


def holder(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The directory whose live lock protects ``directory`` (itself or one above it) and
    its holder (the lock file's content), or None. This process's own locks are not
    counted (``flock`` is per open file: they are known from ``_HELD``).

    A shared ``flock`` probes each lock file (``fcntl``: ``filelock`` takes exclusive
    locks only, and two runs probing the same folder at once must not see each other as
    its holder)."""
    import fcntl  # here: the module imports where fcntl does not exist (Windows)

    directory = Path(directory).resolve()
    for parent in (directory, *directory.parents):
        lock = parent / LOCK
        if parent in _HELD or not lock.is_file():
            continue
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read(fd)
            if _covers(parent, info, directory):
                return parent, info
        except OSError:
            pass  # no flock here: nothing to tell
        finally:
            os.close(fd)
    return None


def _refuse_held(directory: Path, what: str) -> None:
    """Refuses a directory that another live run's lock protects (:func:`holder`)."""
    found = holder(directory)
    if found is None:
        return
    parent, info = found
    if parent == directory:
        raise _busy(directory, what, info=info)
    raise RunDirBusy(
        f"{what} '{directory}' lies inside '{parent}', which another jaxpar "
        f"run holds ({describe(info)}); give this run a {what} of its own"
    )
