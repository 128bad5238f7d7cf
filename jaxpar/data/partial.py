"""A token file being written, kept across an interruption so the same command resumes it.

``prepare-data … --out corpus.tokens`` writes into a hidden folder beside its output,
``.corpus.tokens.partial/``:

    tokens          the ids written so far (little-endian, the token file's dtype)
    documents.jsonl one metadata entry per document written
    progress.json   {"recipe": …, "documents": D, "tokens": T}: what is durable

Every ``CHECKPOINT_S`` seconds (and when stopped) both data files are flushed to disk and
then ``progress.json`` replaced, so it never counts more than is on disk; what lies past
its counts (written after the last checkpoint) is cut off on resuming. The ``recipe`` —
each input's path, size and modification time, the tokenizer and its separators, the
text field, the dtype — must equal the new command's, or the folder is discarded and the
work starts over (with a note). When done, ``tokens`` becomes the token file and the
folder is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import PathError

#: seconds between checkpoints of the progress
CHECKPOINT_S = 5.0


def partial_folder(out: Path) -> Path:
    """Where the token file ``out`` is written until it is complete (hidden, so a folder
    input never reads it)."""
    return out.with_name(f".{out.name}.partial")


def recipe(files: list[Path], settings: dict[str, Any]) -> dict[str, Any]:
    """What the output depends on: each input's path, size and modification time, and
    ``settings`` (tokenizer, separators, text field, dtype)."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return json.loads(json.dumps({"inputs": stats, **settings}))  # tuples as lists


class Partial:
    """The partial output of one prepare-data command (see the module docstring)."""

    def __init__(self, out: Path, recipe: dict[str, Any], dtype: np.dtype):
        self.folder = partial_folder(out)
        self.recipe = recipe
        self.dtype = dtype
        self.documents: list[dict[str, Any]] = []
        self.num_tokens = 0
        self._lock = _lock(self.folder.with_name(self.folder.name + ".lock"), out)
        if not self._resume(out):
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir()
            (self.folder / "tokens").touch()
            (self.folder / "documents.jsonl").touch()
        self._tokens = open(self.folder / "tokens", "ab")
        self._entries = open(self.folder / "documents.jsonl", "a", encoding="utf-8")
        self._last = time.monotonic()

    def _resume(self, out: Path) -> bool:
        """Cut the folder's files back to its last checkpoint; False when there is none
        for this recipe."""
        try:
            progress = json.loads((self.folder / "progress.json").read_text())
            docs, tokens = int(progress["documents"]), int(progress["tokens"])
            same = progress["recipe"] == self.recipe
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if not same:
            print(
                f"jaxpar: the inputs or settings changed since the interrupted "
                f"prepare-data of '{out}'; starting over",
                file=sys.stderr,
                flush=True,
            )
            return False
        with open(self.folder / "documents.jsonl", "r+b") as f:
            lines = [f.readline() for _ in range(docs)]
            if any(not line.endswith(b"\n") for line in lines):
                return False
            f.truncate(sum(map(len, lines)))
        self.documents = [json.loads(line) for line in lines]
        with open(self.folder / "tokens", "r+b") as f:
            f.truncate(tokens * self.dtype.itemsize)
        if (self.folder / "tokens").stat().st_size != tokens * self.dtype.itemsize:
            return False
        self.num_tokens = tokens
        print(
            f"jaxpar: resuming the interrupted prepare-data of '{out}': {docs:,} "
            f"documents ({tokens:,} tokens) were written",
            file=sys.stderr,
            flush=True,
        )
        return True

    def append(self, ids: np.ndarray, entries: list[dict[str, Any]]) -> None:
        """Write a batch of documents' ids and entries; a checkpoint when one is due."""
        self._tokens.write(ids.data)  # errno ENOSPC on a full disk (tofile has none)
        self._entries.write("".join(json.dumps(e) + "\n" for e in entries))
        self.documents += entries
        self.num_tokens += ids.size
        if time.monotonic() - self._last >= CHECKPOINT_S:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Make what is written durable, then count it in ``progress.json``."""
        for f in (self._tokens, self._entries):
            f.flush()
            os.fsync(f.fileno())
        progress = {
            "recipe": self.recipe,
            "documents": len(self.documents),
            "tokens": self.num_tokens,
        }
        tmp = self.folder / "progress.json.tmp"
        tmp.write_text(json.dumps(progress))
        os.replace(tmp, self.folder / "progress.json")
        self._last = time.monotonic()

    def close(self) -> None:
        self._tokens.close()
        self._entries.close()
        self._lock.close()  # the kernel drops the flock with the file

    def finish(self, out: Path) -> None:
        """Move the complete ids to ``out`` and remove the folder."""
        self._tokens.close()
        os.replace(self.folder / "tokens", out)
        self.discard()

    def discard(self) -> None:
        """Remove the folder (its inputs must change before the command can succeed)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        Path(self._lock.name).unlink(missing_ok=True)  # still held: nobody is inside
        self.close()


def _lock(path: Path, out: Path) -> Any:
    """An exclusive ``flock`` on ``path`` (kept open), so that two commands never write
    one ``out`` at once (each would remove the other's partial files).

    Raises:
      PathError: when another process holds it.
    """
    handle = open(path, "a")
    try:
        import fcntl
    except ImportError:  # not Unix: no lock
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise PathError(
            f"another prepare-data is writing '{out}' now (it holds '{path}'); "
            "wait for it to end, or choose another --out"
        ) from None
    return handle
