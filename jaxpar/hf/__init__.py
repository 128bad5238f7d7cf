"""Hugging Face interchange: ``jaxpar export RUN_DIR --format hf`` and ``model.init_from``.

Each model family with a Hugging Face counterpart has its layout here, one module each —
:mod:`jaxpar.hf.gpt2` (``GPT2LMHeadModel``) and :mod:`jaxpar.hf.llama`
(``LlamaForCausalLM``) — as data (:class:`~jaxpar.hf.layout.Layout`); the files are
:mod:`jaxpar.hf.files`' (safetensors through ``safetensors.numpy``: torch is never needed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError, DataError
from jaxpar.hf import files
from jaxpar.hf.gemma import LAYOUT as GEMMA
from jaxpar.hf.gpt2 import LAYOUT as GPT2
from jaxpar.hf.layout import Layout, unsupported
from jaxpar.hf.llama import LAYOUT as LLAMA

LAYOUTS: tuple[Layout, ...] = (GPT2, LLAMA, GEMMA)


def layout_of(cfg: Any) -> Layout | None:
    """The Hugging Face layout of a model config (None: the family has none)."""
    return next((x for x in LAYOUTS if isinstance(cfg, x.config_type)), None)


def check_exportable(family: str, cfg: Any) -> None:
    """Raises a one-line ConfigError when a run's model has no Hugging Face layout or its
    layout cannot hold it.

    Args:
      family: the run's ``model.name`` (``""`` for a user's task).
      cfg: its typed model config (None for a user's task).
    """
    layout = layout_of(cfg)
    if layout is None:
        what = f"model.name={family}" if family else "a user's task (--task)"
        known = ", ".join(f"{x.name} ({x.architecture})" for x in LAYOUTS)
        raise ConfigError(
            f"--format hf writes the Hugging Face layouts of {known}; this run "
            f"is {what}: use --format npz"
        )
    why = layout.cannot_hold(cfg)
    if why:
        raise ConfigError(
            f"--format hf: {layout.name}'s layout cannot hold this model: "
            + "; ".join(why)
            + "; use --format npz"
        )


def write(
    out: str | Path, params: dict[str, Any], cfg: Any, max_shard_bytes: int = files.MAX_SHARD_BYTES
) -> Path:
    """Writes the Hugging Face directory of a model's parameters (host arrays)."""
    layout = layout_of(cfg)
    return files.write_dir(out, layout.to_hf(params, cfg), layout.hf_config(cfg), max_shard_bytes)


def agreed(
    given: dict[str, Any], settings: dict[str, Any], family: str, typed: Callable[[str, Any], Any]
) -> dict[str, Any]:
    """The model keys ``given`` with the folder's ``settings``, which decide — except that
    a bound of the ``family``'s layout (:attr:`Layout.bounds`) may be given lower.

    Raises:
      ConfigError: one line naming every given key that contradicts the folder.
    """
    bounds = next(x.bounds for x in LAYOUTS if x.family == family)

    def clashes(k: str, v: Any) -> bool:
        ours = typed(k, given[k])
        return not (ours <= v if k in bounds else ours == v)

    wrong = [k for k, v in settings.items() if k in given and clashes(k, v)]
    if wrong:
        what = "; ".join(
            f"model.{k}={given[k]} (its config.json gives {settings[k]}"
            f"{', the most it reads' if k in bounds else ''})"
            for k in wrong
        )
        raise ConfigError(
            f"model.init_from={given['init_from']} decides the model, but the "
            f"config also sets {what}: drop " + " ".join(f"model.{k}" for k in wrong)
        )
    kept = {k: given[k] for k in bounds if k in given}
    return {**given, **settings, **kept}


def folder_settings(directory: str | Path, family: str = "") -> tuple[str, dict[str, Any]]:
    """The jaxpar ``model.name`` and ``model.*`` values of a Hugging Face folder, from its
    ``config.json`` alone (what ``model.init_from=FOLDER`` needs no other key for).

    Raises:
      DataError: one line naming the missing file, an architecture jaxpar does not read,
        or a key it would compute differently.
    """
    hf = files.read_json(directory, "causal LM")
    where = f"model.init_from={directory}"
    kind = hf.get("model_type")
    layout = next((x for x in LAYOUTS if kind in x.model_types), None)
    if layout is None:
        known = ", ".join(t for x in LAYOUTS for t in x.model_types)
        raise unsupported(where, f"has model_type={kind!r}; jaxpar reads {known}")
    if family and family != layout.family:
        raise ConfigError(
            f"model.name={family} but {where} holds a {kind} model "
            f"({layout.family} in jaxpar): drop model.name, the folder decides"
        )
    try:
        return layout.family, layout.settings(hf, where)
    except KeyError as err:
        raise DataError(
            f"{where}: config.json has no {err.args[0]!r}, which a {kind} model "
            "needs; give the folder transformers saved"
        ) from None


def lowers_max_seq_len(cfg: Any) -> bool:
    """Whether a run of model config ``cfg`` from a folder may set ``model.max_seq_len``
    below the folder's (:attr:`Layout.bounds`)."""
    layout = layout_of(cfg)
    return layout is not None and "max_seq_len" in layout.bounds


def written_as(cfg: Any) -> str:
    """The Hugging Face architecture an export of model config ``cfg`` writes."""
    return layout_of(cfg).written_as(cfg)


def read_config(directory: str | Path, cfg: Any) -> dict[str, Any]:
    """``directory/config.json``, checked against the run's model config.

    Raises:
      DataError: one line naming the missing file, or each difference and the override
        that fixes it.
    """
    layout = layout_of(cfg)
    hf = files.read_json(directory, layout.name)
    diffs = layout.differences(hf, cfg)
    if diffs:
        fixes = [d.rsplit("(set ", 1)[1].rstrip(")") for d in diffs if "(set " in d]
        tail = f"; to match it, pass {' '.join(fixes)}" if fixes else ""
        raise DataError(
            f"model.init_from={directory}: {files.CONFIG} does not match this "
            "run's model: " + "; ".join(diffs) + tail
        )
    return hf


def init_params_for(cfg: Any) -> Callable[[], dict[str, Any]] | None:
    """The pretrained weights a run of model config ``cfg`` starts from
    (``Task.init_params``): those of ``model.init_from``; None without it. ``config.json``
    is checked now (a mismatch fails before anything runs); the weights are read when the
    trainer initializes a fresh run (a resumed one never reads them)."""
    directory = getattr(cfg, "init_from", "")
    layout = layout_of(cfg)
    if not directory or layout is None:
        return None
    read_config(directory, cfg)
    return lambda: layout.from_hf(files.read_tensors(directory), cfg, directory)


def to_hf(params: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """The Hugging Face tensors of a model's parameters."""
    return layout_of(cfg).to_hf(params, cfg)


def from_hf(tensors: dict[str, Any], cfg: Any, where: str = "") -> dict[str, Any]:
    """A model's parameters from Hugging Face tensors (a ``DataError`` naming what does not
    fit)."""
    return layout_of(cfg).from_hf(tensors, cfg, where)
