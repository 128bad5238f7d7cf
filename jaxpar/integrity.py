"""Integrity records of checkpoints: a SHA-256 digest of every file, verified before use.

A checkpoint step directory holds Orbax's files plus ``jaxpar_integrity.json``::

    {"format": "jaxpar-integrity", "version": 1, "algorithm": "sha256",
     "files": {"state/ocdbt.process_0/d/4d40…": [233598, "9f1c…"], …}}

— the size and digest of every file written before it. :class:`~jaxpar.checkpoint.
Checkpointer` writes the record in Orbax's background thread after the arrays and the
JSON item are complete and before Orbax renames the temporary directory, so every
committed checkpoint carries its record and the training thread never hashes.

:func:`verify` re-reads each recorded file once (SHA-256 runs at about 1.4 GB/s per
core with SHA-NI; files are hashed in parallel threads, and with several processes
each hashes its share of the files), so a flipped byte, a truncated or deleted file
or a damaged record is found before Orbax decodes anything. The bytes it read are then
in the page cache for the restore that follows.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

RECORD = "jaxpar_integrity.json"
FORMAT = "jaxpar-integrity"
VERSION = 1
_CHUNK = 1 << 22
#: top-level files Orbax writes or rewrites after the record (its commit marker, and the
#: step metadata with the commit time), so never recorded; they hold no array data
_UNRECORDED = {RECORD, RECORD + ".tmp", "commit_success.txt", "_CHECKPOINT_METADATA"}


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def digest(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex)`` of one file (read in 4 MiB chunks; the GIL is released)."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _recorded_files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and not (p.parent == directory and p.name in _UNRECORDED)
    )


def write_record(directory: str | Path) -> dict[str, list]:
    """Hashes every file under ``directory`` and writes ``RECORD`` there (atomically).

    Returns:
      The recorded ``files`` mapping.
    """
    directory = Path(directory)
    names = _recorded_files(directory)
    with ThreadPoolExecutor(_threads()) as pool:
        sums = list(pool.map(lambda name: digest(directory / name), names))
    files = {name: [size, sha] for name, (size, sha) in zip(names, sums)}
    record = {"format": FORMAT, "version": VERSION, "algorithm": "sha256", "files": files}
    tmp = directory / (RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, separators=(",", ":"), sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / RECORD)
    return files


@dataclass
class Verification:
    """What :func:`verify` found.

    Attributes:
      problems: one line per file that is missing, of another size or whose contents
        differ from the record (empty: verified).
      recorded: False when the directory has no record at all (a checkpoint written
        before jaxpar recorded digests): nothing could be verified.
      files: the recorded file names, in order (the same on every process).
      bytes_read: how many bytes this call hashed; seconds: how long it took.
    """

    problems: list[str] = field(default_factory=list)
    recorded: bool = True
    files: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.recorded and not self.problems


def read_record(directory: Path) -> dict[str, list] | None:
    """The recorded files, or None when there is no record.

    Raises:
      ValueError: when the record exists but is not a valid jaxpar integrity record.
    """
    path = directory / RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes())
        files = record["files"] if record.get("format") == FORMAT else None
        if not isinstance(files, dict) or not all(
            isinstance(v, list) and len(v) == 2 for v in files.values()
        ):
            raise ValueError("not a jaxpar integrity record")
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError) as err:
        raise ValueError(f"{RECORD} is damaged ({type(err).__name__}: {err})") from None
    return files


def check_file(directory: Path, name: str, size: int, sha: str) -> tuple[str | None, int]:
    """The problem with one recorded file (None: it matches) and the bytes read."""
    path = directory / name
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return f"{name}: missing", 0
    except OSError as err:
        return f"{name}: unreadable ({err.strerror})", 0
    if actual != size:
        return f"{name}: {actual} bytes, recorded {size} (truncated or overwritten)", 0
    try:
        got = digest(path)
    except OSError as err:
        return f"{name}: unreadable ({err.strerror})", 0
    if got[1] != sha:
        return f"{name}: contents differ from the recorded sha256 (corrupt)", got[0]
    return None, got[0]


def verify(
    directory: str | Path, part: tuple[int, int] = (0, 1), required: tuple[str, ...] = ()
) -> Verification:
    """Checks the files under ``directory`` against its record.

    Args:
      directory: a checkpoint step directory.
      part: ``(i, n)``: check only the recorded files ``i, i+n, i+2n, …`` (so ``n``
        processes share the reading); the default checks every file.
      required: files any checkpoint holds: without a record, their absence is a problem
        (the directory was emptied or partly copied) rather than an older checkpoint.
    """
    start = time.perf_counter()
    directory = Path(directory)
    try:
        files = read_record(directory)
    except ValueError as err:
        return Verification([str(err)])
    if files is None:
        gone = [name for name in required if not (directory / name).is_file()]
        return Verification(
            [
                f"{RECORD} and {', '.join(gone)} are missing (the checkpoint "
                "was emptied or only partly copied)"
            ]
            if gone
            else [],
            recorded=False,
        )
    names = sorted(files)
    index, count = part
    mine = names[index::count]
    with ThreadPoolExecutor(_threads()) as pool:
        results = list(pool.map(lambda n: check_file(directory, n, *files[n]), mine))
    problems = [p for p, _ in results if p]
    return Verification(
        problems, True, names, sum(b for _, b in results), time.perf_counter() - start
    )


def summarize(problems: Iterable[str], limit: int = 3) -> str:
    """The first ``limit`` problems on one line, and how many more."""
    problems = list(problems)
    shown = "; ".join(problems[:limit])
    return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")
