"""Fine-tuning records: prompt/completion and chat records, tokenized with a loss mask.

``prepare_records(inputs, "sft.tokens", "tok/tokenizer.json", layout="chat")`` writes
what ``prepare_data`` writes (``sft.tokens`` and ``sft.tokens.json``) plus
``sft.tokens.mask``: one uint8 per token, 1 where the token is a target whose loss
counts (a completion's, an assistant message's), 0 elsewhere (prompts, the rest of the
chat, the BOS separator); the metadata's ``records`` names the layout and ``mask`` the
file and its count of targets.

A record's text is rendered whole and tokenized whole, so its tokens are exactly those
of its text; the mask comes from the tokens' character offsets: a token counts when
any of its characters lies in a completion span. Layouts:

* ``prompt_completion``: the text is ``prompt + completion``; the span is the completion.
* ``chat``: ``messages`` rendered with the tokenizer folder's chat template (its
  ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) as
  Hugging Face transformers renders it; each assistant message's span runs from the end
  of the conversation before it (rendered with ``add_generation_prompt=True``) to the
  end of the conversation through it (so it includes the template's end-of-turn text).

The EOS separator counts when the text ends inside a span (the model learns to stop).
A record whose mask is all zero (no assistant message, an empty completion) is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import numpy as np

from jaxpar.data.inputs import check_not_an_input, find_inputs
from jaxpar.data.prepare import _check_length, _check_nonempty, _entry, _metadata
from jaxpar.data.records import JSON_KINDS, Document, json_kind, read_records
from jaxpar.data.token_file import TokenFile, meta_path_of, open_tokens, token_dtype
from jaxpar.data.tokenizers import HFTokenizer, Separators, Tokenizer, load_tokenizer, separators
from jaxpar.errors import DataError
from jaxpar.files import check_output_file, refuse_existing

#: ``--records`` values: plain documents, or fine-tuning records with a loss mask
Layout = Literal["text", "prompt_completion", "chat"]
LAYOUTS = ("text", "prompt_completion", "chat")
#: the special tokens transformers passes a chat template (its ``special_tokens_map``)
_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class Keys:
    """The fields of a fine-tuning record (``--prompt-key`` …)."""

    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


#: The record fields when no ``--*-key`` option names others.
DEFAULT_KEYS = Keys()


class Rendered(NamedTuple):
    """A record's text and the character spans ``[start, end)`` whose tokens count."""

    text: str
    spans: list[tuple[int, int]]


def _field(record: dict[str, Any], key: str, flag: str, where: str, kind: type) -> Any:
    if key not in record:
        fields = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where} has no field '{key}' (its fields: {fields}); set "
            f"--{flag} to the field that holds it"
        )
    value = record[key]
    if not isinstance(value, kind):
        raise DataError(
            f"{where}: field '{key}' is {json_kind(value)}, not {JSON_KINDS[kind]}; set "
            f"--{flag} to the right field, or fix the record"
        )
    return value


def prompt_completion(record: dict[str, Any], keys: Keys, where: str) -> Rendered:
    """``prompt + completion``, the completion's span counting."""
    prompt = _field(record, keys.prompt, "prompt-key", where, str)
    completion = _field(record, keys.completion, "completion-key", where, str)
    return Rendered(prompt + completion, [(len(prompt), len(prompt) + len(completion))])


class ChatTemplate:
    """A tokenizer folder's chat template, compiled as transformers compiles it."""

    def __init__(self, source: str, special: dict[str, str]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special = special

    def render(self, messages: list[Any], add_generation_prompt: bool = False) -> str:
        return self.template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special,
        )

    def __call__(self, record: dict[str, Any], keys: Keys, where: str) -> Rendered:
        """The chat's text and each assistant message's span."""
        messages = _field(record, keys.messages, "messages-key", where, list)
        try:
            text = self.render(messages)
            spans = []
            for i, message in enumerate(messages):
                if not isinstance(message, dict) or "role" not in message:
                    raise DataError(
                        f"{where}: message {i} is not an object with a 'role'; "
                        'each message is {"role": …, "content": …}'
                    )
                if message["role"] != "assistant":
                    continue
                before = self.render(messages[:i], add_generation_prompt=True)
                through = self.render(messages[: i + 1])
                if not (through.startswith(before) and text.startswith(through)):
                    raise DataError(
                        f"{where}: the chat template does not render the chat "
                        f"up to message {i} as a prefix of the whole chat; use a "
                        "template that renders turns in order"
                    )
                spans.append((len(before), len(through)))
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001 (jinja2 and the template raise anything)
            raise DataError(
                f"{where}: the chat template fails on this record "
                f"({type(err).__name__}: {err}); fix the record or the "
                "template"
            ) from None
        return Rendered(text, spans)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise DataError(f"the chat template raised: {message}")


def chat_template(tok: Tokenizer) -> ChatTemplate:
    """The chat template of the folder of ``tok``'s tokenizer file.

    Raises:
      DataError: for the byte tokenizer, or a folder without a chat template.
    """
    if not isinstance(tok, HFTokenizer):
        raise DataError(
            "--records chat needs a chat template: pass --tokenizer "
            "FOLDER/tokenizer.json whose folder has tokenizer_config.json with "
            "a chat_template"
        )
    folder = Path(tok.file).parent
    config_file = folder / "tokenizer_config.json"
    jinja_file = folder / "chat_template.jinja"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = {t.get("name"): t.get("template") for t in source}.get("default")
    if jinja_file.is_file():
        source = jinja_file.read_text()
    if not isinstance(source, str) or not source:
        raise DataError(
            f"tokenizer folder '{folder}' has no chat template (no "
            "chat_template in tokenizer_config.json, no chat_template.jinja); "
            "add one, or use --records prompt_completion"
        )
    special = {
        k: v["content"] if isinstance(v, dict) else v
        for k, v in config.items()
        if k in _SPECIAL and v is not None
    }
    return ChatTemplate(source, special)


def token_mask(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 when the token ``[start, end)`` overlaps a span (an empty
    token: when its start lies in one)."""
    mask = np.zeros(starts.shape, bool)
    ends = np.maximum(ends, starts + 1)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return mask.astype(np.uint8)


def encode_masked(tok: Tokenizer, rendered: Rendered, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a record's text (as ``tok.encode`` gives them) and their mask."""
    text = rendered.text
    if isinstance(tok, HFTokenizer):
        try:
            enc = tok.tokenizer.encode(text, add_special_tokens=False)
        except Exception as err:  # noqa: BLE001 (the Rust side raises bare Exception)
            raise DataError(
                f"tokenizer '{tok.file}' cannot encode {where} ({err}); use "
                "a tokenizer that covers its text"
            ) from None
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, np.int64), token_mask(
            offsets[:, 0], offsets[:, 1], rendered.spans
        )
    data = text.encode("utf-8")
    byte = lambda i: len(text[:i].encode("utf-8"))
    spans = [(byte(lo), byte(hi)) for lo, hi in rendered.spans]
    at = np.arange(len(data), dtype=np.int64)
    return tok.encode(data, where), token_mask(at, at + 1, spans)


def _masked_documents(
    files: list[Path], tok: Tokenizer, layout: str, keys: Keys
) -> Iterator[tuple[Document, np.ndarray, np.ndarray, bool]]:
    """Each record's document, ids, mask, and whether its text ends in a span."""
    render = chat_template(tok) if layout == "chat" else prompt_completion
    for source, index, record in read_records(files):
        where = f"'{source}' record {index}"
        rendered = render(record, keys, where)
        ids, mask = encode_masked(tok, rendered, where)
        if not mask.any():
            raise DataError(
                f"{where} has no completion tokens (an empty completion, or "
                "no assistant message): nothing to train on; drop the record"
            )
        ends_in_span = any(hi == len(rendered.text) > lo for lo, hi in rendered.spans)
        yield Document(source, rendered.text.encode(), index), ids, mask, ends_in_span


def prepare_records(
    inputs: Iterable[str | os.PathLike],
    out: str | os.PathLike,
    tokenizer: str | Tokenizer = "byte",
    glob: str | None = None,
    *,
    layout: Layout = "prompt_completion",
    keys: Keys = DEFAULT_KEYS,
    bos: str = "auto",
    eos: str = "auto",
    overwrite: bool = False,
) -> TokenFile:
    """Tokenize fine-tuning records into ``out``, ``out + ".json"`` and ``out + ".mask"``
    (see the module docstring; the arguments are ``prepare_data``'s).

    Raises:
      PathError: for an existing ``out`` (or its metadata or mask) without ``overwrite``.
      DataError: as ``prepare_data``, and for a record without its fields (naming the
        fields it has), chat records without a chat template, a record without
        completion tokens, or a layout that is not one of ``LAYOUTS``.
    """
    if layout not in LAYOUTS[1:]:
        raise DataError(
            f"--records {layout}: fine-tuning records are one of "
            f"{', '.join(LAYOUTS[1:])}; use prepare_data for text"
        )
    tok = load_tokenizer(tokenizer)
    seps = separators(tok, bos, eos)
    out = check_output_file(Path(out).absolute(), "--out")
    meta_path = meta_path_of(out)
    mask_path = mask_file(out)
    tmp = out.with_name(out.name + ".tmp")
    mask_tmp = out.with_name(out.name + ".mask.tmp")
    files = find_inputs(inputs, glob)
    check_not_an_input(
        {
            out: "--out",
            meta_path: "the metadata file of --out",
            mask_path: "the mask file of --out",
            tmp: "a temporary file of --out",
            mask_tmp: "a temporary file of --out",
        },
        files,
    )
    refuse_existing(
        {
            out: "--out",
            meta_path: "the metadata file of --out",
            mask_path: "the mask file of --out",
        },
        overwrite,
    )
    try:
        with open(tmp, "wb") as f, open(mask_tmp, "wb") as g:
            documents, targets = _write_records(f, g, files, tok, seps, layout, keys)
        num_tokens = documents[-1]["end"] if documents else 0
        _check_nonempty(num_tokens, [str(p) for p in files])
        meta_path.unlink(missing_ok=True)  # an old set must not describe the new tokens
        os.replace(tmp, out)
        os.replace(mask_tmp, mask_path)
        meta = _metadata(tok, seps, num_tokens, documents)
        meta |= {"records": layout, "mask": {"file": mask_path.name, "targets": targets}}
        meta_path.write_text(json.dumps(meta, indent=1))
    finally:
        tmp.unlink(missing_ok=True)
        mask_tmp.unlink(missing_ok=True)
    return open_tokens(out)


def _write_records(
    f: BinaryIO,
    g: BinaryIO,
    files: list[Path],
    tok: Tokenizer,
    seps: Separators,
    layout: Layout,
    keys: Keys,
) -> tuple[list[dict[str, Any]], int]:
    """Writes each record's ids (wrapped in ``seps``) to ``f`` and its loss mask to ``g``;
    returns the documents' metadata entries and the count of tokens the loss counts."""
    dtype = token_dtype(tok.vocab_size)
    documents = []
    targets = 0
    for doc, ids, mask, eos_counts in _masked_documents(files, tok, layout, keys):
        ids = seps.wrap(ids)
        head = [] if seps.bos is None else [0]
        tail = [] if seps.eos is None else [int(eos_counts)]
        mask = np.concatenate([np.asarray(head, np.uint8), mask, np.asarray(tail, np.uint8)])
        _check_length(doc, ids.size)
        start = documents[-1]["end"] if documents else 0
        ids.astype(dtype).tofile(f)
        mask.tofile(g)
        targets += int(mask.sum())
        documents.append(_entry(doc, start, start + ids.size))
    return documents, targets


def mask_file(path: Path) -> Path:
    """The mask file beside token file ``path``."""
    return path.with_name(path.name + ".mask")


def open_mask(tf: TokenFile) -> np.ndarray | None:
    """The loss mask of a token file (uint8 per token, memory-mapped), or None without.

    Raises:
      DataError: for a missing mask file or one whose size is not the token count.
    """
    entry = tf.meta.get("mask")
    if entry is None or tf.path is None:
        return None
    path = tf.path.with_name(entry["file"])
    fix = "re-create it with jaxpar prepare-data --records …"
    if not path.is_file():
        raise DataError(f"mask file '{path}' of token file '{tf.name}' is missing; {fix}")
    if path.stat().st_size != tf.num_tokens:
        raise DataError(
            f"mask file '{path}' has {path.stat().st_size} bytes but token file "
            f"'{tf.name}' holds {tf.num_tokens} tokens; {fix}"
        )
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(tf.num_tokens,))
