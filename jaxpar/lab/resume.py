"""A stopped sweep keeps what it measured: each row, as it is measured, is written (whole:
:func:`jaxpar.files.write_atomic`) to ``sweep.partial.json`` in the sweep's folder, so
Ctrl-C, SIGTERM, a job's time limit or SIGKILL loses at most the layouts in flight, and
the same command run again measures only the layouts the file lacks. The finished sweep
writes its outputs and removes the file.

The file names what its rows depend on (:func:`command_key`): the config with its
overrides, the layouts, ``--task`` and its file's content, ``--steps``, the devices, the
hardware profile, ``--memory-gb`` and JAX's version. Rows of another command are never mixed in: the
default folder passes over such a file to the next free folder; an ``--out`` holding one
is refused in one line naming the first setting that differs. ``--overwrite`` measures
every layout again. A sweep holds its folder's lock while it runs (:func:`holding`): the
same command started again meanwhile is refused, naming the first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from jaxpar.config import Config
from jaxpar.config.load import to_dict
from jaxpar.errors import PathError
from jaxpar.files import write_atomic
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Row
from jaxpar.lock import LOCK, SWEEP, RunDirLock, describe, holder, refuse_system_folder
from jaxpar.outputs import is_run_dir
from jaxpar.user_code import source_file

PARTIAL = "sweep.partial.json"
FORMAT = "jaxpar-sweep-partial"


def command_key(
    config: Config,
    layouts: list[str],
    task: str | None,
    steps: int,
    hw: Hardware,
    memory_bytes: float | None,
    devices: list,
) -> dict[str, Any]:
    """What a sweep's rows depend on, and the layouts it measures (as JSON reads it back):
    another list is another command, whose stopped rows are left for it."""
    key = {
        "config": to_dict(config),
        "layouts": layouts,
        "task": _task_key(task),
        "steps": steps,
        "devices": [len(devices), devices[0].platform, devices[0].device_kind],
        "hardware": dataclasses.asdict(hw),
        "memory_bytes": memory_bytes,
        "jax": jax.__version__,
    }
    return json.loads(json.dumps(key))


def _task_key(spec: str | None) -> dict[str, str] | str:
    """``--task`` and the content of the file that defines it: a task edited since the
    stopped run is another command (the modules that file imports are not read)."""
    if not spec:
        return ""  # as a stopped sweep of an earlier jaxpar names it
    path = source_file(spec)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path else ""
    except OSError:
        digest = ""
    return {"spec": spec, "file_sha256": digest}


@contextlib.contextmanager
def holding(folder: Path) -> Iterator[None]:
    """Holds ``folder``'s lock (:class:`jaxpar.lock.RunDirLock`) while a sweep writes there:
    a second sweep into it — the same command started again while the first runs — is
    refused naming the first, whose rows it would overwrite. The kernel drops the lock
    when the holder dies, however it dies; a sweep stopped before its first row leaves
    the folder empty."""
    lock = RunDirLock(folder, SWEEP).acquire()
    try:
        yield
    except BaseException:  # stopped, or failed: a folder with no row measured is left empty
        if not _has_rows(folder):
            done(folder)
        raise
    finally:
        lock.release()


def _has_rows(folder: Path) -> bool:
    """Whether ``folder``'s partial file keeps a measured row."""
    try:
        return bool(json.loads((folder / PARTIAL).read_text()).get("rows"))
    except (OSError, ValueError, AttributeError):
        return False


def refuse_unsuitable(folder: Path) -> None:
    """Refuses, before anything is planned, a folder a sweep cannot hold: one another
    sweep is writing (the same command started twice), a system folder (``/tmp`` itself),
    or a run's directory (whose lock is the run's).

    Raises:
      PathError: one line naming the folder and the fix.
    """
    found = holder(folder)
    if found is not None and found[0] == folder.resolve() and found[1].get("what") == SWEEP:
        raise PathError(
            f"--out '{folder}' is being written by another jaxpar sweep "
            f"({describe(found[1])}); wait for it to finish or stop it, or give this sweep "
            "another --out"
        )
    refuse_system_folder(folder, "--out")
    if is_run_dir(folder):
        raise PathError(
            f"--out '{folder}' is a run's directory; give the sweep a folder of its own, "
            f"e.g. --out {folder / 'sweep'}"
        )


def only_partial(folder: Path) -> bool:
    """Whether ``folder`` holds a sweep's own files and nothing else: a stopped sweep's
    rows, the lock of a sweep (:func:`holding`; running, or one that stopped before its
    first row), the temporary file of a write a SIGKILL cut short
    (:func:`jaxpar.files.write_atomic`'s)."""
    if not folder.is_dir():
        return False
    names = [p.name for p in folder.iterdir()]
    cut = f".{PARTIAL}."
    return bool(names) and all(n in (PARTIAL, LOCK) or n.startswith(cut) for n in names)


def _first_difference(ours: Any, theirs: Any, path: str = "") -> str | None:
    """The dotted name of the first setting where two keys differ (None: they are equal)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for name in sorted(set(ours) | set(theirs)):
            found = _first_difference(ours.get(name), theirs.get(name), f"{path}.{name}")
            if found:
                return found
        return None
    return None if ours == theirs else f"{path.lstrip('.')} was {theirs!r} there, is {ours!r} here"


def _read(path: Path) -> tuple[dict, list[Row]]:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"its format is {data.get('format')!r}, not {FORMAT!r}")
        return data["key"], [Row(**row) for row in data["rows"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise PathError(
            f"'{path}' is not a stopped sweep's rows ({err}); delete it, or pass --overwrite "
            f"to measure every layout again"
        ) from None


def matches(folder: Path, key: dict) -> bool:
    """Whether ``folder`` holds only the rows of a stopped run of the command ``key``
    names (the default folder's test: another command's rows are passed over)."""
    if not only_partial(folder):
        return False
    if not (folder / PARTIAL).exists():  # no row measured yet: any command's to take
        return True
    try:
        return _read(folder / PARTIAL)[0] == key
    except PathError:
        return False


def kept_rows(folder: Path, key: dict) -> list[Row]:
    """The rows a stopped run of the same command left in ``folder`` (none if it left no
    file).

    Raises:
      PathError: the file is not a sweep's rows, or another command's, naming the first
        setting that differs and the fix.
    """
    path = folder / PARTIAL
    if not path.exists():
        return []
    theirs, rows = _read(path)
    differs = _first_difference(key, theirs)
    if differs:
        raise PathError(
            f"'{path}' holds the rows of a stopped sweep of another command ({differs}); "
            f"run that command again to finish it, choose another --out, or pass --overwrite "
            f"to measure these layouts afresh"
        )
    return rows


def keep(folder: Path, key: dict, rows: list[Row]) -> Path:
    """Writes ``rows`` (every row measured so far) whole to ``folder``'s partial file."""
    body = {"format": FORMAT, "key": key, "rows": [dataclasses.asdict(r) for r in rows]}
    return write_atomic(folder / PARTIAL, json.dumps(body, indent=1) + "\n")


def done(folder: Path) -> None:
    """The sweep's outputs are written: its partial rows are no longer needed, nor its lock
    file (held until the sweep ends; a sweep that comes now finds the outputs)."""
    (folder / PARTIAL).unlink(missing_ok=True)
    (folder / LOCK).unlink(missing_ok=True)
