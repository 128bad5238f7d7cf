"""Dropout whose draws no layout changes: one key per example, folded with a tag per
draw (the layer, the kind), from (the model's RNG key, its RNG count, the example's id).

The count is the microbatch's: the loss advances it by one per microbatch, and the
pipeline executor gives microbatch ``j`` of a step the count ``c + j``; the example id is
the window's position in the corpus (``DataNeeds.example_ids``). So no call order enters:
every layout and every pipeline schedule draws the same masks as one device with the
same microbatches, and a resumed run draws those of the uninterrupted one. Each example's
mask is drawn over its whole shape in the tokens' natural order, so a layout that splits
or reorders the sequence keeps each token's draw (under ``context`` each device may draw
the whole sequence's mask and keep its part).

Pipeline stages together with ``train.grad_accum`` > 1 as well: accumulation pass ``i``
holds the rows of one device's microbatches ``i·m … i·m + m − 1``
(:class:`jaxpar.gradients.Accumulated`'s ``per_call``), so its pipeline microbatch ``l``
draws from count ``c + i·m + l``, that of one device accumulating the ``k·m``
microbatches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: the key evaluation draws from (no dropout there; BERT's masking is the same every time)
EVAL_KEY = 2024

#: a decoder's fold-in tags: its embeddings', then each layer's draws (:class:`LayerNoise`)
EMBEDDING_TAG, FIRST_LAYER_TAG = 1, 2
_KINDS = ("attention", "mlp", "probabilities")


def fold(keys_B: jax.Array, tags: Any) -> jax.Array:
    """Each example's key folded with its tag (one tag for all, or one per example)."""
    tags = jnp.broadcast_to(jnp.asarray(tags, jnp.uint32), keys_B.shape)
    return jax.vmap(jax.random.fold_in)(keys_B, tags)


def dropout(
    x: jax.Array, keys_B: jax.Array, rate: float, positions_T: np.ndarray | None = None
) -> jax.Array:
    """Inverted dropout of ``x`` [B, …] with one key per example (``keys_B`` [B]): an
    example's mask does not depend on which device holds it or which rows share its
    batch. ``positions_T``: the positions of ``x``'s dim 1 when a layout reorders the
    sequence (each token keeps the draw of its position)."""
    if rate == 0.0:
        return x
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys_B)
    if positions_T is not None:
        keep = keep[:, np.asarray(positions_T)]
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def example_keys(noise: nnx.Rngs, deterministic: bool, index_B: jax.Array) -> jax.Array:
    """One key per example: (RNG key, count, example id); in evaluation a fixed key."""
    stream = noise.dropout
    base = (
        jax.random.key(EVAL_KEY)
        if deterministic
        else jax.random.fold_in(stream.key[...], stream.count[...])
    )
    return fold(jnp.broadcast_to(base, index_B.shape), index_B)


def advance(noise: nnx.Rngs, deterministic: bool) -> None:
    """One microbatch done: the next draws from the next count."""
    if not deterministic:
        noise.dropout.count[...] += 1


@dataclasses.dataclass(frozen=True)
class LayerNoise:
    """A decoder layer's dropout: of its attention and MLP outputs at ``hidden``, of its
    attention probabilities at ``attention``; ``layer``: its index in the whole model
    (however a pipeline cuts the layers into stages); ``positions_T``: the tokens'
    positions where a layout reorders them."""

    keys_B: jax.Array
    layer: Any
    hidden: float
    attention: float
    positions_T: np.ndarray | None = None

    def drop(self, x: jax.Array, kind: str, rate: float) -> jax.Array:
        """``x`` after the layer's dropout of ``kind`` (one of ``attention``, ``mlp``,
        ``probabilities``) at ``rate``."""
        tag = FIRST_LAYER_TAG + len(_KINDS) * self.layer + _KINDS.index(kind)
        positions = None if kind == "probabilities" else self.positions_T
        return dropout(x, fold(self.keys_B, tag), rate, positions)
