"""What to train: a model constructor, a loss, and the logical axes of a batch.

A :class:`Task` is all jaxpar needs to train any Flax NNX module: the built-in
GPT and classifiers are Tasks (``jaxpar/builtin_tasks.py``), and so is a user's
own model (see ``examples/custom_model.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
from flax import nnx

Batch = Mapping[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@dataclass(frozen=True)
class Task:
    """A trainable problem.

    Attributes:
      model_fn: builds the module from ``nnx.Rngs`` (called under
        ``nnx.eval_shape`` and under ``jit`` — never eagerly on one device).
      loss_fn: ``(model, batch) -> (scalar loss, {name: scalar metric})``; the
        loss must be a mean over examples so gradient accumulation is exact.
      batch_axes: logical axes of each batch entry, e.g.
        ``{"tokens": ("batch", None)}`` (``None``: never sharded).
      path_rules: ``(regex, logical names)`` pairs for parameters without
        ``axes`` metadata, matched against paths like ``'dense1/kernel'``.
      tokens_per_example: tokens one example carries (0 for non-sequence
        tasks), for the throughput metric.
    """

    model_fn: Callable[[nnx.Rngs], nnx.Module]
    loss_fn: LossFn
    batch_axes: Mapping[str, tuple[str | None, ...]]
    path_rules: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    tokens_per_example: int = 0
