"""The Llama family's attention projections, with the variants' switches
(:mod:`jaxpar.models.llama_config`): q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3),
scaled rotary frequencies (Llama 3.1), an explicit head dim.

Parameters per layer (logical axes; stacked on a leading ``layers`` dim): wq [D, N, H]
(embed, heads, kv); wk, wv [D, K, H] (embed, kv_heads, kv); wo [N, H, D]; with
``qkv_bias`` bq [N, H], bk, bv [K, H]; with ``qk_norm`` q_norm, k_norm [H] (kv).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.logical import constrain
from jaxpar.models import fp8
from jaxpar.models.rope import inv_frequencies
from jaxpar.models.transformer import (
    ATTN_OUT,
    CONTEXT,
    QKV,
    const,
    param,
    project,
    rms_norm,
    rotary,
)

#: Every attention parameter a layer may have (a model holds those its switches ask for).
ATTENTION = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "bq", "bk", "bv", "q_norm", "k_norm")


def attention_params(cfg: Any, rngs: nnx.Rngs) -> dict[str, nnx.Param]:
    """A fresh model's attention parameters, stacked over the ``cfg.n_layers`` layers."""
    L, D, N, K, H = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    std, out_std = 0.02, 0.02 / (2 * L) ** 0.5
    out = {
        "attn_norm": const(1.0, (L, D), ("layers", "embed")),
        "wq": param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std),
        "wk": param(rngs.params(), (L, D, K, H), ("layers", "embed", "kv_heads", "kv"), std),
        "wv": param(rngs.params(), (L, D, K, H), ("layers", "embed", "kv_heads", "kv"), std),
        "wo": param(rngs.params(), (L, N, H, D), ("layers", "heads", "kv", "embed"), out_std),
        "mlp_norm": const(1.0, (L, D), ("layers", "embed")),
    }
    if cfg.qkv_bias:
        out |= {
            "bq": const(0.0, (L, N, H), ("layers", "heads", "kv")),
            "bk": const(0.0, (L, K, H), ("layers", "kv_heads", "kv")),
            "bv": const(0.0, (L, K, H), ("layers", "kv_heads", "kv")),
        }
    if cfg.qk_norm:
        out |= {
            "q_norm": const(1.0, (L, H), ("layers", "kv")),
            "k_norm": const(1.0, (L, H), ("layers", "kv")),
        }
    return out


def rotary_frequencies(cfg: Any) -> np.ndarray:
    """The model's rotary inverse frequencies (its base and scaling)."""
    return inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


#: the logical names of a query projection's weight [D, N, H]
Q_WEIGHT = ("embed", "heads", "kv")
#: the logical names of a key or value projection's weight [D, K, H]
KV_WEIGHT = ("embed", "kv_heads", "kv")


def qkv(
    h_BTD: jax.Array,
    p: dict[str, jax.Array],
    pos_T: jax.Array,
    cfg: Any,
    precision: str = "default",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's queries, keys and values [B, T, N|K, H]: projected (plus biases) in
    ``precision`` (``model.precision``), normalized per head, rotated to positions
    ``pos_T``."""
    q = project("btd,dnh->btnh", h_BTD, p["wq"], Q_WEIGHT, precision, fp8.history(p, "wq"))
    k = project("btd,dkh->btkh", h_BTD, p["wk"], KV_WEIGHT, precision, fp8.history(p, "wk"))
    v = project("btd,dkh->btkh", h_BTD, p["wv"], KV_WEIGHT, precision, fp8.history(p, "wv"))
    if "bq" in p:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = checkpoint_name(constrain(q, ("batch", "seq", "heads", "kv")), QKV)
    k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "kv")), QKV)
    v = checkpoint_name(constrain(v, ("batch", "seq", "kv_heads", "kv")), QKV)
    if "q_norm" in p:
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    freq = rotary_frequencies(cfg)
    return rotary(q, pos_T, inv_freq=freq), rotary(k, pos_T, inv_freq=freq), v


def out(o_BTNH: jax.Array, p: dict[str, jax.Array], precision: str = "default") -> jax.Array:
    """The output projection back to [B, T, D] (in ``precision``)."""
    o_BTNH = checkpoint_name(constrain(o_BTNH, ("batch", "seq", "heads", "kv")), CONTEXT)
    names = ("heads", "kv", "embed")
    o_BTD = project("btnh,nhd->btd", o_BTNH, p["wo"], names, precision, fp8.history(p, "wo"))
    return checkpoint_name(o_BTD, ATTN_OUT)


def cached_mask(cache_len: int, pos_T: jax.Array, window: int) -> jax.Array:
    """[1, 1, T, S] True where a new token at ``pos_T`` sees cache slot s: the causal
    past, the last ``window`` positions of it when ``window`` > 0."""
    slots = jnp.arange(cache_len)[None, :]
    seen = slots <= pos_T[:, None]
    if window:
        seen = seen & (slots > pos_T[:, None] - window)
    return seen[None, None]
