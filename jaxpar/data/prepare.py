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
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data.encoding import WorkerDied, default_workers, encode_batches
from jaxpar.data.inputs import FORMAT, check_not_an_input, find_inputs
from jaxpar.data.partial import Partial, partial_folder, recipe
from jaxpar.data.records import TEXT_KEY, Document, read_documents
from jaxpar.data.token_file import (
    VERSION,
    TokenFile,
    meta_path_of,
    open_tokens,
    token_dtype,
)
from jaxpar.data.tokenizers import (
    Separators,
    Tokenizer,
    describe_separators,
    load_tokenizer,
    separators,
)
from jaxpar.errors import INTERRUPTED, TERMINATED, DataError, Paused, Terminated
from jaxpar.files import check_output_file, refuse_existing

BUILTIN_NAME = "pydoc_data.topics"
#: the most tokens one document may hold, separators included (it is encoded in memory)
MAX_DOCUMENT_TOKENS = 2**30


def _metadata(
    tok: Tokenizer, seps: Separators, num_tokens: int, documents: list[dict]
) -> dict[str, Any]:
    """The metadata dict; ``format`` comes first (``is_token_output`` reads the start)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": token_dtype(tok.vocab_size).name,
        "vocab_size": tok.vocab_size,
        "num_tokens": num_tokens,
        "tokenizer": tok.describe(),
        **describe_separators(tok, seps),
        "documents": documents,
    }


def _entry(doc: Document, start: int, end: int) -> dict[str, Any]:
    """A document's metadata entry: its file, its record (for a record) and its span."""
    record = {} if doc.record is None else {"record": doc.record}
    return {"source": doc.source, **record, "start": start, "end": end}


def _encode_stream(
    docs: Iterable[Document | tuple[str, bytes]],
    tok: Tokenizer,
    seps: Separators,
    progress: bool | None = False,
    start: int = 0,
    workers: int = 1,
) -> Iterator[tuple[np.ndarray, list[dict]]]:
    """Each batch's stored ids and its documents' metadata entries, offsets counted across
    documents from ``start``."""
    docs = (Document(*d) for d in docs)
    for batch in encode_batches(docs, tok, seps, token_dtype(tok.vocab_size), progress, workers):
        for doc, size in zip(batch.docs, batch.lengths):
            _check_length(doc, int(size))
        ends = (start + np.cumsum(batch.lengths)).tolist()
        yield (
            batch.ids,
            [
                _entry(doc, end - int(size), end)
                for doc, size, end in zip(batch.docs, batch.lengths, ends)
            ],
        )
        start = ends[-1] if ends else start


def _check_length(doc: Document, num_tokens: int) -> None:
    if num_tokens > MAX_DOCUMENT_TOKENS:
        raise DataError(
            f"document '{doc.name}' holds {num_tokens:,} tokens, more than "
            f"the {MAX_DOCUMENT_TOKENS:,} a document may hold; split it"
        )


def _check_nonempty(num_tokens: int, sources: list[str]) -> None:
    if num_tokens == 0:
        sources = list(dict.fromkeys(sources))  # a record file's documents share its name
        shown = ", ".join(f"'{s}'" for s in sources[:5]) + (" …" if len(sources) > 5 else "")
        raise DataError(f"the inputs ({shown}) hold zero tokens; add files with text in them")


def encode_documents(
    docs: Iterable[Document | tuple[str, bytes]],
    tokenizer: str | Tokenizer,
    bos: str = "auto",
    eos: str = "auto",
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
    for ids, entries in _encode_stream(docs, tok, seps):
        parts.append(ids)
        documents += entries
    tokens = np.concatenate(parts) if parts else np.zeros(0, token_dtype(tok.vocab_size))
    _check_nonempty(tokens.size, [d["source"] for d in documents])
    return tokens, _metadata(tok, seps, int(tokens.size), documents)


def prepare_data(
    inputs: Iterable[str | os.PathLike],
    out: str | os.PathLike,
    tokenizer: str | Tokenizer = "byte",
    glob: str | None = None,
    *,
    text_key: str = TEXT_KEY,
    bos: str = "auto",
    eos: str = "auto",
    workers: int | None = None,
    overwrite: bool = False,
) -> TokenFile:
    """Tokenize local files, folders and globs (text and records) into ``out`` and
    ``out + ".json"``, resuming an interrupted run of the same command.

    Documents are read and encoded a batch at a time, on ``workers`` processes (see
    ``jaxpar.data.encoding``), and the ids streamed to disk in input order, so memory holds
    a few batches, not the corpus; a progress bar shows on a terminal. The ids go to a
    hidden partial folder beside ``out`` (``jaxpar.data.partial``) that a Ctrl-C, a
    SIGTERM or a crash leaves behind: the same command with the same inputs continues from
    its last checkpoint (a few seconds back) and writes the same file as an uninterrupted
    run. The metadata is written last, so a stop never leaves a valid-looking pair.

    Args:
      inputs: files, folders and globs (see ``jaxpar.data.inputs.find_inputs``).
      out: the token file to write, e.g. ``corpus.tokens``; parent folders are created.
      tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizers`` JSON file.
      glob: keep only folder files matching this pattern, e.g. ``"*.txt"``.
      text_key: the field of each record that holds its text.
      bos, eos: ``"auto"``, ``"none"`` or a token (see ``separators``).
      workers: processes that encode (None: one per CPU core this process may use; 1:
        this process, on the tokenizer library's threads). The ids do not depend on it.
      overwrite: replace an existing ``out`` (and its metadata); else that is refused.

    Returns:
      The written file, opened with ``open_tokens``.

    Raises:
      DataError: for a missing input, a folder without matching files, a token file named
        as an input, a binary file of no record format, a bad record (see
        ``records.read_documents``), a non-UTF-8 file with a Hugging Face tokenizer, a
        document longer than ``MAX_DOCUMENT_TOKENS``, or inputs holding zero tokens.
      Paused: for a Ctrl-C or SIGTERM (what was written is kept for the next run).
      PathError: for an ``out`` (or its metadata or partial files) that is an input file,
        or that exists without ``overwrite``.
    """
    tok = load_tokenizer(tokenizer)
    seps = separators(tok, bos, eos)
    out = check_output_file(Path(out).absolute(), "--out")
    files = find_inputs(inputs, glob)
    _check_outputs(out, files, overwrite)
    dtype = token_dtype(tok.vocab_size)
    partial = Partial(out, recipe(files, _settings(tok, seps, text_key, dtype)), dtype)
    try:
        _encode_into(partial, files, tok, seps, text_key, workers or default_workers())
        _finish(partial, out, tok, seps)
    except DataError:
        partial.discard()  # the inputs must change first, and then the recipe differs
        raise
    except (KeyboardInterrupt, Terminated, WorkerDied) as err:
        raise _paused(partial, out, err) from None
    except OSError as err:
        partial.close()
        if err.errno == errno.ENOSPC:  # name the file (the write's error does not)
            raise OSError(errno.ENOSPC, "No space left on device", str(out)) from err
        raise
    return open_tokens(out)


def _check_outputs(out: Path, files: list[Path], overwrite: bool) -> None:
    """Refuses an ``out`` (its metadata or partial file) that is one of the input
    ``files``, or that exists without ``overwrite``."""
    meta_path = meta_path_of(out)
    check_not_an_input(
        {
            out: "--out",
            meta_path: "the metadata file of --out",
            partial_folder(out) / "tokens": "the partial file of --out",
        },
        files,
    )
    refuse_existing({out: "--out", meta_path: "the metadata file of --out"}, overwrite)


def _settings(tok: Tokenizer, seps: Separators, text_key: str, dtype: np.dtype) -> dict:
    """What the ids depend on besides the inputs: a partial folder written with other
    settings is not continued (:func:`jaxpar.data.partial.recipe`)."""
    return {
        "version": VERSION,
        "tokenizer": tok.describe(),
        "bos": seps.bos,
        "eos": seps.eos,
        "text_key": text_key,
        "dtype": dtype.name,
    }


def _encode_into(
    partial: Partial,
    files: list[Path],
    tok: Tokenizer,
    seps: Separators,
    text_key: str,
    workers: int,
) -> None:
    """Encodes the documents of ``files`` that ``partial`` does not hold yet, appending
    their ids; refuses inputs that hold no tokens at all."""
    docs = _remaining(files, text_key, partial.documents)
    for ids, entries in _encode_stream(docs, tok, seps, None, partial.num_tokens, workers):
        partial.append(ids, entries)
    _check_nonempty(partial.num_tokens, [str(p) for p in files])


def _finish(partial: Partial, out: Path, tok: Tokenizer, seps: Separators) -> None:
    """Moves the ids to ``out`` and writes its metadata last, so a stop never leaves a
    valid-looking pair."""
    meta_path = meta_path_of(out)
    meta_path.unlink(missing_ok=True)  # an old pair must not describe the new tokens
    partial.finish(out)
    meta = _metadata(tok, seps, partial.num_tokens, partial.documents)
    meta_path.write_text(json.dumps(meta, indent=1))


def _paused(partial: Partial, out: Path, err: BaseException) -> Paused:
    """Keep what is written for the next run; the one line that says so."""
    partial.checkpoint()
    partial.close()
    if isinstance(err, WorkerDied):
        what, status = f"{err}", TERMINATED
    elif isinstance(err, KeyboardInterrupt):
        what, status = "interrupted (Ctrl-C)", INTERRUPTED
    else:
        what, status = "stopped (SIGTERM)", TERMINATED
    return Paused(
        f"{what}: {len(partial.documents):,} documents ({partial.num_tokens:,} "
        f"tokens) of '{out}' are kept in '{partial.folder}'; run the same command "
        "to continue",
        status,
    )


def _remaining(files: list[Path], text_key: str, done: list[dict[str, Any]]) -> Iterator[Document]:
    """The documents of ``files`` after the ``done`` ones: the files they finished are
    not read again; the one they stopped in is read past their documents."""
    index, count = _position(done, [str(p) for p in files])
    return itertools.islice(read_documents(files[index:], text_key), count, None)


def _position(done: list[dict[str, Any]], names: list[str]) -> tuple[int, int]:
    """The file the ``done`` entries stop in (its index in ``names``) and how many of its
    documents they hold. A file named twice is read twice; its second reading begins
    where a record index restarts at 0, or with a text file's next (only) document."""
    index, count = 0, 0
    for entry in done:
        again = count > 0 and entry.get("record") in (None, 0)
        if entry["source"] != names[index] or again:
            index, count = index + 1, 0
            while names[index] != entry["source"]:  # a file that held no documents
                index += 1
        count += 1
    return index, count


def builtin_text() -> bytes:
    """The Python reference topics shipped in ``pydoc_data.topics`` (≈466 kB of English
    technical prose), as UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def builtin_corpus() -> TokenFile:
    """The built-in text (``pydoc_data.topics``), byte-tokenized, as an in-memory TokenFile."""

    tokens, meta = encode_documents([(BUILTIN_NAME, builtin_text())], "byte")
    return TokenFile(tokens, meta["vocab_size"], meta, BUILTIN_NAME)
