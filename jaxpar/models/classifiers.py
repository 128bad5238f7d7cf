"""Image classifiers in Flax NNX: the classic MNIST-style convnet and an MLP — two model
families, ``model.name=convnet`` and ``model.name=mlp``.

Images are NHWC float arrays [B, H, W, C]; outputs are logits [B, classes].
Logical axes: conv kernels (conv_h, conv_w, conv_in, conv_out); the first
dense layer W[D, F] (embed, mlp) over the flattened features, the second
W[F, K] (mlp, classes) — column- then row-parallel under tensor rules.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from pydantic import Field

from jaxpar.logical import constrain
from jaxpar.models.family import Counts, Family, ModelConfig, register
from jaxpar.schema import section
from jaxpar.task import DataNeeds, Task


def _dense(key: jax.Array, fan_in: int, fan_out: int, axes: tuple[str, str]) -> nnx.Param:
    limit = (6.0 / (fan_in + fan_out)) ** 0.5  # Glorot uniform
    w = jax.random.uniform(key, (fan_in, fan_out), jnp.float32, -limit, limit)
    return nnx.Param(w, out_sharding=axes)


def _conv(key: jax.Array, size: int, c_in: int, c_out: int) -> nnx.Param:
    fan_in = size * size * c_in
    w = jax.random.normal(key, (size, size, c_in, c_out), jnp.float32) * (2.0 / fan_in) ** 0.5
    return nnx.Param(w, out_sharding=("conv_h", "conv_w", "conv_in", "conv_out"))


def _bias(size: int, axis: str) -> nnx.Param:
    return nnx.Param(jnp.zeros((size,), jnp.float32), out_sharding=(axis,))


class ConvNet(nnx.Module):
    """conv 5×5 (C) → ReLU → conv 5×5 (C) → ReLU → dense (F) → ReLU → dense (K).

    Convolutions use SAME padding, so the flattened feature size is H·W·C.
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        channels: int,
        hidden: int,
        num_classes: int,
        *,
        rngs: nnx.Rngs,
    ):
        H, W, C = image_shape
        self.conv1_w = _conv(rngs.params(), 5, C, channels)
        self.conv1_b = _bias(channels, "conv_out")
        self.conv2_w = _conv(rngs.params(), 5, channels, channels)
        self.conv2_b = _bias(channels, "conv_out")
        self.dense1_w = _dense(rngs.params(), H * W * channels, hidden, ("embed", "mlp"))
        self.dense1_b = _bias(hidden, "mlp")
        self.dense2_w = _dense(rngs.params(), hidden, num_classes, ("mlp", "classes"))
        self.dense2_b = _bias(num_classes, "classes")

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        x = constrain(images_BHWC, ("batch", None, None, None))
        for w, b in ((self.conv1_w, self.conv1_b), (self.conv2_w, self.conv2_b)):
            x = jax.lax.conv_general_dilated(
                x, w[...], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            x = jax.nn.relu(x + b[...])
        x_BD = x.reshape(x.shape[0], -1)
        h_BF = constrain(
            jax.nn.relu(x_BD @ self.dense1_w[...] + self.dense1_b[...]), ("batch", "mlp")
        )
        return h_BF @ self.dense2_w[...] + self.dense2_b[...]


class MLPClassifier(nnx.Module):
    """Flatten → dense (F) → ReLU → dense (K)."""

    def __init__(
        self, image_shape: tuple[int, int, int], hidden: int, num_classes: int, *, rngs: nnx.Rngs
    ):
        H, W, C = image_shape
        self.dense1_w = _dense(rngs.params(), H * W * C, hidden, ("embed", "mlp"))
        self.dense1_b = _bias(hidden, "mlp")
        self.dense2_w = _dense(rngs.params(), hidden, num_classes, ("mlp", "classes"))
        self.dense2_b = _bias(num_classes, "classes")

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        x_BD = constrain(images_BHWC.reshape(images_BHWC.shape[0], -1), ("batch", None))
        h_BF = constrain(
            jax.nn.relu(x_BD @ self.dense1_w[...] + self.dense1_b[...]), ("batch", "mlp")
        )
        return h_BF @ self.dense2_w[...] + self.dense2_b[...]


# ---- the families -------------------------------------------------------------------------
#: Batch entries of an image task and their logical axes.
IMAGE_AXES = {"images": ("batch", None, None, None), "labels": ("batch",)}


def classification_loss(model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross entropy and accuracy over ``batch['images']``, ``batch['labels']``."""
    return logits_loss(model(batch["images"]), batch)


def logits_loss(logits: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross entropy and accuracy of ``logits`` against ``batch['labels']`` (the
    loss of a classifier given by its layers, ``jaxpar.Layers(loss=…)``)."""
    labels = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy}


def _images(cfg: Any) -> DataNeeds:
    return DataNeeds("images", num_classes=cfg.num_classes)


@section("model")
class ConvNetConfig(ModelConfig):
    """``model.*`` keys of ``model.name=convnet``."""

    channels: int = Field(20, ge=1, description="channels of both 5×5 convolutions")
    hidden: int = Field(50, ge=1, description="units of the hidden dense layer")
    num_classes: int = Field(10, ge=2, description="classes (labels 0 … num_classes−1)")


def _convnet_counts(cfg: ConvNetConfig, data: Any) -> Counts:
    H, W, C = data.image_shape
    k = 25  # a 5×5 kernel
    c, f, n = cfg.channels, cfg.hidden, cfg.num_classes
    params = k * C * c + c + k * c * c + c + H * W * c * f + f + f * n + n
    # multiply-adds of one forward pass; backward: weight and input gradients (twice the
    # forward) except the first convolution's input gradient (the images need none)
    first = H * W * k * C * c
    rest = H * W * k * c * c + H * W * c * f + f * n
    return Counts(params, 2 * (3 * (first + rest) - first))


def convnet_task(cfg: ConvNetConfig, image_shape: tuple[int, int, int]) -> Task:
    """The ConvNet's task: classify images of ``image_shape`` (H, W, C)."""
    return Task(
        lambda rngs: ConvNet(image_shape, cfg.channels, cfg.hidden, cfg.num_classes, rngs=rngs),
        classification_loss,
        IMAGE_AXES,
        name="convnet",
    )


CONVNET = register(
    Family(
        "convnet",
        ConvNetConfig,
        lambda cfg, data: convnet_task(cfg, data.image_shape),
        _images,
        counts=_convnet_counts,
        doc="conv 5×5 → conv 5×5 → dense → dense, on images",
    )
)


@section("model")
class MLPConfig(ModelConfig):
    """``model.*`` keys of ``model.name=mlp``."""

    hidden: int = Field(50, ge=1, description="units of the hidden dense layer")
    num_classes: int = Field(10, ge=2, description="classes (labels 0 … num_classes−1)")


def _mlp_counts(cfg: MLPConfig, data: Any) -> Counts:
    d, f, n = math.prod(data.image_shape), cfg.hidden, cfg.num_classes
    params = d * f + f + f * n + n
    # forward d·f + f·n multiply-adds; backward: all weight gradients, the hidden input gradient
    return Counts(params, 2 * (2 * (d * f + f * n) + f * n))


def mlp_task(cfg: MLPConfig, image_shape: tuple[int, int, int]) -> Task:
    """The MLP's task: classify images of ``image_shape`` (H, W, C)."""
    return Task(
        lambda rngs: MLPClassifier(image_shape, cfg.hidden, cfg.num_classes, rngs=rngs),
        classification_loss,
        IMAGE_AXES,
        name="mlp",
    )


MLP = register(
    Family(
        "mlp",
        MLPConfig,
        lambda cfg, data: mlp_task(cfg, data.image_shape),
        _images,
        counts=_mlp_counts,
        doc="flatten → dense → dense, on images",
    )
)
