"""Image classifiers in Flax NNX: the classic MNIST-style convnet and an MLP.

Images are NHWC float arrays [B, H, W, C]; outputs are logits [B, classes].
Logical axes: conv kernels (conv_h, conv_w, conv_in, conv_out); the first
dense layer W[D, F] (embed, mlp) over the flattened features, the second
W[F, K] (mlp, classes) — column- then row-parallel under tensor rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.logical import constrain


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

    def __init__(self, image_shape: tuple[int, int, int], channels: int, hidden: int,
                 num_classes: int, *, rngs: nnx.Rngs):
        H, W, C = image_shape
        self.conv1_w, self.conv1_b = _conv(rngs.params(), 5, C, channels), _bias(channels, "conv_out")
        self.conv2_w, self.conv2_b = _conv(rngs.params(), 5, channels, channels), _bias(channels, "conv_out")
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
        h_BF = constrain(jax.nn.relu(x_BD @ self.dense1_w[...] + self.dense1_b[...]), ("batch", "mlp"))
        return h_BF @ self.dense2_w[...] + self.dense2_b[...]


class MLPClassifier(nnx.Module):
    """Flatten → dense (F) → ReLU → dense (K)."""

    def __init__(self, image_shape: tuple[int, int, int], hidden: int, num_classes: int,
                 *, rngs: nnx.Rngs):
        H, W, C = image_shape
        self.dense1_w = _dense(rngs.params(), H * W * C, hidden, ("embed", "mlp"))
        self.dense1_b = _bias(hidden, "mlp")
        self.dense2_w = _dense(rngs.params(), hidden, num_classes, ("mlp", "classes"))
        self.dense2_b = _bias(num_classes, "classes")

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        x_BD = constrain(images_BHWC.reshape(images_BHWC.shape[0], -1), ("batch", None))
        h_BF = constrain(jax.nn.relu(x_BD @ self.dense1_w[...] + self.dense1_b[...]), ("batch", "mlp"))
        return h_BF @ self.dense2_w[...] + self.dense2_b[...]
