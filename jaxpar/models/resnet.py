"""ResNet (He et al., 2016) in Flax NNX — the family ``model.name=resnet``.

Its forward is a sequence of layers (stem, the four stages, pool, head: ``ResNet.layers``),
so ``mesh.stage`` pipelines it by layer, each stage keeping its BatchNorm statistics.

Built from stock ``nnx.Conv``, ``nnx.BatchNorm`` and ``nnx.Linear``, every parameter named
through Flax's own metadata (``nnx.with_partitioning``). The blocks of a stage after its
first are stacked on a leading ``layers`` dim (``nnx.vmap``) and run with ``nnx.scan``, so
compile time does not grow with depth (ResNet-152 compiles like ResNet-50).

Shapes: images [B, H, W, C] (NHWC) → logits [B, classes]. Channel dims carry two logical
names, after the transformer's: ``embed`` for the residual stream's channels (sharded over
``fsdp`` like every other weight) and ``mlp`` for the channels *inside* a block, which
tensor parallelism splits. Each block pairs its convolutions as Megatron pairs an MLP's
matrices:

* basic block (ResNet-10/18/34): conv1 3×3 W[3, 3, C_embed, C_mlp] is column-parallel
  (split over its output channels), conv2 W[3, 3, C_mlp, C_embed] row-parallel (split over
  its input channels); the activation between them is split by channel
  (``H[B, H, W, C_tensor]``) and one all-reduce after conv2 joins the partial sums;
* bottleneck (ResNet-50/101/152): conv1 1×1 reduces C → M whole, then conv2 3×3 (M → M,
  column) and conv3 1×1 (M → 4M, row) form the pair.

BatchNorm between a pair normalizes channel-split activations: its statistics are
per channel, so each device computes those of its channels (reduced over the batch shards
of ``data``/``fsdp``), and every layout gives the one-device numbers.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from jaxpar.logical import constrain
from jaxpar.models.classifiers import IMAGE_AXES, classification_loss, logits_loss
from jaxpar.models.family import Counts, Dtype, Family, ModelConfig, register
from jaxpar.schema import section
from jaxpar.task import DataNeeds, Layers, Task

#: ``model.depth`` values
Depth = Literal[10, 18, 34, 50, 101, 152]
#: blocks per stage, and whether they are bottlenecks, by depth
DEPTHS = {
    10: ((1, 1, 1, 1), False),
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}
assert tuple(DEPTHS) == typing.get_args(Depth)
_STREAM = ("batch", None, None, "act_embed")
_SPLIT = ("batch", None, None, "mlp")


@section("model")
class ResNetConfig(ModelConfig):
    """``model.*`` keys of ``model.name=resnet``."""

    depth: Depth = Field(
        50, description="ResNet-10/18/34 (basic blocks) or 50/101/152 (bottlenecks)"
    )
    width: int = Field(64, ge=1, description="channels of the first stage (doubling per stage)")
    stem: Literal["imagenet", "small"] = Field(
        "imagenet",
        description="imagenet: 7×7 stride-2 conv and 3×3 max pool; small: one 3×3 "
        "conv (8×8 or 32×32 images)",
    )
    num_classes: int = Field(1000, ge=2, description="classes (labels 0 … num_classes−1)")
    dtype: Dtype = Field("float32", description="compute dtype (parameters stay float32)")


#: The default initializer of a layer's weights (LeCun normal), made once.
_LECUN_NORMAL = nnx.initializers.lecun_normal()


def _named(*names: str | None, init: Any = _LECUN_NORMAL) -> Any:
    return nnx.with_partitioning(init, names)


def _conv(
    c_in: int, c_out: int, size: int, stride: int, names: tuple, rngs: nnx.Rngs, dtype: Any
) -> nnx.Conv:
    init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")  # He init
    return nnx.Conv(
        c_in,
        c_out,
        (size, size),
        strides=stride,
        padding="SAME",
        use_bias=False,
        kernel_init=_named("conv_h", "conv_w", *names, init=init),
        dtype=dtype,
        rngs=rngs,
    )


def _norm(
    channels: int, name: str, rngs: nnx.Rngs, dtype: Any, zero: bool = False
) -> nnx.BatchNorm:
    ones, zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()
    return nnx.BatchNorm(
        channels,
        momentum=0.9,
        epsilon=1e-5,
        dtype=dtype,
        scale_init=_named(name, init=zeros if zero else ones),
        bias_init=_named(name, init=zeros),
        rngs=rngs,
    )


class Block(nnx.Module):
    """A residual block: basic (two 3×3) or bottleneck (1×1, 3×3, 1×1); the last
    BatchNorm's scale starts at zero, so each block starts as the identity."""

    def __init__(
        self, c_in: int, width: int, stride: int, bottleneck: bool, *, rngs: nnx.Rngs, dtype: Any
    ):
        c_out = 4 * width if bottleneck else width
        if bottleneck:
            self.reduce = _conv(c_in, width, 1, 1, ("embed", "conv_out"), rngs, dtype)
            self.reduce_norm = _norm(width, "conv_out", rngs, dtype)
        else:
            self.reduce = self.reduce_norm = None
        first = width if bottleneck else c_in
        self.conv1 = _conv(first, width, 3, stride, ("embed", "mlp"), rngs, dtype)
        self.norm1 = _norm(width, "mlp", rngs, dtype)
        self.conv2 = _conv(width, c_out, 1 if bottleneck else 3, 1, ("mlp", "embed"), rngs, dtype)
        self.norm2 = _norm(c_out, "embed", rngs, dtype, zero=True)
        if stride != 1 or c_in != c_out:
            self.shortcut = _conv(c_in, c_out, 1, stride, ("conv_in", "embed"), rngs, dtype)
            self.shortcut_norm = _norm(c_out, "embed", rngs, dtype)
        else:
            self.shortcut = self.shortcut_norm = None

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        h = x_BHWC
        if self.reduce is not None:
            h = nnx.relu(self.reduce_norm(self.reduce(h)))
        h = constrain(nnx.relu(self.norm1(self.conv1(h))), _SPLIT)  # split by channel
        h = self.norm2(self.conv2(h))  # row-parallel: the partial sums are all-reduced
        skip = x_BHWC if self.shortcut is None else self.shortcut_norm(self.shortcut(x_BHWC))
        return constrain(nnx.relu(h + skip), _STREAM)


class Stage(nnx.Module):
    """The blocks of one stage: the first (it may change the width and stride), then
    ``n − 1`` identical blocks stacked on a ``layers`` dim and scanned."""

    def __init__(
        self,
        c_in: int,
        width: int,
        n: int,
        stride: int,
        bottleneck: bool,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
    ):
        self.first = Block(c_in, width, stride, bottleneck, rngs=rngs, dtype=dtype)
        c_out = 4 * width if bottleneck else width

        @nnx.split_rngs(splits=max(n - 1, 1))
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs: nnx.Rngs) -> Block:
            return Block(c_out, width, 1, bottleneck, rngs=rngs, dtype=dtype)

        self.rest = stacked(rngs) if n > 1 else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.first(x)
        if self.rest is None:
            return x

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block: Block, x: jax.Array) -> jax.Array:
            return block(x)

        return run(self.rest, x)


class ResNet(nnx.Module):
    """Stem → 4 stages (widths ×1, ×2, ×4, ×8; strides 1, 2, 2, 2) → mean pool → dense."""

    def __init__(self, cfg: ResNetConfig, channels: int, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        counts, bottleneck = DEPTHS[cfg.depth]
        w = cfg.width
        big = cfg.stem == "imagenet"
        self.cfg = cfg
        self.stem = _conv(
            channels, w, 7 if big else 3, 2 if big else 1, ("conv_in", "embed"), rngs, dtype
        )
        self.stem_norm = _norm(w, "embed", rngs, dtype)
        stages = []
        c = w
        for i, n in enumerate(counts):
            width = w * 2**i
            stages.append(
                Stage(c, width, n, 1 if i == 0 else 2, bottleneck, rngs=rngs, dtype=dtype)
            )
            c = 4 * width if bottleneck else width
        self.stages = nnx.List(stages)
        self.head = nnx.Linear(
            c,
            cfg.num_classes,
            kernel_init=_named("embed", "classes"),
            bias_init=_named("classes", init=nnx.initializers.zeros_init()),
            rngs=rngs,
        )

    def layers(self) -> list[Any]:
        """The forward as a sequence of layers (modules and functions), in order: what a
        pipeline cuts into stages by layer (``jaxpar.Layers``)."""
        dtype = jnp.dtype(self.cfg.dtype)
        layers = [
            lambda x: constrain(x.astype(dtype), ("batch", None, None, None)),
            self.stem,
            self.stem_norm,
            nnx.relu,
        ]
        if self.cfg.stem == "imagenet":
            layers.append(lambda x: nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME"))
        return [
            *layers,
            lambda x: constrain(x, _STREAM),
            *self.stages,
            lambda x: x.astype(jnp.float32).mean(axis=(1, 2)),
            self.head,
        ]

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        x = images_BHWC
        for layer in self.layers():
            x = layer(x)
        return x


# ---- the family -----------------------------------------------------------------------------
def block_shapes(cfg: ResNetConfig, image_shape: tuple[int, int, int]) -> list[tuple]:
    """Per block: (input H, W, C_in, width, stride, C_out), in order."""
    H, W, _ = image_shape
    if cfg.stem == "imagenet":
        H, W = -(-H // 4), -(-W // 4)  # stride-2 conv, stride-2 pool
    counts, bottleneck = DEPTHS[cfg.depth]
    c = cfg.width
    out = []
    for i, n in enumerate(counts):
        width = cfg.width * 2**i
        c_out = 4 * width if bottleneck else width
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            out.append((H, W, c, width, stride, c_out))
            H, W, c = -(-H // stride), -(-W // stride), c_out
    return out


def _counts(cfg: ResNetConfig, data: Any) -> Counts:
    """Parameters and training FLOPs (convolutions and the head; BatchNorm's are small)."""
    H, W, C = data.image_shape
    counts, bottleneck = DEPTHS[cfg.depth]
    stem_k = 49 if cfg.stem == "imagenet" else 9
    s = 2 if cfg.stem == "imagenet" else 1
    Hs, Ws = -(-H // s), -(-W // s)
    params = stem_k * C * cfg.width + 2 * cfg.width
    first = Hs * Ws * stem_k * C * cfg.width  # the stem: no input gradient
    macs = 0
    for h, w, c_in, width, stride, c_out in block_shapes(cfg, data.image_shape):
        ho, wo = -(-h // stride), -(-w // stride)
        # the 3×3 convolution strides (in a bottleneck the 1×1 before it runs at the input's
        # resolution)
        convs = (
            [(h, w, 1, c_in, width), (ho, wo, 9, width, width), (ho, wo, 1, width, c_out)]
            if bottleneck
            else [(ho, wo, 9, c_in, width), (ho, wo, 9, width, c_out)]
        )
        if stride != 1 or c_in != c_out:
            convs.append((ho, wo, 1, c_in, c_out))
        for oh, ow, k, a, b in convs:
            macs += oh * ow * k * a * b
            params += k * a * b + 2 * b
    c = cfg.width * 2**3 * (4 if bottleneck else 1)
    macs += c * cfg.num_classes
    params += c * cfg.num_classes + cfg.num_classes
    return Counts(params, 2 * (3 * (first + macs) - first))


def task(cfg: ResNetConfig, channels: int) -> Task:
    """The ResNet's task: classify images of ``channels`` channels (any height and width)."""
    return Task(
        lambda rngs: ResNet(cfg, channels, rngs=rngs),
        classification_loss,
        IMAGE_AXES,
        name=f"resnet{cfg.depth}",
        layers=Layers(inputs="images", loss=logits_loss, of=ResNet.layers),
    )


def _needs(cfg: ResNetConfig) -> DataNeeds:
    return DataNeeds("images", num_classes=cfg.num_classes)


RESNET = register(
    Family(
        "resnet",
        ResNetConfig,
        lambda cfg, data: task(cfg, data.image_shape[-1]),
        _needs,
        counts=_counts,
        compute_dtype=lambda cfg: cfg.dtype,
        doc="ResNet-10 … 152 with BatchNorm; convolutions split by channel under tensor",
    )
)
