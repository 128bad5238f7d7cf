"""The built-in tasks: the GPT language model and the image classifiers, from config."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.data.sources import DataNeeds
from jaxpar.models.classifiers import ConvNet, MLPClassifier
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.task import Batch, StageSplit, Task


def lm_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1]."""
    return _lm_head(model, model.run_blocks(_lm_embed(model, batch)), batch)


def _lm_embed(model: nnx.Module, batch: Batch) -> jax.Array:
    return model.embed_tokens(batch["tokens"][:, :-1])


def _lm_head(model: nnx.Module, x: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
    logits = model.logits(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
    return loss, {}


#: GPT cut into pipeline stages: embedding first, the stacked blocks split, head and loss last.
GPT_STAGES = StageSplit("blocks", _lm_embed, lambda model, x: model.run_blocks(x), _lm_head)


def classification_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross entropy and accuracy over ``batch['images']``, ``batch['labels']``."""
    logits = model(batch["images"])
    labels = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy}


def gpt_config(cfg: ModelConfig) -> GPTConfig:
    """The GPT fields of a ``ModelConfig`` (same names in both)."""
    return GPTConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)})


def data_needs(cfg: ModelConfig) -> DataNeeds:
    """What the built-in model ``cfg.name`` takes from the config's data."""
    if cfg.name == "gpt":
        return DataNeeds("text", vocab_size=cfg.vocab_size)
    return DataNeeds("images", num_classes=cfg.num_classes)


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
                    {"tokens": ("batch", None)}, tokens_per_example=seq_len, stages=GPT_STAGES,
                    name="gpt")
    if image_shape is None:
        raise ValueError(f"model.name={cfg.name} needs image data (data.path to an .npz, or empty)")
    axes: dict[str, Any] = {"images": ("batch", None, None, None), "labels": ("batch",)}
    if cfg.name == "convnet":
        return Task(lambda rngs: ConvNet(image_shape, cfg.channels, cfg.hidden, cfg.num_classes,
                                         rngs=rngs), classification_loss, axes, name="convnet")
    return Task(lambda rngs: MLPClassifier(image_shape, cfg.hidden, cfg.num_classes, rngs=rngs),
                classification_loss, axes, name="mlp")
