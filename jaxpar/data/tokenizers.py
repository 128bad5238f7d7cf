"""Tokenizers of token files: UTF-8 bytes (``byte``, vocab 256) or a local Hugging Face
``tokenizers`` JSON file (checked by its SHA-256; nothing is downloaded)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxpar.errors import DataError


class Tokenizer(Protocol):
    """What ``encode_documents`` needs from a tokenizer."""

    vocab_size: int

    def encode(self, data: bytes, source: str) -> np.ndarray:
        """Token ids of one document's raw bytes (``source`` names it in errors)."""

    def decode(self, ids: np.ndarray) -> str | bytes:
        """The text of ``ids``."""

    def describe(self) -> str | dict[str, str]:
        """The metadata's ``tokenizer`` entry."""


@dataclass(frozen=True)
class ByteTokenizer:
    """Each byte is a token (vocab 256); any file is valid input, UTF-8 or not."""

    vocab_size: int = 256

    def encode(self, data: bytes, source: str) -> np.ndarray:
        return np.frombuffer(data, np.uint8)

    def decode(self, ids: np.ndarray) -> bytes:
        return np.asarray(ids, np.uint8).tobytes()

    def describe(self) -> str:
        return "byte"


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A local Hugging Face ``tokenizers`` JSON file; documents must be UTF-8."""

    file: str
    sha256: str
    tokenizer: Any = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, data: bytes, source: str) -> np.ndarray:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"input '{source}' is not UTF-8 text ({err}); the tokenizer "
                            f"'{self.file}' needs UTF-8, so convert the file or use "
                            "--tokenizer byte") from None
        # Documents are concatenated raw: no BOS/EOS or other special tokens per document.
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict[str, str]:
        return {"file": self.file, "sha256": self.sha256}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def load_hf(file: str, sha256: str) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer as _HF
    except ImportError:
        raise DataError(f"tokenizer '{file}' needs the 'tokenizers' package: "
                        "pip install 'jaxpar[text]'") from None
    try:
        return HFTokenizer(file, sha256, _HF.from_file(file))
    except Exception as err:  # noqa: BLE001 (the Rust side raises bare Exception)
        raise DataError(f"tokenizer '{file}' is not a valid Hugging Face tokenizer JSON "
                        f"file: {err}") from None


def load_tokenizer(spec: str | Tokenizer) -> Tokenizer:
    """``"byte"``, or the path of a local ``tokenizers`` JSON file (loaded lazily).

    Raises:
      DataError: for a missing or malformed file, or when ``tokenizers`` is not installed.
    """
    if not isinstance(spec, str):
        return spec
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"tokenizer '{spec}' is neither 'byte' nor an existing tokenizer "
                        "JSON file; pass --tokenizer byte or the path of a tokenizer.json")
    path = path.absolute()
    return load_hf(str(path), sha256_of(path))
