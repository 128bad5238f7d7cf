"""What ``prepare-data`` (and ``data.path``) reads: the files its inputs name, never its
own outputs.

An input is a file, a folder or a glob (``shards/*.parquet``, sorted). A folder's files
are listed in sorted order, except that a ``datasets.save_to_disk`` folder (one holding
``state.json`` and ``dataset_info.json``) contributes its Arrow files in the order
``state.json`` lists them. Token files an earlier ``prepare-data`` wrote there (and their
metadata) are skipped, with one warning, so they are never tokenized as text. A token
file named as an input is refused, and so is an ``--out`` that is one of the files a run
reads (through symlinks and hard links): writing it would destroy the text.
"""

from __future__ import annotations

import glob as globbing
import json
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
    return (
        base.suffix == ".tokens"
        or _is_metadata(base)
        or _is_metadata(base.with_name(base.name + ".json"))
    )


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a ``datasets.save_to_disk`` folder in ``state.json``'s order;
    None for any other folder.

    Raises:
      DataError: for a ``DatasetDict`` folder (name one split), or a ``state.json`` that
        is malformed or lists a missing file.
    """
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"folder '{folder}' is a datasets DatasetDict (splits: "
            f"{', '.join(splits) or 'none'}); name one split's folder, e.g. "
            f"'{folder / (splits[0] if splits else 'train')}'"
        )
    state = folder / "state.json"
    if not (state.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"'{state}' does not list the folder's data files ({err!r}); "
            "re-create it with datasets' save_to_disk"
        ) from None
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise DataError(
                f"'{state}' lists '{file.name}', which is missing; re-create "
                "the folder with datasets' save_to_disk"
            )
    return files


def _folder_files(folder: Path, glob: str | None) -> list[Path]:
    """The regular, non-hidden files below ``folder`` matching ``glob``, sorted by path (a
    ``save_to_disk`` folder's Arrow files in their own order)."""
    groups: list[tuple[tuple[str, ...], list[Path]]] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        here = Path(root)
        shards = dataset_files(here)
        if shards is not None:
            dirs[:] = []  # its files are the shards, in state.json's order
            names = []
            keep = [f for f in shards if _wanted(f, folder, glob)]
            groups.append((here.relative_to(folder).parts, keep))
        for name in names:
            full = here / name
            if _wanted(full, folder, glob) and full.is_file():
                groups.append((full.relative_to(folder).parts, [full]))
    return [f for _, files in sorted(groups, key=lambda g: g[0]) for f in files]


def _wanted(file: Path, folder: Path, glob: str | None) -> bool:
    rel = file.relative_to(folder)
    return not _is_hidden(rel) and (glob is None or rel.match(glob))


def _expand(item: str | os.PathLike) -> list[Path]:
    """``item`` itself, or the paths a glob such as ``shards/*.parquet`` matches, sorted."""
    path = Path(item)
    if path.exists() or not globbing.has_magic(str(item)):
        return [path]
    matches = sorted(globbing.glob(str(item), recursive=True))
    if not matches:
        raise DataError(f"input '{item}' matches no files; check the pattern")
    return [Path(m) for m in matches]


def find_inputs(inputs: Iterable[str | os.PathLike], glob: str | None = None) -> list[Path]:
    """The files to read, in order: each file as given, each glob's matches and each
    folder's files sorted.

    A folder contributes every regular, non-hidden file below it (hidden folders are skipped
    too), sorted by path and, when ``glob`` is given (e.g. ``"*.txt"``), matching it; a
    ``save_to_disk`` folder contributes its Arrow files (see ``dataset_files``). Files
    named directly are always used. Token files (see ``is_token_output``) in a folder are
    skipped with one warning, so an output written inside an input folder is not read back.

    Raises:
      DataError: no inputs, a missing input, a glob matching nothing, a folder without such
        files, a ``DatasetDict`` folder, or a token file named as an input.
    """
    inputs = list(inputs)
    if not inputs:
        raise DataError("no inputs given; name text or record files, folders or globs to tokenize")
    found: list[Path] = []
    skipped: list[Path] = []
    for path in (p for item in inputs for p in _expand(item)):
        files, ours = _input_files(path, glob)
        found.extend(f.absolute() for f in files if f not in ours)
        skipped += sorted(ours)
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} jaxpar token file(s) in the input folders "
            f"(earlier prepare-data outputs, not text), e.g. '{skipped[0]}'",
            stacklevel=2,
        )
    return found


def _input_files(path: Path, glob: str | None) -> tuple[list[Path], set[Path]]:
    """The files of one input, and those of them that are token files (to skip)."""
    if path.is_file():
        if is_token_output(path):
            raise DataError(
                f"input '{path}' is a jaxpar token file or its metadata (a "
                "prepare-data output), not text; name the text files it was "
                "made from, or train on it with data.path"
            )
        return [path], set()
    if not path.is_dir():
        raise DataError(
            f"input '{path}' does not exist (or is not a file or folder); check the path"
        )
    files = _folder_files(path, glob)
    ours = {f for f in files if is_token_output(f)}
    if len(files) == len(ours):
        what = f"matching --glob '{glob}'" if glob is not None else "(hidden files are skipped)"
        also = f" besides {len(ours)} jaxpar token file(s)" if ours else ""
        raise DataError(
            f"folder '{path}' holds no files {what}{also}; add text files or change the pattern"
        )
    return files, ours


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
            raise PathError(
                f"{what} '{path}' is the input file '{source}': writing it would "
                "destroy that text; choose an --out that is none of the inputs, "
                "e.g. a .tokens file outside the input folders"
            )
