"""What a Hugging Face layout of one of jaxpar's model families is: data, one per family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Layout:
    """A Hugging Face architecture a jaxpar model config maps onto.

    Attributes:
      config_type: the model config it holds (``GPTConfig``, ``LlamaConfig``).
      name, architecture: its name in messages and ``config.json``'s architecture.
      cannot_hold: ``cfg -> [reasons]``: what of a model the layout cannot hold.
      hf_config: ``cfg -> config.json``.
      to_hf: ``(params, cfg) -> {HF name: tensor}``.
      from_hf: ``(tensors, cfg, where) -> params`` (a ``DataError`` naming what does not fit).
      differences: ``(config.json, cfg) -> [each difference and which side to change]``.
      family: the jaxpar ``model.name`` it loads into.
      model_types: the ``config.json`` model types it reads.
      settings: ``(config.json, where) -> {model key: value}`` (a ``DataError`` naming a
        key it refuses).
      written_as: ``cfg -> the architecture an export writes``.
    """

    config_type: type
    name: str
    architecture: str
    cannot_hold: Callable[[Any], list[str]]
    hf_config: Callable[[Any], dict[str, Any]]
    to_hf: Callable[[dict[str, Any], Any], dict[str, np.ndarray]]
    from_hf: Callable[[dict[str, np.ndarray], Any, str], dict[str, Any]]
    differences: Callable[[dict[str, Any], Any], list[str]]
    family: str
    model_types: tuple[str, ...]
    settings: Callable[[dict[str, Any], str], dict[str, Any]]
    written_as: Callable[[Any], str]


def tensor_problems(tensors: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Each tensor ``shapes`` names that is missing or misshapen, and each one it does not
    name."""
    problems = [f"{k} missing" for k in shapes if k not in tensors]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in shapes]
    return problems + [f"{k} has shape {tuple(tensors[k].shape)}, expected {s}"
                       for k, s in shapes.items() if k in tensors
                       and tuple(tensors[k].shape) != s]


def key_differences(pairs: tuple[tuple[str, str, Any], ...], cfg: Any) -> list[str]:
    """For each ``(config.json key, model key, config.json value)`` that differs from the
    model config: the difference and the override that matches it."""
    out = []
    for theirs, ours, value in pairs:
        if value != getattr(cfg, ours):
            shown = str(value).lower() if isinstance(value, bool) else value
            out.append(f"{theirs}={shown} but model.{ours}={getattr(cfg, ours)} "
                       f"(set model.{ours}={shown})")
    return out
