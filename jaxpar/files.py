"""Paths a setting or an option names: directories created and checked writable, output
files checked before anything is computed — each problem one line naming the setting."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from jaxpar.errors import PathError


def _why_not_dir(path: Path, err: OSError) -> str:
    if err.errno in (errno.EROFS,):
        return "it is on a read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if err.errno == errno.ENOSPC:
        return "the disk is full"
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            return f"'{parent}' is a file, not a directory"
    return err.strerror or type(err).__name__


def ensure_dir(path: str | Path, what: str, fix: str | None = None) -> Path:
    """Creates directory ``path`` (and its parents) if needed and checks that files can be
    written in it.

    Args:
      what: the setting that names it, for the message (``run.dir``, ``checkpoint.dir``).
      fix: what to do instead (default: choose another ``what``).

    Raises:
      PathError: one line naming ``what``, the path and why it is unusable.
    """
    path = Path(path)
    fix = fix or f"choose another {what}"
    if path.exists() and not path.is_dir():
        raise PathError(f"{what} '{path}' is a file, not a directory; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PathError(f"{what} '{path}' cannot be created: {_why_not_dir(path, err)}; "
                        f"{fix}") from err
    probe = path / f".jaxpar-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise PathError(f"{what} '{path}' is not writable: {_why_not_dir(path, err)}; "
                        f"{fix}") from err
    return path


def check_output_file(path: str | Path, what: str) -> Path:
    """Checks that file ``path`` can be written (creating its parent folders).

    Raises:
      PathError: when ``path`` is a directory, or its folder cannot be created or
        written (read-only, a file in the way, permission denied).
    """
    path = Path(path)
    if path.is_dir():
        raise PathError(f"{what} '{path}' is a directory; give a file path, e.g. "
                        f"{path / 'out'}")
    ensure_dir(path.parent, f"the folder of {what}", f"choose another {what} path")
    if path.exists() and not os.access(path, os.W_OK):
        raise PathError(f"{what} '{path}' exists and is not writable; choose another path")
    return path
