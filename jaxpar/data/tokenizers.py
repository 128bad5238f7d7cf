"""Tokenizers of token files: UTF-8 bytes (``byte``, vocab 256) or a local Hugging Face
``tokenizers`` JSON file (checked by its SHA-256; nothing is downloaded), and the special
tokens that open and close each document (:func:`separators`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
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
    #: the end-of-text token a model folder's ``tokenizer_config.json`` names (its
    #: ``eos_token``); None for a bare tokenizer JSON
    eos_token: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def _text(self, data: bytes, source: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(
                f"input '{source}' is not UTF-8 text ({err}); the tokenizer "
                f"'{self.file}' needs UTF-8, so convert the file or use "
                "--tokenizer byte"
            ) from None

    def encode(self, data: bytes, source: str) -> np.ndarray:
        text = self._text(data, source)
        # Special tokens come from ``separators``, chosen once, not from the post-processor.
        try:
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as err:  # noqa: BLE001 (the Rust side raises bare Exception)
            raise DataError(
                f"tokenizer '{self.file}' cannot encode '{source}' ({err}); "
                "use a tokenizer that covers its text"
            ) from None
        return np.asarray(encoding.ids, np.int64)

    def encode_many(self, datas: list[bytes], sources: list[str]) -> list[np.ndarray]:
        """The ids of several documents: the library's batch encoding, on all its threads."""
        texts = [self._text(d, s) for d, s in zip(datas, sources)]
        # the same ids; _fast (tokenizers ≥ 0.20) skips the character offsets
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        try:
            encodings = batch(texts, add_special_tokens=False)
        except Exception:  # noqa: BLE001 — encode one by one to name the document
            return [self.encode(d, s) for d, s in zip(datas, sources)]
        return [np.asarray(e.ids, np.int64) for e in encodings]

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
        raise DataError(
            f"tokenizer '{file}' needs the 'tokenizers' package: pip install 'jaxpar[text]'"
        ) from None
    try:
        return HFTokenizer(file, sha256, _HF.from_file(file))
    except Exception as err:  # noqa: BLE001 (the Rust side raises bare Exception)
        raise DataError(
            f"tokenizer '{file}' is not a valid Hugging Face tokenizer JSON file: {err}"
        ) from None


def load_tokenizer(spec: str | os.PathLike | Tokenizer) -> Tokenizer:
    """``"byte"``, the path of a local ``tokenizers`` JSON file, or a Hugging Face model
    folder holding ``tokenizer.json`` (its ``tokenizer_config.json`` names the end-of-text
    token).

    Raises:
      DataError: for a missing or malformed file, or when ``tokenizers`` is not installed.
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        return spec
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        return _from_folder(path)
    if not path.is_file():
        raise DataError(
            f"tokenizer '{spec}' is neither 'byte' nor an existing tokenizer "
            "JSON file or model folder; pass --tokenizer byte, the path of a "
            "tokenizer.json, or a folder holding one"
        )
    path = path.absolute()
    return load_hf(str(path), sha256_of(path))


def _from_folder(folder: Path) -> HFTokenizer:
    """A model folder's ``tokenizer.json``, with the ``eos_token`` of its
    ``tokenizer_config.json`` (a string, or transformers' ``{"content": …}`` form)."""
    file = folder.absolute() / "tokenizer.json"
    if not file.is_file():
        raise DataError(
            f"tokenizer folder '{folder}' holds no tokenizer.json (a model saved "
            "with its fast tokenizer has one); pass the tokenizer JSON file itself"
        )
    tok = load_hf(str(file), sha256_of(file))
    config = folder / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(f"'{config}' cannot be read as JSON ({err}); fix or remove it") from None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return dataclasses.replace(tok, eos_token=eos if isinstance(eos, str) else None)


#: end-of-text tokens, most specific first: GPT-2 and Qwen, Llama 3, Llama 2 and Mistral, Gemma
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
#: a text whose tokens the post-processor surrounds with the special tokens it adds
_PROBE = "x"


@dataclass(frozen=True)
class Separators:
    """The ids that open (``bos``) and close (``eos``) every document; None: no token."""

    bos: int | None = None
    eos: int | None = None

    def wrap(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` with ``bos`` before and ``eos`` after (those that are set)."""
        head = [] if self.bos is None else [self.bos]
        tail = [] if self.eos is None else [self.eos]
        if not head and not tail:
            return ids
        return np.concatenate([np.asarray(head, ids.dtype), ids, np.asarray(tail, ids.dtype)])


def separators(tok: Tokenizer, bos: str = "auto", eos: str = "auto") -> Separators:
    """The document separators of ``tok``: each of ``bos``/``eos`` is ``"auto"``,
    ``"none"`` or a token of the tokenizer (e.g. ``"<|endoftext|>"``).

    ``auto``: for a ``tokenizers`` JSON, the token its post-processor adds before a text
    (BOS), and the one it adds after (EOS) or else the model folder's ``eos_token`` or
    else its end-of-text token (the first of ``END_OF_TEXT`` among its special tokens);
    the byte tokenizer, whose 256 ids are all bytes, has none, so its documents are
    concatenated as they are.

    Raises:
      DataError: a named token the tokenizer lacks (or any named token for a tokenizer
        without special tokens), or a post-processor that adds several tokens.
    """
    if not isinstance(tok, HFTokenizer):
        for which, setting in (("bos", bos), ("eos", eos)):
            if setting not in ("auto", "none"):
                raise DataError(
                    f"--{which} '{setting}': the {tok.describe()} tokenizer has "
                    f"no special tokens; use --{which} none, or a tokenizer JSON "
                    "that has the token"
                )
        return Separators()
    before, after = _template(tok.tokenizer)
    if eos == "auto" and not after and tok.eos_token:  # the model folder's own
        eos = tok.eos_token
    return Separators(
        bos=_choose(tok, "bos", bos, before),
        eos=_choose(tok, "eos", eos, after or _end_of_text(tok.tokenizer)),
    )


def _template(hf: Any) -> tuple[list[int], list[int]]:
    """The ids the post-processor adds before and after a text (``[]`` when none)."""
    some_word = sorted(hf.get_vocab(with_added_tokens=False))[:1]
    for plain, full in filter(None, (_encode_both(hf, p) for p in (_PROBE, *some_word))):
        for start in range(len(full) - len(plain) + 1):
            if plain and full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
    return [], []


def _encode_both(hf: Any, text: str) -> tuple[list[int], list[int]] | None:
    """The ids of ``text`` without and with the post-processor's special tokens; None
    when the tokenizer cannot encode it (no [UNK], and ``text`` not in its vocabulary)."""
    try:
        return (
            hf.encode(text, add_special_tokens=False).ids,
            hf.encode(text, add_special_tokens=True).ids,
        )
    except Exception:  # noqa: BLE001 (the Rust side raises bare Exception)
        return None


def _end_of_text(hf: Any) -> list[int]:
    special = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    return [special[name] for name in END_OF_TEXT if name in special][:1]


def _choose(tok: HFTokenizer, which: str, setting: str, auto: list[int]) -> int | None:
    if setting == "none":
        return None
    if setting != "auto":
        found = tok.tokenizer.token_to_id(setting)
        if found is None:
            raise DataError(
                f"--{which} '{setting}' is not a token of tokenizer "
                f"'{tok.file}'; name one of its tokens, or use --{which} none"
            )
        return found
    if len(auto) > 1:
        raise DataError(
            f"tokenizer '{tok.file}' adds {len(auto)} tokens {auto} "
            f"{'before' if which == 'bos' else 'after'} each text; name the one "
            f"to use with --{which} TOKEN, or --{which} none"
        )
    return auto[0] if auto else None


def describe_separators(tok: Tokenizer, seps: Separators) -> dict[str, Any]:
    """The metadata's ``bos``/``eos`` entries: ``{"token": …, "id": …}`` or None."""

    def entry(i: int | None) -> dict[str, Any] | None:
        if i is None:
            return None
        return {"token": tok.tokenizer.id_to_token(i), "id": i}

    return {"bos": entry(seps.bos), "eos": entry(seps.eos)}
