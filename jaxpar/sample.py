"""Text from a language model: ``jaxpar sample RUN_DIR|FOLDER --prompt TEXT``.

A run dir's ``config.yaml`` gives the model, the layout and the data (hence the
tokenizer: bytes, or the Hugging Face ``tokenizers`` file of a token file made by
``jaxpar prepare-data``); the parameters are its latest checkpoint (or ``step``'s),
restored with the run's shardings — on the layout it trained on, or on another one
given as overrides (``mesh.data=1 run.devices=1``). A Hugging Face folder gives the model
and its weights (``model.init_from=FOLDER``, :mod:`jaxpar.weights`) and, when it has one,
its ``tokenizer.json``, used as transformers uses it: the prompt gets the special tokens
the tokenizer's post-processor adds (Llama's BOS). ``prompt_ids`` gives the prompt as token
ids instead (a folder without a tokenizer).

A sample ends at the model's end-of-text token (``stop="auto"``), as transformers' ``generate``
does: a folder's ``eos_token_id`` (its ``generation_config.json``'s, or its ``config.json``'s
when it has none), a run's token file's ``eos`` separator (none for bytes); a finished
sample is padded with the folder's ``pad_token_id``; ``stop="none"`` draws every token.

The decoding loop itself is :mod:`jaxpar.decoding`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxpar import hf
from jaxpar.config import Config
from jaxpar.data.sources import text_end, text_path, text_tokenizer
from jaxpar.data.tokenizers import load_tokenizer
from jaxpar.decoding import Generator, choose_token, generate, model_shapes
from jaxpar.errors import ConfigError
from jaxpar.run import Run, host_value
from jaxpar.weights import (
    Source,
    build_source,
    load_run_config,
    open_source,
    run_source,
    shorter_sequences,
    state_of,
)

__all__ = [
    "Generator",
    "Samples",
    "choose_token",
    "generate",
    "load_run_config",
    "sample",
    "sample_config",
    "sample_source",
]


@dataclass(frozen=True)
class Samples:
    """What :func:`sample` generated.

    Attributes:
      texts: each sample's continuation of the prompt (the prompt not included, nor the
        stop token that ended it); None without a tokenizer (a folder that has none).
      tokens: the generated ids [samples, n]: n is ``tokens`` unless every sample ended
        at a stop token; a sample that ended holds its stop token, then the folder's
        ``pad_token_id`` (else the first stop id) to the end, as transformers' ``generate``
        pads.
      prompt_tokens: the prompt's ids.
      step: the checkpoint's step; None for a Hugging Face folder.
      lengths: each sample's generated tokens, its stop token included.
      stop: the ids that end a sample (empty: no id does).
    """

    texts: list[str] | None
    tokens: np.ndarray
    prompt_tokens: np.ndarray
    step: int | None
    lengths: np.ndarray
    stop: tuple[int, ...] = ()


def sample(
    path: str | Path,
    prompt: str | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
    tokens: int = 200,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    step: int | None = None,
    samples: int = 1,
    stop: str | Sequence[int] = "auto",
    overrides: Sequence[str] = (),
) -> Samples:
    """Continues ``prompt`` with a run's or a Hugging Face folder's language model (see
    the module docstring).

    Args:
      path: a run directory written by ``jaxpar train`` (its ``config.yaml`` and
        checkpoints), or a Hugging Face folder (``config.json``, safetensors and,
        optionally, ``tokenizer.json``).
      prompt: the text to continue (at least one token, at most the model's longest
        sequence).
      prompt_ids: the prompt as token ids instead of ``prompt``.
      tokens: how many tokens to generate.
      temperature: 0 picks the most likely token each time (greedy); higher is more random.
      top_k: draw only from the ``top_k`` most likely tokens (0: from all).
      seed: the random seed (the same seed gives the same text).
      step: the checkpoint step (None: the latest; a folder has none).
      samples: how many continuations to draw at once (rows of one batch).
      stop: the ids that end a sample: ``"auto"`` (the model's end-of-text token, see the
        module docstring), ``"none"``, or the ids.
      overrides: ``section.key=value`` settings over the run's config (a folder's: the
        default config), e.g. another layout: ``("mesh.data=1", "run.devices=1")``.

    Raises:
      PathError, ConfigError: for a missing run dir, folder or checkpoint, a model that is
        not a language model, or a prompt or setting out of range — one line saying what
        to fix.
    """
    longest = len(prompt.encode()) + 8 if prompt is not None else len(prompt_ids or ())
    source = open_source(
        path, overrides, defaults=functools.partial(folder_defaults, cache=longest + tokens)
    )
    return sample_source(
        source,
        prompt,
        prompt_ids=prompt_ids,
        tokens=tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        step=step,
        samples=samples,
        stop=stop,
    )


def folder_defaults(config: Config, cache: int | None = None) -> list[str]:
    """A folder's config samples without data: random ids shape the (unused) batches.
    ``cache``: the positions a sample needs at most (a text prompt's tokens are at most its
    UTF-8 bytes plus the specials a tokenizer adds); the KV cache holds that many, rounded
    up to a multiple of 128, not the folder's ``max_position_embeddings`` (Qwen3's 40,960
    would take gigabytes a layer), where the family lets a run lower it."""
    out = ["data.dataset=synthetic", "data.num_examples=64", *shorter_sequences(config)]
    longest = getattr(config.model, "max_seq_len", None)
    if cache is not None and longest is not None and hf.lowers_max_seq_len(config.model):
        needed = -(-cache // 128) * 128
        if needed < longest:
            out.append(f"model.max_seq_len={needed}")
    return out


def sample_config(config: Config, prompt: str | None = None, **settings: Any) -> Samples:
    """:func:`sample` of the run ``config`` describes (``run.dir`` is where it lives);
    ``settings`` are :func:`sample_source`'s keyword arguments."""
    return sample_source(run_source(config), prompt, **settings)


def sample_source(
    source: Source,
    prompt: str | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
    tokens: int = 200,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    step: int | None = None,
    samples: int = 1,
    stop: str | Sequence[int] = "auto",
) -> Samples:
    """:func:`sample` of an opened run dir or folder (:func:`jaxpar.weights.open_source`)."""
    _check_settings(tokens, temperature, top_k, samples)
    if (prompt is None) == (prompt_ids is None):
        raise ConfigError("give the prompt as --prompt TEXT or as --prompt-ids 1,2,3 (one of them)")
    tokenizer = _tokenizer(source, needed=prompt is not None)
    run = build_source(source)
    model = _language_model(run, source)
    vocab = _vocab(run, source, tokenizer, model.cfg.vocab_size)
    if prompt is not None:
        ids = _encode(tokenizer, prompt, vocab, model.cfg.max_seq_len, _name(source))
    else:
        ids = _given_ids(prompt_ids, vocab, model.cfg.max_seq_len)
    ends, pad = _stop_ids(source, stop, vocab)
    state = state_of(run, source, step, "jaxpar sample")
    out = generate(
        run,
        state,
        np.tile(ids, (samples, 1)),
        tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        vocab_limit=vocab,
        stop=ends,
        pad=pad,
    )
    ended = np.isin(out, ends)
    lengths = np.where(ended.any(1), ended.argmax(1) + 1, out.shape[1])
    texts = None
    if tokenizer is not None:
        kept = lengths - ended.any(1)
        texts = [_text(tokenizer.decode(row[:n])) for row, n in zip(out, kept)]
    at = None if source.folder is not None else int(host_value(state.step))
    return Samples(texts, out, ids, at, lengths, ends)


def _stop_ids(
    source: Source, stop: str | Sequence[int], vocab: int
) -> tuple[tuple[int, ...], int | None]:
    """The ids that end a sample (see :func:`sample`'s ``stop``) and the id a finished
    sample is padded with (None: the first of them)."""
    if isinstance(stop, str) and stop not in ("auto", "none"):
        raise ConfigError(f"--stop {stop}: give auto, none or token ids such as 2,7")
    if stop == "none":
        return (), None
    ends, pad, where = _model_ends(source)
    if not isinstance(stop, str):
        ends, where = tuple(int(i) for i in stop), "--stop"
    for what, ids in ((where, ends), (f"{where} (pad_token_id)", () if pad is None else [pad])):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ConfigError(
                f"{what} holds token id {bad[0]}, outside the model's ids 0 to {vocab - 1}; "
                "give ids below it with --stop 2,7, or --stop none"
            )
    return ends, pad


def _model_ends(source: Source) -> tuple[tuple[int, ...], int | None, str]:
    """The model's end-of-text ids, its padding id and the file that names them, as
    transformers' ``generate`` reads them: a folder's ``generation_config.json`` when it has
    one, else its ``config.json`` (``eos_token_id`` one id or a list, ``pad_token_id``); a
    run's text's end-of-document id (the token file's metadata)."""
    if source.folder is None:
        end = text_end(source.config.data)
        return () if end is None else (end,), None, f"{text_path(source.config.data)}.json"
    file = source.folder / hf.files.GENERATION_CONFIG
    file = file if file.is_file() else source.folder / hf.files.CONFIG
    try:
        keys = json.loads(file.read_text()) if file.is_file() else {}
        keys = keys if isinstance(keys, dict) else {}
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file} cannot be read ({err}); fix it, or give --stop none") from None
    ends = keys.get("eos_token_id")
    ends = [] if ends is None else ends if isinstance(ends, list) else [ends]
    pad = keys.get("pad_token_id")
    for key, ids in (("eos_token_id", ends), ("pad_token_id", [] if pad is None else [pad])):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(
                f"{file}: {key} {keys[key]!r} is not a token id or a list of them; fix it, "
                "or give --stop none"
            )
    return tuple(ends), pad, str(file)


def _check_settings(tokens: int, temperature: float, top_k: int, samples: int) -> None:
    if tokens < 1:
        raise ConfigError(f"--tokens {tokens}: generate at least 1 token")
    if not temperature >= 0:
        raise ConfigError(f"--temperature {temperature} must be ≥ 0 (0: greedy)")
    if top_k < 0:
        raise ConfigError(f"--top-k {top_k} must be ≥ 0 (0: every token)")
    if samples < 1:
        raise ConfigError(f"--samples {samples} must be ≥ 1")


def _name(source: Source) -> str:
    config = source.config
    return config.model.name or config.family.name


def _language_model(run: Run, source: Source) -> nnx.Module:
    """The run's abstract model, which must decode with a KV cache."""
    model = model_shapes(run)
    if not (
        callable(getattr(model, "decode", None)) and callable(getattr(model, "init_cache", None))
    ):
        raise ConfigError(
            f"jaxpar sample needs a language model; {source.where} trains "
            f"model.name={_name(source)}"
        )
    return model


class _FolderTokenizer:
    """A folder's ``tokenizer.json`` as transformers uses it: encoding adds the special
    tokens its post-processor adds (a BOS for Llama, none for Qwen)."""

    def __init__(self, file: Path):
        self.tokenizer = load_tokenizer(str(file)).tokenizer
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, data: bytes, source: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(data.decode("utf-8")).ids, np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _tokenizer(source: Source, needed: bool) -> Any:
    """The text's tokenizer: a folder's ``tokenizer.json`` (None without one), or the run's
    data's (None for a run on random ids, given ``--prompt-ids``).

    Raises:
      ConfigError: ``needed`` (a text prompt) and there is none.
    """
    if source.folder is None:
        data = source.config.data
        return None if data.dataset == "synthetic" and not needed else text_tokenizer(data)
    file = source.folder / hf.files.TOKENIZER
    if file.is_file():
        return _FolderTokenizer(file)
    if needed:
        raise ConfigError(
            f"{source.folder} holds no {hf.files.TOKENIZER} to encode --prompt "
            "with; give the prompt as token ids: --prompt-ids 1,2,3"
        )
    return None


def _vocab(run: Run, source: Source, tokenizer: Any, model_vocab: int) -> int:
    """The ids to draw from: a folder's model draws from all, as transformers does; a
    run's from those its text has and its tokenizer decodes."""
    if source.folder is not None:
        return model_vocab
    vocab = run.data.vocab_size or model_vocab
    return min(vocab, tokenizer.vocab_size) if tokenizer is not None else vocab


def _encode(tokenizer: Any, prompt: str, vocab: int, max_len: int, model: str) -> np.ndarray:
    ids = np.asarray(tokenizer.encode(prompt.encode("utf-8"), "--prompt"), np.int32)
    if ids.size == 0:
        raise ConfigError("--prompt is empty; give at least one character to continue")
    _check_length(ids, max_len, "--prompt")
    if int(ids.max()) >= vocab:
        at = int(np.argmax(ids >= vocab))
        raise ConfigError(
            f"--prompt holds token id {int(ids[at])} (at token {at}), outside the "
            f"{vocab} tokens {model} was trained on; use characters the training "
            "text has (a byte-level model of vocab < 256 reads ASCII only)"
        )
    return ids


def _given_ids(prompt_ids: Sequence[int], vocab: int, max_len: int) -> np.ndarray:
    ids = np.asarray(prompt_ids, np.int64).reshape(-1)
    if ids.size == 0:
        raise ConfigError("--prompt-ids is empty; give at least one token id, e.g. 1,2,3")
    _check_length(ids, max_len, "--prompt-ids")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise ConfigError(
            f"--prompt-ids holds {int(bad[0])}, outside the model's ids 0 to "
            f"{vocab - 1}; give ids below {vocab}"
        )
    return ids.astype(np.int32)


def _check_length(ids: np.ndarray, max_len: int, what: str) -> None:
    if ids.size > max_len:
        raise ConfigError(
            f"{what} is {ids.size} tokens, longer than the model's "
            f"max_seq_len={max_len}; shorten it"
        )


def _text(decoded: str | bytes) -> str:
    return decoded.decode("utf-8", errors="replace") if isinstance(decoded, bytes) else decoded
