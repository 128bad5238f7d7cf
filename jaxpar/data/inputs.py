"""What ``prepare-data`` reads: the text files its inputs name, never its own outputs.

A folder's files are listed in sorted order; token files an earlier ``prepare-data`` wrote
there (and their metadata) are skipped, with one warning, so they are never tokenized as
text. A token file named as an input is refused, and so is an ``--out`` that is one of the
files a run reads (through symlinks and hard links): writing it would destroy the text.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

from jaxpar.errors import DataError, PathError

FORMAT = "jaxpar-tokens"
#: how a token file's metadata begins (``json.dumps`` of a dict whose first key is format)
_HEADER = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + FORMAT.encode() + rb'"')


def _is_metadata(path: Path) -> bool:
    if not path.name.endswith(".json"):
        return False
    try:
        with open(path, "rb") as f:
            return _HEADER.match(f.read(256)) is not None
    except OSError:
        return False


def is_token_output(path: Path) -> bool:
    """Whether ``path`` is a file ``prepare-data`` writes: token ids (named ``*.tokens``, or
    with jaxpar metadata beside it), that metadata, or the ``.tmp`` an interrupted run left."""
    base = path.with_name(path.name[:-4]) if path.name.endswith(".tmp") else path
    return (base.suffix == ".tokens" or _is_metadata(base)
            or _is_metadata(base.with_name(base.name + ".json")))


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _folder_files(folder: Path, glob: str | None) -> list[Path]:
    """The regular, non-hidden files below ``folder`` matching ``glob``, sorted by path."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            full = Path(root, name)
            rel = full.relative_to(folder)
            if not _is_hidden(rel) and full.is_file() and (glob is None or rel.match(glob)):
                files.append(full)
    return sorted(files, key=lambda f: f.relative_to(folder).parts)


def find_inputs(inputs: Iterable[str | os.PathLike], glob: str | None = None) -> list[Path]:
    """The files to tokenize, in order: each file as given, each folder's files sorted.

    A folder contributes every regular, non-hidden file below it (hidden folders are skipped
    too), sorted by path and, when ``glob`` is given (e.g. ``"*.txt"``), matching it. Files
    named directly are always used. Token files (see ``is_token_output``) in a folder are
    skipped with one warning, so an output written inside an input folder is not read back.

    Raises:
      DataError: no inputs, a missing input, a folder without such files, or a token file
        named as an input.
    """
    inputs = list(inputs)
    if not inputs:
        raise DataError("no inputs given; name text files or folders to tokenize")
    found: list[Path] = []
    skipped: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            if is_token_output(path):
                raise DataError(f"input '{item}' is a jaxpar token file or its metadata (a "
                                "prepare-data output), not text; name the text files it was "
                                "made from, or train on it with data.path")
            found.append(path.absolute())
            continue
        if not path.is_dir():
            raise DataError(f"input '{item}' does not exist (or is not a file or folder); "
                            "check the path")
        files = _folder_files(path, glob)
        ours = {f for f in files if is_token_output(f)}
        skipped += sorted(ours)
        if len(files) == len(ours):
            what = f"matching --glob '{glob}'" if glob is not None else "(hidden files are skipped)"
            also = f" besides {len(ours)} jaxpar token file(s)" if ours else ""
            raise DataError(f"folder '{item}' holds no files {what}{also}; add text files or "
                            "change the pattern")
        found.extend(f.absolute() for f in files if f not in ours)
    if skipped:
        warnings.warn(f"skipped {len(skipped)} jaxpar token file(s) in the input folders "
                      f"(earlier prepare-data outputs, not text), e.g. '{skipped[0]}'",
                      stacklevel=2)
    return found


def check_not_an_input(outputs: Mapping[Path, str], files: Iterable[Path]) -> None:
    """Raise when a file to be written (``outputs``: path → what it is) is one of the input
    ``files`` — the same file through symlinks or hard links — which writing would destroy.

    Raises:
      PathError: naming both paths.
    """
    read = {}
    for path in files:
        try:
            stat = path.stat()
        except OSError:
            continue
        read.setdefault((stat.st_dev, stat.st_ino), path)
    for path, what in outputs.items():
        try:
            stat = path.stat()
        except OSError:
            continue  # not there yet: nothing to lose
        source = read.get((stat.st_dev, stat.st_ino))
        if source is not None:
            raise PathError(f"{what} '{path}' is the input file '{source}': writing it would "
                            "destroy that text; choose an --out that is none of the inputs, "
                            "e.g. a .tokens file outside the input folders")
