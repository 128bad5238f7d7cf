"""The model that ``jaxpar sample`` and ``jaxpar eval`` look at: a run dir's checkpoint or a
Hugging Face folder's weights, on any layout.

A run dir (it holds ``config.yaml``) gives its config, with the overrides on top; its
weights are its latest checkpoint (or ``step``'s). A Hugging Face folder (it holds
``config.json`` and safetensors, as transformers saves them) gives the model alone —
``model.init_from=FOLDER``: the family and every model key come from ``config.json`` —
and the rest of the config is jaxpar's default with the overrides on top; its weights are
the folder's. Nothing is written to either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import optax

from jaxpar import hf
from jaxpar.config import Config, apply_overrides, load_config
from jaxpar.errors import ConfigError, PathError
from jaxpar.optim import schedule_unread
from jaxpar.resume import checkpoint_dir, restore_state
from jaxpar.run import Run, build
from jaxpar.state import TrainState
from jaxpar.user_code import refuse_run_dir_code

#: settings a folder's config takes before the overrides, given the folder's model
Defaults = Callable[[Config], Sequence[str]]


@dataclass(frozen=True)
class Source:
    """A config and where its weights are.

    Attributes:
      config: the run dir's config, or the default config with ``model.init_from=FOLDER``
        (overrides applied to either).
      folder: the Hugging Face folder; None for a run dir (``config.run.dir``).
    """

    config: Config
    folder: Path | None = None

    @property
    def where(self) -> str:
        """The folder or run dir, for messages."""
        return str(self.folder) if self.folder is not None else self.config.run.dir


def open_source(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    trust_code: bool = False,
    defaults: Defaults | None = None,
) -> Source:
    """The run dir or Hugging Face folder at ``path`` with ``overrides`` on top.

    Args:
      path: a run dir (``config.yaml``) or a folder (``config.json`` and safetensors).
      overrides: ``section.key=value`` settings, e.g. a layout (``mesh.fsdp=2``).
      trust_code: import the code a run dir's ``config.yaml`` names.
      defaults: for a folder, settings that come before the overrides.

    Raises:
      PathError: a path that does not exist, is neither, or a run dir without checkpoints.
      ConfigError: a model key that contradicts the folder; code that is not trusted.
    """
    path = Path(path)
    if not path.is_dir():
        raise PathError(
            f"'{path}' does not exist or is not a directory; pass the run.dir of "
            "a trained run (e.g. runs/gpt_tiny) or a Hugging Face folder"
        )
    if (path / "config.yaml").is_file():
        return run_source(load_run_config(path, overrides, trust_code))
    if (path / hf.files.CONFIG).is_file():
        return Source(folder_config(path, overrides, defaults), path)
    raise PathError(
        f"'{path}' holds no config.yaml (a jaxpar run dir) and no "
        f"{hf.files.CONFIG} (a Hugging Face folder); pass the run.dir of a "
        "trained run, or a folder that transformers' save_pretrained wrote"
    )


def run_source(config: Config) -> Source:
    """The run ``config`` describes (``run.dir`` is where it lives).

    Raises:
      PathError: when it has no checkpoints.
    """
    if not checkpoint_dir(config).is_dir():
        raise PathError(
            f"run dir '{config.run.dir}' holds no checkpoints "
            f"({checkpoint_dir(config)} does not exist); train it first, or pass "
            "another run dir"
        )
    return Source(config)


def load_run_config(
    run_dir: str | Path, overrides: Sequence[str] = (), trust_code: bool = False
) -> Config:
    """A run dir's ``config.yaml`` with ``overrides`` applied; ``run.dir`` is ``run_dir``
    (wherever the run was when it trained). A ``model.name=FILE:NAME`` it names is
    imported only when ``overrides`` name it too or ``trust_code`` is set.

    Raises:
      PathError: when ``run_dir`` is not a run directory.
      ConfigError: when it names code that is not trusted.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise PathError(
            f"run dir '{path}' does not exist; pass the run.dir of a trained run "
            "(e.g. runs/gpt_tiny)"
        )
    if not (path / "config.yaml").is_file():
        raise PathError(
            f"'{path}' holds no config.yaml, so it is not a jaxpar run dir; pass "
            "the run.dir of a run that jaxpar train wrote"
        )
    refuse_run_dir_code(path / "config.yaml", overrides, hooks=False, trust=trust_code)
    config = apply_overrides(load_config([path / "config.yaml"]), list(overrides))
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(path)))


def folder_config(
    folder: str | Path, overrides: Sequence[str] = (), defaults: Defaults | None = None
) -> Config:
    """The default config with ``model.init_from=folder``, then ``defaults(config)`` (given
    the folder's model) and ``overrides``.

    Raises:
      ConfigError, DataError: a folder jaxpar does not read, or an override that
        contradicts it (one line).
    """
    head = [f"model.init_from={folder}"]
    config = load_config([], [*head, *overrides])
    first = list(defaults(config)) if defaults is not None else []
    return load_config([], [*head, *first, *overrides]) if first else config


def shorter_sequences(config: Config) -> list[str]:
    """``data.seq_len`` no longer than the folder's model reads (a tiny model's
    ``max_seq_len`` may be below jaxpar's default 128)."""
    longest = getattr(config.model, "max_seq_len", None)
    if longest is None or config.data.seq_len <= longest:
        return []
    return [f"data.seq_len={longest}"]


def build_source(source: Source) -> Run:
    """The run of a source. A folder's run gets no optimizer state (its weights are only
    read); a run dir's keeps its optimizer, whose state its checkpoints hold."""
    with schedule_unread():
        if source.folder is None:
            return build(source.config, fit_memory=True)
        return build(source.config, optimizer=optax.identity(), fit_memory=True)


def state_of(run: Run, source: Source, step: int | None, command: str) -> TrainState:
    """The weights: the run dir's checkpoint ``step`` (None: the latest), or the folder's.

    Raises:
      ConfigError: ``step`` given for a folder (it holds one set of weights).
      RestoreError: a checkpoint that is missing, fails verification or does not fit.
    """
    if source.folder is None:
        return restore_state(run, step, command)
    if step is not None:
        raise ConfigError(
            f"--step {step}: {source.folder} is a Hugging Face folder, which "
            "holds one set of weights; drop --step"
        )
    return run.trainer.init()
