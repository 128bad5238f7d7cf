"""Loss and perplexity without training: ``jaxpar eval RUN_DIR|FOLDER [overrides…]``.

The model is a run dir's latest checkpoint (or ``step``'s) or a Hugging Face folder's
weights (:mod:`jaxpar.weights`), on the layout the overrides give; the data is the held-out
split of the configured data — the run's own, or ``data.path=…`` (a folder needs it) —
read as training's evaluation reads it: ``batches`` fixed batches of ``train.batch_size``
rows of ``data.seq_len`` tokens, in evaluation mode, through the trainer's evaluation step.
Nothing is written to the run dir or the folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpar import hf
from jaxpar.config import Config, apply_overrides
from jaxpar.data.token_file import open_tokens
from jaxpar.data.tokenizers import sha256_of
from jaxpar.errors import ConfigError, DataError
from jaxpar.run import evaluate, host_value
from jaxpar.weights import (
    Source,
    build_source,
    open_source,
    shorter_sequences,
    state_of,
)

__all__ = ["Evaluation", "evaluate_model", "evaluate_source"]


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate_model` measured.

    Attributes:
      loss: the mean loss over the batches (nats per token for a language model).
      perplexity: ``exp(loss)`` for a language model; None for another task.
      metrics: every metric of the task's evaluation, averaged (``loss`` among them).
      batches: how many batches were read.
      examples: rows per batch (``train.batch_size``).
      seq_len: tokens per row for a language model (``data.seq_len``); None for another.
      step: the checkpoint's step; None for a Hugging Face folder.
      where: the run dir or folder.
      data: the data's name (a path, or the built-in corpus).
    """

    loss: float
    perplexity: float | None
    metrics: dict[str, float]
    batches: int
    examples: int
    seq_len: int | None
    step: int | None
    where: str
    data: str

    def line(self) -> str:
        """One line for the command: loss, perplexity and what was read."""
        what = f"step {self.step} of {self.where}" if self.step is not None else self.where
        ppl = f", perplexity {self.perplexity:.4g}" if self.perplexity is not None else ""
        rows = (
            f"{self.examples} × {self.seq_len} tokens"
            if self.seq_len
            else (f"{self.examples} examples")
        )
        return (
            f"eval of {what}: loss {self.loss:.6g}{ppl} over {self.batches} batch"
            f"{'es' * (self.batches != 1)} of {rows} (held-out split of {self.data})"
        )

    def json(self) -> str:
        """The evaluation as one JSON object."""
        return json.dumps(dataclasses.asdict(self))


def evaluate_model(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    batches: int | None = None,
    step: int | None = None,
    trust_code: bool = False,
) -> Evaluation:
    """Loss and perplexity of a run dir's checkpoint or a Hugging Face folder's weights
    (see the module docstring).

    Args:
      path: a run dir (``config.yaml`` and checkpoints) or a Hugging Face folder.
      overrides: ``section.key=value`` settings over the run's config (a folder's: the
        default config): a layout (``mesh.fsdp=2``), the data (``data.path=…``),
        ``train.batch_size``, ``data.seq_len``.
      batches: how many held-out batches (None: ``train.eval_batches``).
      step: the checkpoint step (None: the latest; a folder has none).
      trust_code: import the code a run dir's ``config.yaml`` names.

    Raises:
      PathError, ConfigError, DataError: one line naming what to fix.
    """
    source = open_source(path, overrides, trust_code=trust_code, defaults=shorter_sequences)
    return evaluate_source(source, batches=batches, step=step)


def evaluate_source(
    source: Source, *, batches: int | None = None, step: int | None = None
) -> Evaluation:
    """:func:`evaluate_model` of an opened run dir or folder."""
    if batches is not None and batches < 1:
        raise ConfigError(f"--batches {batches} must be ≥ 1")
    if source.folder is not None:
        _check_folder_data(source.folder, source.config)
    config = _with_batches(source.config, batches)
    source = dataclasses.replace(source, config=config)
    run = build_source(source)
    state = state_of(run, source, step, "jaxpar eval")
    metrics = evaluate(run, state)
    text = "tokens" in run.plan.task.batch_axes
    return Evaluation(
        loss=metrics["loss"],
        perplexity=_perplexity(metrics["loss"]) if text else None,
        metrics=metrics,
        batches=config.train.eval_batches,
        examples=config.train.batch_size,
        seq_len=config.data.seq_len if text else None,
        step=None if source.folder is not None else int(host_value(state.step)),
        where=source.where,
        data=run.data.name,
    )


def _with_batches(config: Config, batches: int | None) -> Config:
    if batches is None:
        return config
    return apply_overrides(config, [f"train.eval_batches={batches}"])


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 709 else math.inf  # exp overflows a float above 709.78


def _check_folder_data(folder: Path, config: Config) -> None:
    """A folder's model reads its tokenizer's ids: the data must be named, and a folder
    with a tokenizer needs a token file (text would be read as bytes); a token file made
    with another tokenizer is warned of."""
    data = config.data
    if data.dataset != "auto":
        return
    if not data.path:
        raise ConfigError(
            f"jaxpar eval {folder} needs data: pass data.path=TOKENS, a token "
            f"file made by jaxpar prepare-data TEXT --out TOKENS --tokenizer "
            f"{folder / hf.files.TOKENIZER}"
        )
    tokenizer = folder / hf.files.TOKENIZER
    if not tokenizer.is_file():
        return  # a byte-level model (as jaxpar exports one) reads text as bytes
    if not Path(f"{data.path}.json").is_file():
        raise DataError(
            f"data.path={data.path} is not a token file, so jaxpar would read its "
            f"bytes as ids; make one with the folder's tokenizer: jaxpar "
            f"prepare-data {data.path} --out TOKENS --tokenizer {tokenizer}, then "
            "pass data.path=TOKENS"
        )
    made_with = open_tokens(data.path).meta.get("tokenizer")
    if not (isinstance(made_with, dict) and made_with.get("sha256") == sha256_of(tokenizer)):
        warnings.warn(
            f"data.path={data.path} was made with tokenizer {_named(made_with)}, "
            f"not {tokenizer}: the loss is of another tokenizer's ids",
            stacklevel=3,
        )


def _named(spec: Any) -> str:
    return str(spec.get("file")) if isinstance(spec, dict) else repr(spec)
