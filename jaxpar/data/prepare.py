"""Token files: local text and records turned into a memory-mapped array of token ids plus
JSON metadata.

``prepare_data(["notes/", "book.txt", "shards/*.parquet"], "corpus.tokens")`` writes two files:

    corpus.tokens       raw little-endian token ids: uint16 when vocab_size ≤ 65536, else uint32
    corpus.tokens.json  {"format": "jaxpar-tokens", "version": 1, "dtype": "uint16",
                         "vocab_size": 256, "num_tokens": N,
                         "tokenizer": "byte" | {"file": "/abs/tok.json", "sha256": "…"},
                         "bos": null | {"token": "<s>", "id": 1}, "eos": null | {…},
                         "documents": [{"source": "/abs/notes/a.txt", "start": 0, "end": 812},
                                       {"source": "/abs/d.parquet", "record": 0, …}, …]}

A document is a text file or one record's ``text_key`` field (``jaxpar/data/records.py``
reads JSON Lines, Parquet and Arrow). Documents are concatenated in input order, each
wrapped in the tokenizer's separators (``separators``: its BOS where its post-processor
adds one, its end-of-text token; none for the byte tokenizer), which lie inside the
document's ``[start, end)``. A document holds at most ``MAX_DOCUMENT_TOKENS`` tokens.
Nothing is ever downloaded: the tokenizer is ``byte`` (UTF-8 bytes, vocab 256) or a local
Hugging Face ``tokenizers`` JSON file. ``open_tokens`` maps the file back read-only, so
training can read fixed-length windows without loading the corpus into memory. What is
read comes from ``find_inputs`` (``jaxpar/data/inputs.py``): never an earlier output, and
``out`` is never an input.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data.inputs import FORMAT, check_not_an_input, find_inputs
from jaxpar.data.records import TEXT_KEY, Document, read_documents
from jaxpar.data.tokenizers import (
    ByteTokenizer,
    Separators,
    Tokenizer,
    describe_separators,
    encode_batches,
    load_hf,
    load_tokenizer,
    separators,
    sha256_of,
)
from jaxpar.errors import DataError
from jaxpar.files import check_output_file

VERSION = 1
BUILTIN_NAME = "pydoc_data.topics"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
#: the most tokens one document may hold, separators included (it is encoded in memory)
MAX_DOCUMENT_TOKENS = 2**30


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stored dtype for ids in [0, vocab_size): little-endian uint16 or uint32."""
    if not 0 < vocab_size <= 2**32:
        raise DataError(f"vocab_size {vocab_size} must be in [1, 2**32]")
    return _DTYPES["uint16" if vocab_size <= 2**16 else "uint32"]


def _metadata(tok: Tokenizer, seps: Separators, num_tokens: int,
              documents: list[dict]) -> dict[str, Any]:
    """The metadata dict; ``format`` comes first (``is_token_output`` reads the start)."""
    return {"format": FORMAT, "version": VERSION, "dtype": token_dtype(tok.vocab_size).name,
            "vocab_size": tok.vocab_size, "num_tokens": num_tokens,
            "tokenizer": tok.describe(), **describe_separators(tok, seps),
            "documents": documents}


def _entry(doc: Document, start: int, end: int) -> dict[str, Any]:
    """A document's metadata entry: its file, its record (for a record) and its span."""
    record = {} if doc.record is None else {"record": doc.record}
    return {"source": doc.source, **record, "start": start, "end": end}


def _encode_stream(docs: Iterable[Document | tuple[str, bytes]], tok: Tokenizer,
                   seps: Separators, progress: bool | None = False
                   ) -> Iterator[tuple[np.ndarray, dict]]:
    """Each document's stored ids and its metadata entry, offsets counted across documents."""
    dtype, start = token_dtype(tok.vocab_size), 0
    for doc, ids in encode_batches((Document(*d) for d in docs), tok, progress):
        ids = seps.wrap(ids)
        assert ids.size == 0 or int(ids.max()) < tok.vocab_size, (doc.source, int(ids.max()))
        _check_length(doc, ids.size)
        yield ids.astype(dtype), _entry(doc, start, start + ids.size)
        start += ids.size


def _check_length(doc: Document, num_tokens: int) -> None:
    if num_tokens > MAX_DOCUMENT_TOKENS:
        raise DataError(f"document '{doc.name}' holds {num_tokens:,} tokens, more than "
                        f"the {MAX_DOCUMENT_TOKENS:,} a document may hold; split it")


def _check_nonempty(num_tokens: int, sources: list[str]) -> None:
    if num_tokens == 0:
        sources = list(dict.fromkeys(sources))  # a record file's documents share its name
        shown = ", ".join(f"'{s}'" for s in sources[:5]) + (" …" if len(sources) > 5 else "")
        raise DataError(f"the inputs ({shown}) hold zero tokens; add files with text in them")


def encode_documents(docs: Iterable[Document | tuple[str, bytes]],
                     tokenizer: str | Tokenizer, bos: str = "auto", eos: str = "auto"
                     ) -> tuple[np.ndarray, dict[str, Any]]:
    """Token ids of ``(source, raw bytes)`` documents (or ``Document``s), each wrapped in
    the tokenizer's separators (see ``separators``), concatenated, and their metadata.

    Pure: nothing is read or written besides (for a tokenizer path) the tokenizer file.

    Returns:
      ``(tokens, meta)``: a 1-D little-endian uint16/uint32 array and the metadata dict that
      ``prepare_data`` writes next to a token file.

    Raises:
      DataError: when the documents hold no tokens, a document is longer than
        ``MAX_DOCUMENT_TOKENS`` or is not UTF-8 for a Hugging Face tokenizer, or a
        separator names a token the tokenizer lacks.
    """
    tok = load_tokenizer(tokenizer)
    seps = separators(tok, bos, eos)
    parts, documents = [], []
    for ids, entry in _encode_stream(docs, tok, seps):
        parts.append(ids)
        documents.append(entry)
    tokens = np.concatenate(parts) if parts else np.zeros(0, token_dtype(tok.vocab_size))
    _check_nonempty(tokens.size, [d["source"] for d in documents])
    return tokens, _metadata(tok, seps, int(tokens.size), documents)


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


def prepare_data(inputs: Iterable[str | os.PathLike], out: str | os.PathLike,
                 tokenizer: str | Tokenizer = "byte", glob: str | None = None, *,
                 text_key: str = TEXT_KEY, bos: str = "auto", eos: str = "auto"
                 ) -> TokenFile:
    """Tokenize local files, folders and globs (text and records) into ``out`` and
    ``out + ".json"``.

    Documents are read and encoded a batch (``BATCH_BYTES`` of text) at a time, on every
    thread of the tokenizer library, and the ids streamed to disk, so memory holds a batch,
    not the corpus; a progress bar shows on a terminal. The token file is written under a temporary name and
    renamed, and the metadata written last, so a crash never leaves a valid-looking pair.

    Args:
      inputs: files, folders and globs (see ``jaxpar.data.inputs.find_inputs``).
      out: the token file to write, e.g. ``corpus.tokens``; parent folders are created.
      tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizers`` JSON file.
      glob: keep only folder files matching this pattern, e.g. ``"*.txt"``.
      text_key: the field of each record that holds its text.
      bos, eos: ``"auto"``, ``"none"`` or a token (see ``separators``).

    Returns:
      The written file, opened with ``open_tokens``.

    Raises:
      DataError: for a missing input, a folder without matching files, a token file named
        as an input, a binary file of no record format, a bad record (see
        ``records.read_documents``), a non-UTF-8 file with a Hugging Face tokenizer, a
        document longer than ``MAX_DOCUMENT_TOKENS``, or inputs holding zero tokens.
      PathError: for an ``out`` (or its metadata or temporary file) that is an input file.
    """
    tok = load_tokenizer(tokenizer)
    seps = separators(tok, bos, eos)
    out = check_output_file(Path(out).absolute(), "--out")
    meta_path, tmp = _meta_path(out), out.with_name(out.name + ".tmp")
    files = find_inputs(inputs, glob)
    check_not_an_input({out: "--out", meta_path: "the metadata file of --out",
                        tmp: "the temporary file of --out"}, files)
    try:
        documents = _write_tokens(tmp, read_documents(files, text_key), tok, seps)
        num_tokens = documents[-1]["end"] if documents else 0
        _check_nonempty(num_tokens, [str(p) for p in files])
        meta_path.unlink(missing_ok=True)  # an old pair must not describe the new tokens
        os.replace(tmp, out)
        meta = _metadata(tok, seps, num_tokens, documents)
        meta_path.write_text(json.dumps(meta, indent=1))
    except OSError as err:
        if err.errno == errno.ENOSPC:  # name the file (tofile's error does not)
            out.unlink(missing_ok=True)
            raise OSError(errno.ENOSPC, "No space left on device", str(out)) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return open_tokens(out)


def _write_tokens(tmp: Path, docs: Iterable[Document], tok: Tokenizer, seps: Separators
                  ) -> list[dict[str, Any]]:
    """Stream the ids of ``docs`` into ``tmp``; their metadata entries."""
    documents = []
    with open(tmp, "wb") as f:
        for ids, entry in _encode_stream(docs, tok, seps, progress=None):
            ids.tofile(f)  # already little-endian: the dtype says so explicitly
            documents.append(entry)
    return documents


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = _meta_path(path)
    fix = f"re-create it with: jaxpar prepare-data TEXT… --out {path}"
    if not meta_path.is_file():
        raise DataError(f"metadata file '{meta_path}' of token file '{path}' is missing; {fix}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"metadata file '{meta_path}' is not valid JSON ({err}); {fix}") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise DataError(f"metadata file '{meta_path}' is not a {FORMAT} file "
                        f"(format={found!r}); {fix}")
    if meta.get("version") != VERSION:
        raise DataError(f"metadata file '{meta_path}' has unknown version {meta.get('version')!r}"
                        f" (this jaxpar reads version {VERSION}); {fix}")
    if meta.get("dtype") not in _DTYPES:
        raise DataError(f"metadata file '{meta_path}': dtype {meta.get('dtype')!r} must be "
                        f"one of {sorted(_DTYPES)}; {fix}")
    for key, least in (("vocab_size", 1), ("num_tokens", 0)):
        value = meta.get(key)
        if type(value) is not int or value < least:
            raise DataError(f"metadata file '{meta_path}': {key}={value!r} must be an integer "
                            f">= {least}; {fix}")
    if meta["vocab_size"] - 1 > np.iinfo(_DTYPES[meta["dtype"]]).max:
        raise DataError(f"metadata file '{meta_path}': vocab_size={meta['vocab_size']} does not "
                        f"fit dtype {meta['dtype']}; {fix}")
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
        raise DataError(f"token file '{path}' does not exist; create it with: "
                        f"jaxpar prepare-data TEXT… --out {path}")
    meta = _read_meta(path)
    dtype, num_tokens = _DTYPES[meta["dtype"]], meta["num_tokens"]
    size = path.stat().st_size
    if size != num_tokens * dtype.itemsize:
        other = [name for name, d in _DTYPES.items()
                 if d != dtype and size == num_tokens * d.itemsize]
        why = (f"it holds {num_tokens} {other[0]} ids: it was written with another dtype than "
               f"its metadata's {meta['dtype']}" if other else
               "it is truncated" if size < num_tokens * dtype.itemsize else
               "it is longer than its metadata says (corrupt, or the metadata is stale)")
        raise DataError(f"token file '{path}' has {size} bytes but its metadata says "
                        f"{num_tokens} {meta['dtype']} tokens = {num_tokens * dtype.itemsize} "
                        f"bytes: {why}; re-create it with jaxpar prepare-data")
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
        raise DataError(f"token file '{tf.name}' holds token id {top} but its vocab_size is "
                        f"{tf.vocab_size}: it is corrupt; re-create it with jaxpar prepare-data")
    edges = [(d.get("start"), d.get("end")) for d in tf.documents]
    expected = [0] + [e for _, e in edges[:-1]]
    if ([s for s, _ in edges] != expected or (edges and edges[-1][1] != tf.num_tokens)
            or any(not isinstance(s, int) or not isinstance(e, int) or e < s for s, e in edges)):
        raise DataError(f"token file '{tf.name}': the metadata's documents do not tile "
                        f"[0, {tf.num_tokens}); re-create it with jaxpar prepare-data")


def decode(token_file: TokenFile, start: int = 0, end: int | None = None) -> str | bytes:
    """The text of ``tokens[start:end]``: bytes for the byte tokenizer, else str.

    Raises:
      DataError: for a range outside the file, or a tokenizer file that is missing or has
        changed since the token file was written.
    """
    end = token_file.num_tokens if end is None else end
    if not 0 <= start <= end <= token_file.num_tokens:
        raise DataError(f"range [{start}, {end}) is outside token file '{token_file.name}' "
                        f"of {token_file.num_tokens} tokens")
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
        raise DataError(f"the ids of '{token_file.name}' come from no tokenizer "
                        f"(tokenizer {spec!r}), so they have no text")
    file = Path(spec["file"])
    if not file.is_file():
        raise DataError(f"tokenizer file '{file}' of token file '{token_file.name}' is "
                        "missing; restore it to decode")
    if sha256_of(file) != spec["sha256"]:
        raise DataError(f"tokenizer file '{file}' changed since token file "
                        f"'{token_file.name}' was written (sha256 differs); restore it")
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
        raise DataError(f"{where} has vocab_size {token_file.vocab_size} "
                        f"but model.vocab_size={model_vocab_size}; set model.vocab_size to at "
                        f"least {token_file.vocab_size}")
    if token_file.path is None or token_file.tokens.size == 0:
        return
    top = largest_id(token_file)
    if top >= token_file.vocab_size or top >= model_vocab_size:
        bound = min(token_file.vocab_size, model_vocab_size)
        whose = ("its metadata's vocab_size" if token_file.vocab_size <= model_vocab_size
                 else "model.vocab_size")
        raise DataError(f"{where} holds token id {top} (its largest), at or above {whose} "
                        f"{bound}: ids must be below it; the file is corrupt or was made with "
                        f"another tokenizer — re-create it with jaxpar prepare-data, or set "
                        f"model.vocab_size ≥ {top + 1} if the ids are right")


def largest_id(token_file: TokenFile, chunk: int = 1 << 24) -> int:
    """The largest id in a token file: one sequential pass over the mapped file, in chunks
    (≈1 s per GB here)."""
    tokens = token_file.tokens
    return max(int(tokens[i:i + chunk].max()) for i in range(0, tokens.size, chunk))


def builtin_text() -> bytes:
    """The Python reference topics shipped in ``pydoc_data.topics`` (≈466 kB of English
    technical prose), as UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def builtin_corpus() -> TokenFile:
    """The built-in text (``pydoc_data.topics``), byte-tokenized, as an in-memory TokenFile."""

    tokens, meta = encode_documents([(BUILTIN_NAME, builtin_text())], "byte")
    return TokenFile(tokens, meta["vocab_size"], meta, BUILTIN_NAME)
