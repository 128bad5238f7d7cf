"""Token files read back: the ids memory-mapped read-only, their metadata checked, their
text decoded with the tokenizer that wrote them (``jaxpar.data.prepare`` writes them; its
docstring gives the format)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data.inputs import FORMAT
from jaxpar.data.tokenizers import ByteTokenizer, Tokenizer, load_hf, sha256_of
from jaxpar.errors import DataError

VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stored dtype for ids in [0, vocab_size): little-endian uint16 or uint32."""
    if not 0 < vocab_size <= 2**32:
        raise DataError(f"vocab_size {vocab_size} must be in [1, 2**32]")
    return _DTYPES["uint16" if vocab_size <= 2**16 else "uint32"]


@dataclass(frozen=True, eq=False)
class TokenFile:
    """Token ids and their metadata, memory-mapped from a token file or held in memory.

    Attributes:
      tokens: 1-D ids, ``np.memmap`` (read-only) for files, ``np.ndarray`` otherwise.
      vocab_size: every id is below it.
      meta: the metadata dict (see the module docstring).
      name: the file's path, or a name such as ``"pydoc_data.topics"`` for in-memory data.
      path: the token file, or None for in-memory data.
    """

    tokens: np.ndarray
    vocab_size: int
    meta: dict[str, Any]
    name: str
    path: Path | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def documents(self) -> list[dict[str, Any]]:
        return self.meta["documents"]


def meta_path_of(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = meta_path_of(path)
    fix = f"re-create it with: jaxpar prepare-data TEXT… --out {path}"
    if not meta_path.is_file():
        raise DataError(f"metadata file '{meta_path}' of token file '{path}' is missing; {fix}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"metadata file '{meta_path}' is not valid JSON ({err}); {fix}") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise DataError(
            f"metadata file '{meta_path}' is not a {FORMAT} file (format={found!r}); {fix}"
        )
    if meta.get("version") != VERSION:
        raise DataError(
            f"metadata file '{meta_path}' has unknown version {meta.get('version')!r}"
            f" (this jaxpar reads version {VERSION}); {fix}"
        )
    if meta.get("dtype") not in _DTYPES:
        raise DataError(
            f"metadata file '{meta_path}': dtype {meta.get('dtype')!r} must be "
            f"one of {sorted(_DTYPES)}; {fix}"
        )
    for key, least in (("vocab_size", 1), ("num_tokens", 0)):
        value = meta.get(key)
        if type(value) is not int or value < least:
            raise DataError(
                f"metadata file '{meta_path}': {key}={value!r} must be an integer >= {least}; {fix}"
            )
    if meta["vocab_size"] - 1 > np.iinfo(_DTYPES[meta["dtype"]]).max:
        raise DataError(
            f"metadata file '{meta_path}': vocab_size={meta['vocab_size']} does not "
            f"fit dtype {meta['dtype']}; {fix}"
        )
    return meta


def open_tokens(path: str | os.PathLike, validate: bool = False) -> TokenFile:
    """Memory-map a token file written by ``prepare_data`` (read-only).

    Args:
      path: the token file (its metadata is ``path + ".json"``).
      validate: also check every id is below ``vocab_size`` (one pass over the file) and that
        the documents tile ``[0, num_tokens)``.

    Raises:
      DataError: for a missing token or metadata file, metadata that is not jaxpar-tokens
        version 1, a dtype other than uint16/uint32, a file size that does not match
        ``num_tokens`` (truncated or corrupt), or (with ``validate``) an id out of range.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"token file '{path}' does not exist; create it with: "
            f"jaxpar prepare-data TEXT… --out {path}"
        )
    meta = _read_meta(path)
    dtype, num_tokens = _DTYPES[meta["dtype"]], meta["num_tokens"]
    size = path.stat().st_size
    if size != num_tokens * dtype.itemsize:
        other = [
            name for name, d in _DTYPES.items() if d != dtype and size == num_tokens * d.itemsize
        ]
        why = (
            f"it holds {num_tokens} {other[0]} ids: it was written with another dtype than "
            f"its metadata's {meta['dtype']}"
            if other
            else "it is truncated"
            if size < num_tokens * dtype.itemsize
            else "it is longer than its metadata says (corrupt, or the metadata is stale)"
        )
        raise DataError(
            f"token file '{path}' has {size} bytes but its metadata says "
            f"{num_tokens} {meta['dtype']} tokens = {num_tokens * dtype.itemsize} "
            f"bytes: {why}; re-create it with jaxpar prepare-data"
        )
    if num_tokens == 0:  # np.memmap cannot map an empty file
        raise DataError(f"token file '{path}' holds zero tokens; re-create it from non-empty text")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))
    token_file = TokenFile(tokens, meta["vocab_size"], meta, str(path), path)
    if validate:
        _validate(token_file)
    return token_file


def _validate(tf: TokenFile) -> None:
    top = int(np.max(tf.tokens))
    if top >= tf.vocab_size:
        raise DataError(
            f"token file '{tf.name}' holds token id {top} but its vocab_size is "
            f"{tf.vocab_size}: it is corrupt; re-create it with jaxpar prepare-data"
        )
    edges = [(d.get("start"), d.get("end")) for d in tf.documents]
    expected = [0] + [e for _, e in edges[:-1]]
    if (
        [s for s, _ in edges] != expected
        or (edges and edges[-1][1] != tf.num_tokens)
        or any(not isinstance(s, int) or not isinstance(e, int) or e < s for s, e in edges)
    ):
        raise DataError(
            f"token file '{tf.name}': the metadata's documents do not tile "
            f"[0, {tf.num_tokens}); re-create it with jaxpar prepare-data"
        )


def decode(token_file: TokenFile, start: int = 0, end: int | None = None) -> str | bytes:
    """The text of ``tokens[start:end]``: bytes for the byte tokenizer, else str.

    Raises:
      DataError: for a range outside the file, or a tokenizer file that is missing or has
        changed since the token file was written.
    """
    end = token_file.num_tokens if end is None else end
    if not 0 <= start <= end <= token_file.num_tokens:
        raise DataError(
            f"range [{start}, {end}) is outside token file '{token_file.name}' "
            f"of {token_file.num_tokens} tokens"
        )
    return tokenizer_of(token_file).decode(token_file.tokens[start:end])


def tokenizer_of(token_file: TokenFile) -> Tokenizer:
    """The tokenizer a token file was written with (its metadata's ``tokenizer``).

    Raises:
      DataError: for a tokenizer file that is missing or has changed since the token
        file was written, or ids that no tokenizer made (synthetic data).
    """
    spec = token_file.meta.get("tokenizer")
    if spec == "byte":
        return ByteTokenizer()
    if not isinstance(spec, dict) or "file" not in spec:
        raise DataError(
            f"the ids of '{token_file.name}' come from no tokenizer "
            f"(tokenizer {spec!r}), so they have no text"
        )
    file = Path(spec["file"])
    if not file.is_file():
        raise DataError(
            f"tokenizer file '{file}' of token file '{token_file.name}' is "
            "missing; restore it to decode"
        )
    if sha256_of(file) != spec["sha256"]:
        raise DataError(
            f"tokenizer file '{file}' changed since token file "
            f"'{token_file.name}' was written (sha256 differs); restore it"
        )
    return load_hf(str(file), spec["sha256"])


def check_vocab(token_file: TokenFile, model_vocab_size: int | None) -> None:
    """Raise when the file's ids do not all fit the model's embedding table (None: no
    model bound, only the file's own vocabulary): its declared vocabulary, and (for a
    token file) the largest id it actually holds — an id at or above the vocabulary would
    read past the embedding table and surface only later as a NaN loss."""
    where = f"data.path '{token_file.name}'" if token_file.path else f"data '{token_file.name}'"
    if model_vocab_size is None:
        model_vocab_size = token_file.vocab_size
    if token_file.vocab_size > model_vocab_size:
        raise DataError(
            f"{where} has vocab_size {token_file.vocab_size} "
            f"but model.vocab_size={model_vocab_size}; set model.vocab_size to at "
            f"least {token_file.vocab_size} (where model.init_from's folder decides it: "
            "give data.path a token file made with its tokenizer, jaxpar prepare-data "
            "FILES --tokenizer FOLDER --out FILE.tokens)"
        )
    if token_file.path is None or token_file.tokens.size == 0:
        return
    top = largest_id(token_file)
    if top >= token_file.vocab_size or top >= model_vocab_size:
        bound = min(token_file.vocab_size, model_vocab_size)
        whose = (
            "its metadata's vocab_size"
            if token_file.vocab_size <= model_vocab_size
            else "model.vocab_size"
        )
        raise DataError(
            f"{where} holds token id {top} (its largest), at or above {whose} "
            f"{bound}: ids must be below it; the file is corrupt or was made with "
            f"another tokenizer — re-create it with jaxpar prepare-data, or set "
            f"model.vocab_size ≥ {top + 1} if the ids are right"
        )


def largest_id(token_file: TokenFile, chunk: int = 1 << 24) -> int:
    """The largest id in a token file: one sequential pass over the mapped file, in chunks
    (≈1 s per GB here)."""
    tokens = token_file.tokens
    return max(int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk))
