"""The GPT's generation with a KV cache (:meth:`jaxpar.models.gpt.GPT.decode`): one block
over its layer's cache, annotated with logical axes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.logical import constrain
from jaxpar.models.transformer import (
    RESIDUAL,
    attention_out,
    layer_norm,
    mlp,
    qkv,
    rotary,
)

# ---- generation with a KV cache --------------------------------------------------------------
#: logical names of one layer's cache K[B, S, N, H]: batch and heads sharded as the
#: activations are; S (the cache positions) never, as each step writes one position
_CACHE = ("batch", None, "heads", "kv")


def cached_attention(
    h_BTD: jax.Array,
    p: dict[str, jax.Array],
    k_BSNH: jax.Array,
    v_BSNH: jax.Array,
    start: jax.Array,
    use_rotary: bool,
    precision: str = "default",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`attention` of T tokens at positions ``start`` … ``start+T-1`` over one
    layer's cache: their K and V are written into it at ``start``, and each query
    attends to every cached position up to its own. Returns the output [B, T, D] and
    the layer's updated K and V (``precision``: the projections', ``model.precision``)."""
    q, k, v = qkv(h_BTD, p, precision)
    pos_T = start + jnp.arange(q.shape[1])
    if use_rotary:
        q, k = rotary(q, pos_T), rotary(k, pos_T)
    k_BSNH = constrain(
        jax.lax.dynamic_update_slice_in_dim(k_BSNH, k.astype(k_BSNH.dtype), start, axis=1), _CACHE
    )
    v_BSNH = constrain(
        jax.lax.dynamic_update_slice_in_dim(v_BSNH, v.astype(v_BSNH.dtype), start, axis=1), _CACHE
    )
    mask_TS = jnp.arange(k_BSNH.shape[1])[None, :] <= pos_T[:, None]
    o_BTNH = jax.nn.dot_product_attention(
        q, k_BSNH, v_BSNH, mask=mask_TS[None, None], implementation="xla"
    )
    return attention_out(o_BTNH, p, precision), k_BSNH, v_BSNH


def decode_block(
    x_BTD: jax.Array,
    p: dict[str, jax.Array],
    k_BSNH: jax.Array,
    v_BSNH: jax.Array,
    start: jax.Array,
    use_rotary: bool,
    precision: str = "default",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`block` over one layer's KV cache (see :func:`cached_attention`)."""
    h = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    a_BTD, k_BSNH, v_BSNH = cached_attention(h, p, k_BSNH, v_BSNH, start, use_rotary, precision)
    x_BTD = constrain(x_BTD + a_BTD, RESIDUAL)
    h = layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"])
    return constrain(x_BTD + mlp(h, p, precision), RESIDUAL), k_BSNH, v_BSNH
