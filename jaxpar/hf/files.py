"""A Hugging Face model directory as files: ``config.json`` and safetensors weights (one
``model.safetensors``, or shards named by ``model.safetensors.index.json``), read with
``safetensors.numpy`` (torch is never needed), and its tokenizer (``tokenizer.json`` and
``tokenizer_config.json``); every file written whole (aside, then renamed)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import DataError
from jaxpar.files import disk_full_cause

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
#: transformers' default ``max_shard_size`` (5 GB): larger weights are written in shards
MAX_SHARD_BYTES = 5 * 10**9


def read_json(directory: str | Path, what: str) -> dict[str, Any]:
    """``directory/config.json``.

    Raises:
      DataError: one line naming the missing or unreadable file.
    """
    where = f"model.init_from={directory}"
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise DataError(
            f"{where}: no {CONFIG} there; give a directory holding a Hugging "
            f"Face {what} model ({CONFIG} and {WEIGHTS})"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: {CONFIG} cannot be read: {err}") from None


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a folder: ``model.safetensors``, or those its index names,
    each there (checked before a run starts, not when its weights are read).

    Raises:
      DataError: no safetensors there, an index that is not one, or a file it names missing.
    """
    directory = Path(directory)
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    if not (directory / INDEX).is_file():
        raise DataError(
            f"model.init_from={directory}: no {WEIGHTS} there (only safetensors "
            "files are read; convert a pytorch_model.bin with transformers' "
            "save_pretrained(safe_serialization=True))"
        )
    try:
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"model.init_from={directory}: {INDEX} is not a safetensors "
            f"index ({type(err).__name__}: {err}); re-save the model"
        ) from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(
            f"model.init_from={directory}: {INDEX} names {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not there; copy the whole folder again"
        )
    return files


def read_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` (or of the files a sharded index names)."""
    from safetensors.numpy import load_file

    files = weight_files(directory)
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors |= load_file(str(f))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise DataError(
                f"model.init_from={directory}: {f.name} cannot be read as "
                f"safetensors ({type(err).__name__}: {err}); re-save the "
                "model"
            ) from None
    return tensors


def _shards(tensors: dict[str, np.ndarray], limit: int) -> list[dict[str, np.ndarray]]:
    """The tensors in order, cut into groups of at most ``limit`` bytes (a larger tensor
    alone), as transformers' ``save_pretrained`` cuts them."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def write_dir(
    out: str | Path,
    tensors: dict[str, np.ndarray],
    config: dict[str, Any],
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Writes ``config.json`` and the weights (float32, ``{"format": "pt"}`` metadata) to
    the directory ``out``: one ``model.safetensors``, or shards and their index above
    ``max_shard_bytes``. Each file appears whole (written aside, then renamed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    names = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    files: list[tuple[Path, Any]] = [(out / n, s) for n, s in zip(names, shards)]
    files.append((out / CONFIG, json.dumps(config, indent=2) + "\n"))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
            "weight_map": {k: n for n, s in zip(names, shards) for k in s},
        }
        files.append((out / INDEX, json.dumps(index, indent=2) + "\n"))
    _write_whole(files)
    return out


#: What a Hugging Face model folder's files are named (an export replaces them all, so no
#: shard or tokenizer of an earlier model is left beside the new one).
MODEL_FILES = (
    CONFIG,
    WEIGHTS,
    INDEX,
    "model-*-of-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    GENERATION_CONFIG,
)


def model_files(directory: str | Path) -> list[Path]:
    """The model files (:data:`MODEL_FILES`) in ``directory``."""
    directory = Path(directory)
    return sorted({p for pattern in MODEL_FILES for p in directory.glob(pattern) if p.is_file()})


def model_file_ids(directory: str | Path) -> dict[Path, int]:
    """:func:`model_files` and their inode numbers: which of them a new model's files
    (each renamed over its path) replace, :func:`remove_stale` tells afterwards."""
    return {path: path.stat().st_ino for path in model_files(directory)}


def remove_stale(earlier: dict[Path, int]) -> None:
    """Deletes the files of ``earlier`` (:func:`model_file_ids`, taken before a model was
    written) that it did not replace: an earlier model's shards, index or tokenizer.
    Called once the new model is whole, so a failed write leaves the earlier one."""
    for path, inode in earlier.items():
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_ino == inode:
                path.unlink()


def write_tokenizer(
    out: str | Path,
    tokenizer_json: str | Path,
    special: dict[str, str],
    ids: dict[str, int] | None = None,
) -> Path:
    """Copies a ``tokenizers`` JSON file to ``out/tokenizer.json`` and writes the
    ``tokenizer_config.json`` that makes ``transformers.AutoTokenizer`` load it as a
    ``PreTrainedTokenizerFast``, and with ``ids`` a ``generation_config.json`` naming them
    (so ``generate`` and ``jaxpar sample`` stop at its end-of-text token).

    Args:
      out: the model directory.
      tokenizer_json: the ``tokenizers`` JSON file.
      special: its special tokens by transformers' name (``{"eos_token": "<|endoftext|>"}``).
      ids: their ids by transformers' name (``{"eos_token_id": 0}``).
    """
    out = Path(out)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    files: list[tuple[Path, Any]] = [
        (out / TOKENIZER, Path(tokenizer_json).read_bytes()),
        (out / TOKENIZER_CONFIG, json.dumps(config, indent=2) + "\n"),
    ]
    if ids:
        files.append((out / GENERATION_CONFIG, json.dumps(ids, indent=2) + "\n"))
    _write_whole(files)
    return out / TOKENIZER


def _write_whole(files: list[tuple[Path, Any]]) -> None:
    """Writes each (path, body) aside, then renames them all: text, bytes, or tensors
    (safetensors)."""
    from safetensors.numpy import save_file

    temporary = [path.with_name(path.name + ".tmp") for path, _ in files]
    try:
        for (path, body), tmp in zip(files, temporary):
            try:
                if isinstance(body, str):
                    tmp.write_text(body)
                elif isinstance(body, bytes):
                    tmp.write_bytes(body)
                else:  # transformers refuses safetensors files without a "format" entry
                    save_file(body, str(tmp), metadata={"format": "pt"})
            except Exception as err:  # safetensors' error type wraps the OS's
                if disk_full_cause(err) is None:
                    raise
                raise OSError(errno.ENOSPC, "No space left on device", str(path)) from err
        for (path, _), tmp in zip(files, temporary):
            os.replace(tmp, path)
    finally:
        for tmp in temporary:
            tmp.unlink(missing_ok=True)
