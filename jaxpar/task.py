"""What to train: a model constructor, a loss, and the logical axes of a batch.

A :class:`Task` is all jaxpar needs to train any Flax NNX module: the built-in
GPT and classifiers are Tasks, and so is a user's own model (see
``examples/custom_model.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models.classifiers import ConvNet, MLPClassifier
from jaxpar.models.gpt import GPT, GPTConfig

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


def lm_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1]."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, {}


def classification_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross entropy and accuracy over ``batch['images']``, ``batch['labels']``."""
    logits = model(batch["images"])
    labels = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy}


def gpt_config(cfg: ModelConfig) -> GPTConfig:
    """The GPT fields of a ``ModelConfig``."""
    return GPTConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, d_ff=cfg.d_ff, max_seq_len=cfg.max_seq_len,
        positions=cfg.positions, tie_embeddings=cfg.tie_embeddings,
        remat=cfg.remat, dtype=cfg.dtype,
    )


def task_from_config(cfg: ModelConfig, seq_len: int = 0,
                     image_shape: tuple[int, int, int] | None = None) -> Task:
    """The built-in task named by ``cfg.name``.

    Args:
      cfg: model section of the config.
      seq_len: LM window length (tokens per example is ``seq_len``).
      image_shape: (H, W, C) for classifiers.
    """
    if cfg.name == "gpt":
        gcfg = gpt_config(cfg)
        return Task(lambda rngs: GPT(gcfg, rngs=rngs), lm_loss,
                    {"tokens": ("batch", None)}, tokens_per_example=seq_len)
    if image_shape is None:
        raise ValueError(f"model.name={cfg.name} needs image data (data.path to an .npz, or empty)")
    axes: dict[str, Any] = {"images": ("batch", None, None, None), "labels": ("batch",)}
    if cfg.name == "convnet":
        return Task(lambda rngs: ConvNet(image_shape, cfg.channels, cfg.hidden, cfg.num_classes,
                                         rngs=rngs), classification_loss, axes)
    return Task(lambda rngs: MLPClassifier(image_shape, cfg.hidden, cfg.num_classes, rngs=rngs),
                classification_loss, axes)
