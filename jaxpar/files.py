"""Paths a setting or an option names: directories created and checked writable, output
files checked before anything is computed — each problem one line naming the setting."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from jaxpar.errors import PathError

#: Room kept below a directory a setting names for the files jaxpar writes inside it (a
#: checkpoint's deepest file adds about 130 characters to ``checkpoint.dir``, 145 to
#: ``run.dir``): a directory whose path leaves less is refused up front, not half-way
#: through the first save.
ROOM = 512


def shorten(text: str, limit: int = 200) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and end around an
    ellipsis (``'/tmp/aaaa…aaaa'``), ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}…{text[len(text) - (limit - 1 - head) :]}"


def _limits(path: Path) -> tuple[int, int]:
    """The longest path component and the longest path (bytes) of the file system that
    would hold ``path`` (its nearest existing parent's; 255 and 4096 when unknown)."""
    for parent in path.parents:
        try:
            return os.pathconf(parent, "PC_NAME_MAX"), os.pathconf(parent, "PC_PATH_MAX")
        except (OSError, ValueError):  # not there (yet), or too long itself
            continue
    return 255, 4096


def name_too_long(path: str | Path, what: str, room: int = ROOM) -> str | None:
    """Why ``path`` (named by ``what``: ``run.dir``) is too long for its file system,
    starting with the cause (``File name too long: run.dir '/tmp/aaaa…aaaa' (3,990
    characters; a path component may have at most 255)``), or None when it fits with
    ``room`` characters to spare for the files written inside it. Touches no file."""
    full = os.path.abspath(path)
    name_max, path_max = _limits(Path(full))
    shown = shorten(str(path), 60)
    if max((len(os.fsencode(p)) for p in Path(full).parts), default=0) > name_max:
        why = f"{len(str(path)):,} characters; a path component may have at most {name_max}"
    elif len(os.fsencode(full)) + room > path_max:
        inside = ", with the files jaxpar writes inside it" if room else ""
        why = (
            f"{len(full):,} characters as an absolute path{inside}; a path may have at "
            f"most {path_max - room:,}"
        )
    else:
        return None
    return f"File name too long: {what} '{shown}' ({why})"


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
      PathError: one line naming ``what``, the path and why it is unusable (too long for
        its file system, with :data:`ROOM` to spare, first).
    """
    path = Path(path)
    too_long = name_too_long(path, what)
    if too_long:
        raise PathError(f"{too_long}: choose a shorter {what}")
    fix = fix or f"choose another {what}"
    if path.exists() and not path.is_dir():
        raise PathError(f"{what} '{path}' is a file, not a directory; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PathError(
            f"{what} '{path}' cannot be created: {_why_not_dir(path, err)}; {fix}"
        ) from err
    probe = path / f".jaxpar-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise PathError(
            f"{what} '{path}' is not writable: {_why_not_dir(path, err)}; {fix}"
        ) from err
    return path


def refuse_existing(paths: dict[Path, str], overwrite: bool) -> None:
    """Raise for the first of ``paths`` (path → what it is, e.g. ``--out``) that exists,
    unless ``overwrite``.

    Raises:
      PathError: one line naming it and ``--overwrite``.
    """
    for path, what in paths.items():
        if path.exists() and not overwrite:
            raise PathError(
                f"{what} '{path}' exists; choose another path, or pass --overwrite to replace it"
            )


def check_output_file(path: str | Path, what: str) -> Path:
    """Checks that file ``path`` can be written (creating its parent folders).

    Raises:
      PathError: when ``path`` is a directory, or its folder cannot be created or
        written (read-only, a file in the way, permission denied).
    """
    path = Path(path)
    if path.is_dir():
        raise PathError(f"{what} '{path}' is a directory; give a file path, e.g. {path / 'out'}")
    ensure_dir(path.parent, f"the folder of {what}", f"choose another {what} path")
    if path.exists() and not os.access(path, os.W_OK):
        raise PathError(f"{what} '{path}' exists and is not writable; choose another path")
    return path


#: Folders no run may take as its own (``run.dir``, ``checkpoint.dir``): a run writes its
#: files there and its lock covers it. The home folder is refused too (:func:`system_folder`).
SYSTEM_FOLDERS = (
    "/",
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/media",
    "/mnt",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/usr/bin",
    "/usr/lib",
    "/usr/local",
    "/usr/sbin",
    "/usr/share",
    "/var",
    "/var/lib",
    "/var/log",
    "/var/tmp",
    "/Applications",
    "/Library",
    "/System",
    "/Users",
    "/Volumes",
    "/private",
    "/private/tmp",
    "/private/var",
)


def system_folder(path: str | Path) -> str | None:
    """What ``path`` is when it is the file system root, a system folder
    (:data:`SYSTEM_FOLDERS`) or the home folder itself (``"the file system root"``,
    ``"the system folder '/usr'"``), else None. Symlinks and ``..`` are resolved."""
    full = os.path.realpath(path)
    if full == os.path.realpath("/"):
        return "the file system root"
    home = os.path.expanduser("~")
    if home not in ("~", "/") and full == os.path.realpath(home):
        return f"the home folder '{home}'"
    for folder in SYSTEM_FOLDERS:
        if full == os.path.realpath(folder):
            return f"the system folder '{folder}'"
    return None


def system_folder_problem(path: str | Path, what: str) -> str | None:
    """The one line refusing ``path`` as a run's folder (named by ``what``: ``run.dir``)
    when :func:`system_folder` says what it is, else None."""
    which = system_folder(path)
    if not which:
        return None
    return (
        f"{what} '{path}' is {which}: a run writes its files into its {what} and locks "
        f"it; give it a folder of its own, e.g. {what}=runs/NAME"
    )


def with_path(err: OSError, path: str | Path) -> OSError:
    """``err`` as an ``OSError`` naming ``path`` (a write's ``ENOSPC`` names no file), to
    raise from ``err``."""
    return OSError(err.errno, err.strerror or str(err), str(path))


def write_atomic(path: str | Path, body: str | bytes, mode: int = 0o644) -> Path:
    """Writes ``body`` (text as UTF-8) at ``path`` through a temporary file in its folder,
    renamed over ``path`` once whole, with ``mode`` (whatever the umask: as the images
    beside it); a reader never sees half a file.

    Raises:
      OSError: naming ``path`` (a full disk's error names none itself).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body.encode() if isinstance(body, str) else body)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if err.filename:
            raise
        raise with_path(err, path) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def free_space(path: Path) -> str:
    """The free space of the file system holding ``path`` (its nearest existing parent),
    e.g. ``'12.0 MiB free'``."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free:.0f} {unit} free" if unit == "B" else f"{free:.1f} {unit} free"
        free /= 1024
    return "free space unknown"


def disk_full_cause(err: BaseException | None) -> BaseException | None:
    """``err`` or the exception it was raised from that is ``ENOSPC`` (a full disk), if any."""
    seen = 0
    while err is not None and seen < 20:
        if (
            isinstance(err, OSError) and err.errno == errno.ENOSPC
        ) or "No space left on device" in str(err):
            return err
        err = err.__cause__ or err.__context__
        seen += 1
    return None
