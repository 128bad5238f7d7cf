"""What a Hugging Face layout of one of jaxpar's model families is: data, one per family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpar.errors import DataError


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
      bounds: model keys that only bound what a run may do (a rotary model's
        ``max_seq_len``: the longest sequence, the KV cache's length), which a run may set
        below the folder's value but not above.
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
    bounds: tuple[str, ...] = ()


def tensor_problems(tensors: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Each tensor ``shapes`` names that is missing, misshapen, not of a float type (an
    integer tensor would be cast to weights) or holding NaN or infinity, and each one it
    does not name."""
    problems = [f"{k} missing" for k in shapes if k not in tensors]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in shapes]
    problems += [
        f"{k} has shape {tuple(tensors[k].shape)}, expected {s}"
        for k, s in shapes.items()
        if k in tensors and tuple(tensors[k].shape) != s
    ]
    present = [k for k in shapes if k in tensors]
    problems += [
        f"{k} holds {np.dtype(tensors[k].dtype).name} values, not weights (a float type)"
        for k in present
        if not _is_float(tensors[k])
    ]
    return problems + [
        f"{k} holds {n:,} NaN or infinite value{'s' * (n != 1)}"
        for k in present
        if _is_float(tensors[k]) and (n := _nonfinite(tensors[k]))
    ]


def _is_float(x: Any) -> bool:
    """float16/32/64 and ml_dtypes' bfloat16 and float8 types (numpy kind 'V')."""
    dtype = np.dtype(x.dtype)
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def _nonfinite(x: Any) -> int:
    return int(np.size(x) - np.count_nonzero(np.isfinite(np.asarray(x, np.float32))))


def key_differences(pairs: tuple[tuple[str, str, Any], ...], cfg: Any) -> list[str]:
    """For each ``(config.json key, model key, config.json value)`` that differs from the
    model config: the difference and the override that matches it."""
    out = []
    for theirs, ours, value in pairs:
        if value != getattr(cfg, ours):
            shown = str(value).lower() if isinstance(value, bool) else value
            out.append(
                f"{theirs}={shown} but model.{ours}={getattr(cfg, ours)} (set model.{ours}={shown})"
            )
    return out


#: what a folder jaxpar cannot read exactly leaves its user (the fix of :func:`unsupported`)
CANNOT_READ = (
    "jaxpar cannot load this model exactly; bring it as a model of your own (--task), or "
    "take a folder of a kind docs/checkpoints.md lists as read"
)


def unsupported(where: str, what: str) -> DataError:
    """The one line for a ``config.json`` setting ``what`` that jaxpar computes otherwise
    (or not at all), naming it and what the user can do."""
    return DataError(f"{where}: config.json {what}; {CANNOT_READ}")


def check_keys(
    hf: dict[str, Any],
    where: str,
    architecture: str,
    read: frozenset[str],
    required: dict[str, tuple[Any, str]],
) -> None:
    """Every key of ``config.json`` is in ``read`` (the keys the layout maps or knows to
    have no effect), and each of ``required`` holds its value (or null).

    Raises:
      DataError: one line naming the first key that is neither, or a required one whose
        value jaxpar would compute differently (with ``required``'s reason).
    """
    unknown = sorted(k for k in hf if k not in read | required.keys())
    if unknown:
        raise DataError(
            f"{where}: config.json key {unknown[0]}={hf[unknown[0]]!r} is not one "
            f"jaxpar's {architecture} reads (it may change the numbers): jaxpar "
            "would need to model it; remove it only if it has no effect"
        )
    for key, (value, why) in required.items():
        if hf.get(key) not in (None, value):
            raise unsupported(where, f"{key}={hf[key]!r}: {why}")


def untied(tensors: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The tensors to read: a tied model's files may store the head, which must then be
    the token table itself (a different one is left in, to be reported as unexpected)."""
    t = dict(tensors)
    if tied:
        head = t.pop("lm_head.weight", None)
        if head is not None and not np.array_equal(head, t.get("model.embed_tokens.weight")):
            t["lm_head.weight"] = head
    return t


def folder_differences(theirs: dict[str, Any], cfg: Any, bounds: tuple[str, ...] = ()) -> list[str]:
    """Each ``model.*`` value of a folder (``theirs``, from its layout's settings) that the
    run's config ``cfg`` does not have, and which side to change; a key of ``bounds``
    (:attr:`Layout.bounds`) may be lower than the folder's."""
    shown = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return [
        f"config.json gives model.{k}={shown(v)} but the run has model.{k}="
        f"{shown(getattr(cfg, k))} (drop that override: the folder decides"
        + (", at most" if k in bounds else "")
        + ")"
        for k, v in theirs.items()
        if not (getattr(cfg, k) <= v if k in bounds else getattr(cfg, k) == v)
    ]
