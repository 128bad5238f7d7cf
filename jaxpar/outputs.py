"""Where a command's output may go: nothing overwritten that the command did not make.

A command that writes (``export``, ``sweep``, ``plot``, ``pipeline --png``) checks its
output before it computes anything:

* a **run's own files** — ``config.yaml``, ``metrics.jsonl`` and their kept versions,
  ``trackers.json``, the lock, and the folders the run writes (its checkpoints, traces,
  events) — are never written, ``--overwrite`` or not;
* a directory a **running** run's lock protects (:func:`jaxpar.lock.holder`) is never
  written into;
* an existing file, or a folder holding files, is refused unless ``--overwrite`` is
  given; with it, only the files the command writes are replaced.

The files themselves are written whole, through a temporary name then renamed
(:func:`jaxpar.files.write_atomic`, :func:`jaxpar.figures.save_figure`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path

from jaxpar.errors import PathError
from jaxpar.lock import LOCK, RUN_FOLDERS, describe, holder

#: The files of a run dir that belong to the run (``fnmatch`` patterns).
RUN_FILES = (
    "config.yaml",
    "config.*.yaml",
    "metrics.jsonl",
    "metrics.*.jsonl",
    "trackers.json",
    LOCK,
)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run directory: it holds the ``config.yaml`` of a run, and its
    metrics, lock or checkpoints."""
    return (path / "config.yaml").is_file() and any(
        (path / name).exists() for name in ("metrics.jsonl", LOCK, "checkpoints")
    )


def run_owning(path: Path) -> tuple[Path, Path | None] | None:
    """The run directory ``path`` belongs to — one of its :data:`RUN_FILES`, or inside
    one of its :data:`RUN_FOLDERS` — and that folder (None for a file), or None."""
    path = path.resolve()
    if is_run_dir(path.parent) and any(fnmatch.fnmatch(path.name, p) for p in RUN_FILES):
        return path.parent, None
    for parent in path.parents:
        if is_run_dir(parent) and path.relative_to(parent).parts[0] in RUN_FOLDERS:
            return parent, parent / path.relative_to(parent).parts[0]
    return None


def _refuse_others(path: Path, what: str, folder: Path) -> None:
    """Refuses ``path`` when it is a run's own file or folder, or ``folder`` (where it is
    written) is one that a running run's lock protects."""
    owner = run_owning(path)
    if owner is not None:
        run, inside = owner
        where = f"lies in '{inside}', a folder" if inside else "is a file"
        raise PathError(
            f"{what} '{path}' {where} of the run in '{run}', which that run "
            "owns; write it elsewhere"
        )
    found = holder(folder)
    if found is not None:
        held, info = found
        raise PathError(
            f"{what} '{path}' lies in '{held}', which a running jaxpar run "
            f"holds ({describe(info)}); write it elsewhere"
        )


def check_new_file(path: str | Path, what: str, overwrite: bool = False) -> Path:
    """Checks, touching nothing, that the file ``path`` (named by option ``what``:
    ``--out``) may be written.

    Raises:
      PathError: one line naming ``what`` and the path, for a run's own file, a folder a
        running run holds, a directory, or an existing file without ``overwrite``.
    """
    path = Path(path)
    _refuse_others(path, what, path.absolute().parent)
    if path.is_dir():
        raise PathError(f"{what} '{path}' is a directory; give a file path, e.g. {path / 'out'}")
    if path.exists() and not overwrite:
        raise PathError(
            f"{what} '{path}' exists; choose another path, or pass --overwrite to replace it"
        )
    return path


def check_new_folder(path: str | Path, what: str, replaced: str, overwrite: bool = False) -> Path:
    """Checks, touching nothing, that a command may write its files (``replaced``: what
    they are, for the message) in the folder ``path`` (named by option ``what``).

    Raises:
      PathError: one line naming ``what`` and the path, for a run's own folder, one a
        running run holds, a file, or a folder holding files without ``overwrite``
        (which replaces only the command's files).
    """
    path = Path(path)
    _refuse_others(path, what, path.absolute())
    if path.exists() and not path.is_dir():
        raise PathError(f"{what} '{path}' is a file, not a folder; choose another {what}")
    if path.is_dir() and not overwrite and any(path.iterdir()):
        held = sorted(p.name for p in path.iterdir())
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise PathError(
            f"{what} '{path}' is not empty (it holds {shown}); choose an empty "
            f"or new folder, or pass --overwrite to replace its {replaced}"
        )
    return path


def free_folder(base: str | Path, reusable: Callable[[Path], bool] = lambda path: False) -> Path:
    """``base``, or ``base-2``, ``base-3`` … : the first that is missing, empty or
    ``reusable`` (where a command's default output folder goes when an earlier one is
    there; a stopped sweep's folder is reusable by the same command)."""
    base = Path(base)
    n = 1
    path = base
    while path.is_file() or (path.is_dir() and any(path.iterdir()) and not reusable(path)):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
