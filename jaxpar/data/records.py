"""Documents from files: a text file is one document, a record file one per record.

A record file is JSON Lines (``.jsonl``, ``.ndjson``, ``.json``; gzip-compressed when
named ``*.jsonl.gz``), Parquet or Arrow IPC (the file format and the stream format that
``datasets.save_to_disk`` writes). Each record's ``text_key`` field (default ``text``) is
one document. Parquet and Arrow are read with pyarrow (``pip install 'jaxpar[records]'``).

What a file is comes from its first bytes and its name: the Parquet (``PAR1``) and Arrow
(``ARROW1``, or a stream's ``0xFFFFFFFF``) magics win over any name, so a record file is
never read as text. Any other binary file (gzip not named ``*.jsonl.gz``, zip, zstd,
bzip2, or NUL bytes in its first 8 KiB) is refused. Only what is left is text.
"""

from __future__ import annotations

import functools
import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from jaxpar.errors import DataError

#: the field that holds a record's text unless ``text_key`` names another
TEXT_KEY = "text"
#: the bytes read to tell a file's kind
_HEAD = 8192
_GZIP = b"\x1f\x8b"
_GZIP_NAMES = (".jsonl.gz", ".ndjson.gz", ".json.gz")
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".arrows": "arrow",
}
_MAGICS = ((b"PAR1", "parquet"), (b"ARROW1", "arrow"), (b"\xff\xff\xff\xff", "arrow"))
_COMPRESSED = (
    (_GZIP, "gzip"),
    (b"PK\x03\x04", "zip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
)
_FIX = "convert it to JSON Lines, Parquet or Arrow, or to plain text"
#: rows per batch read from a Parquet file
_BATCH_ROWS = 4096


class Document(NamedTuple):
    """One document: its file, its bytes (UTF-8 for a record) and its record index
    (0-based, counted over the file's records; None for a text file)."""

    source: str
    data: bytes
    record: int | None = None

    @property
    def name(self) -> str:
        """How messages name it: its file, and its record in a record file."""
        return self.source if self.record is None else f"{self.source} (record {self.record})"


def kind_of(path: Path) -> str:
    """``"jsonl"``, ``"jsonl.gz"``, ``"parquet"``, ``"arrow"`` or ``"text"``.

    Raises:
      DataError: for a binary file of no known record format, or a name that promises
        a format the bytes do not have.
    """
    head = _read(path, _HEAD)
    name = path.name.lower()
    if name.endswith(_GZIP_NAMES):
        if not head.startswith(_GZIP):
            raise DataError(
                f"'{path}' is named like gzip-compressed JSON Lines but is not "
                "gzip; rename it .jsonl if it is plain JSON Lines"
            )
        return "jsonl.gz"
    for magic, kind in _MAGICS:
        if head.startswith(magic):
            return kind
    named = _SUFFIXES.get(path.suffix.lower())
    if named == "parquet":
        raise DataError(
            f"'{path}' is not a Parquet file (it does not begin with PAR1); "
            "re-create it, or rename it if it holds something else"
        )
    _refuse_binary(path, head)
    return named or "text"


def _bzip2(head: bytes) -> bool:
    return head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY"


def _refuse_binary(path: Path, head: bytes) -> None:
    for magic, what in _COMPRESSED:
        if head.startswith(magic):
            gz = (
                " (jaxpar reads gzip only as JSON Lines named *.jsonl.gz)" if what == "gzip" else ""
            )
            raise DataError(
                f"'{path}' is {what}-compressed, not text nor a record "
                f"format{gz}; decompress it, or {_FIX}"
            )
    if _bzip2(head):
        raise DataError(
            f"'{path}' is bzip2-compressed, not text nor a record format; decompress it, or {_FIX}"
        )
    if b"\x00" in head:
        raise DataError(
            f"'{path}' is binary (it holds NUL bytes), not text nor a known record format; {_FIX}"
        )


def _read(path: Path, size: int = -1) -> bytes:
    """The first ``size`` bytes of ``path`` (all of them by default)."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as err:
        raise DataError(f"input '{path}' cannot be read: {err.strerror}") from None


def read_documents(files: Iterable[Path], text_key: str = TEXT_KEY) -> Iterator[Document]:
    """The documents of ``files`` in order, read one file at a time.

    Raises:
      DataError: one line naming the file (and line or record) for an unreadable or
        binary file, a record file without records, a malformed line, a record without
        ``text_key`` or whose ``text_key`` is not a string, or text that is not UTF-8.
    """
    for path in files:
        kind = kind_of(path)
        if kind == "text":
            yield Document(str(path), _read(path))
            continue
        empty = True
        for doc in _READERS[kind](path, text_key):
            empty = False
            yield doc
        if empty:
            raise DataError(f"'{path}' holds no records; add records or leave it out")


def read_records(files: Iterable[Path]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """Each record of ``files`` whole: ``(its file, its index in the file, the record)``
    (fine-tuning records, whose fields a layout reads: :mod:`jaxpar.data.finetune`).

    Raises:
      DataError: as :func:`read_documents`, and for a text file (it holds no records).
    """
    for path in files:
        kind = kind_of(path)
        if kind == "text":
            raise DataError(
                f"'{path}' is a text file, not records; fine-tuning records "
                "are JSON Lines, Parquet or Arrow"
            )
        count = 0
        for count, record in enumerate(_RECORD_READERS[kind](path), 1):
            yield str(path), count - 1, record
        if count == 0:
            raise DataError(f"'{path}' holds no records; add records or leave it out")


def _jsonl_records(path: Path, compressed: bool = False) -> Iterator[dict[str, Any]]:
    opener, what = (gzip.open, "gzip") if compressed else (open, "JSON Lines")
    with _readable(path, what), opener(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _parse_line(line, f"{path}:{number}")


def _table_records(path: Path) -> Iterator[dict[str, Any]]:
    pa = _pyarrow(path)
    if kind_of(path) == "parquet":
        with _arrow_errors(pa, path, "Parquet"):
            for batch in pa.parquet.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS):
                yield from batch.to_pylist()
        return
    with _arrow_errors(pa, path, "Arrow"), pa.memory_map(str(path)) as source:
        opened = pa.ipc.open_file if _read(path, 6) == b"ARROW1" else pa.ipc.open_stream
        yield from opened(source).read_all().to_pylist()


# ---------------------------------------------------------------- JSON Lines


def _jsonl(path: Path, key: str, compressed: bool = False) -> Iterator[Document]:
    opener, what = (gzip.open, "gzip") if compressed else (open, "JSON Lines")
    record = 0
    with _readable(path, what), opener(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) hold no record
            where = f"{path}:{number}"
            text = _field(_parse_line(line, where), key, where)
            yield Document(str(path), _utf8(text, key, where), record)
            record += 1


def _parse_line(line: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line.decode("utf-8").rstrip())
    except UnicodeDecodeError as err:
        raise DataError(
            f"{where} is not UTF-8 text ({err.reason} at byte {err.start}); "
            "re-encode the file as UTF-8"
        ) from None
    except json.JSONDecodeError as err:
        reason = err.msg.removesuffix(" at")  # "Invalid control character at"
        raise DataError(
            f"{where} is not valid JSON ({reason} at column {err.colno}); "
            "each line must be one JSON object"
        ) from None
    if not isinstance(value, dict):
        raise DataError(
            f"{where} is a JSON {type(value).__name__}, not an object; each "
            'line must be one JSON object such as {"text": "…"}'
        )
    return value


def _field(record: dict[str, Any], key: str, where: str) -> Any:
    if key not in record:
        fields = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where} has no field '{key}' (its fields: {fields}); set "
            "--text-key (data.text_key) to the field holding the text"
        )
    return record[key]


#: what a record's value is, in JSON's words
JSON_KINDS = {
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def json_kind(value: Any) -> str:
    """``value``'s kind as JSON names it ("a number", "an array", …)."""
    return JSON_KINDS.get(type(value), f"a {type(value).__name__}")


def _utf8(text: Any, key: str, where: str) -> bytes:
    if not isinstance(text, str):
        raise DataError(
            f"{where}: field '{key}' is {json_kind(text)}, not a string; set --text-key "
            "(data.text_key) to a text field, or fix the record"
        )
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(
            f"{where}: field '{key}' is not valid UTF-8 text ({err.reason} at "
            f"character {err.start}); fix the record"
        ) from None


@contextmanager
def _readable(path: Path, what: str) -> Iterator[None]:
    """Turn a read error inside the block into one line naming ``path``."""
    try:
        yield
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"'{path}' is not a readable {what} file ({err}); re-create it") from None


# ---------------------------------------------------------------- Parquet and Arrow


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading '{path}' needs pyarrow: pip install 'jaxpar[records]'") from None
    return pyarrow


def _parquet(path: Path, key: str) -> Iterator[Document]:
    pa = _pyarrow(path)
    with _arrow_errors(pa, path, "Parquet"):
        file = pa.parquet.ParquetFile(path)
        _check_column(pa, file.schema_arrow, key, path)
        batches = file.iter_batches(batch_size=_BATCH_ROWS, columns=[key])
        yield from _column_documents(path, key, batches)


def _arrow(path: Path, key: str) -> Iterator[Document]:
    pa = _pyarrow(path)
    with _arrow_errors(pa, path, "Arrow"), pa.memory_map(str(path)) as source:
        if _read(path, 6) == b"ARROW1":
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        _check_column(pa, reader.schema, key, path)
        yield from _column_documents(path, key, batches)


@contextmanager
def _arrow_errors(pa: Any, path: Path, what: str) -> Iterator[None]:
    try:
        yield
    except (pa.ArrowException, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(
            f"'{path}' is not a readable {what} file ({reason}); re-create it"
        ) from None


def _check_column(pa: Any, schema: Any, key: str, path: Path) -> None:
    if key not in schema.names:
        fields = ", ".join(map(repr, schema.names)) or "none"
        raise DataError(
            f"'{path}' has no field '{key}' (its fields: {fields}); set "
            "--text-key (data.text_key) to the field holding the text"
        )
    kind = schema.field(key).type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    ):
        raise DataError(
            f"'{path}': field '{key}' is {kind}, not a string; set --text-key "
            "(data.text_key) to a text field"
        )


def _column_documents(path: Path, key: str, batches: Iterable[Any]) -> Iterator[Document]:
    record = 0
    for batch in batches:
        for text in _texts(batch.column(key), key, path, record):
            yield Document(str(path), _utf8(text, key, f"'{path}' record {record}"), record)
            record += 1


def _texts(column: Any, key: str, path: Path, first: int) -> list[str | None]:
    """The column's strings; an invalid UTF-8 value (Arrow does not check on reading) is
    one line naming its record."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as err:
                raise DataError(
                    f"'{path}' record {first + i}: field '{key}' is not UTF-8 "
                    f"text ({err.reason} at byte {err.start}); fix the "
                    "record"
                ) from None
        raise


_READERS = {
    "jsonl": _jsonl,
    "jsonl.gz": functools.partial(_jsonl, compressed=True),
    "parquet": _parquet,
    "arrow": _arrow,
}
_RECORD_READERS = {
    "jsonl": _jsonl_records,
    "jsonl.gz": functools.partial(_jsonl_records, compressed=True),
    "parquet": _table_records,
    "arrow": _table_records,
}
