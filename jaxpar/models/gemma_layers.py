"""The Gemma block's pieces, written as transformers' ``modeling_gemma2.py`` /
``modeling_gemma3.py`` compute them: (1 + w) RMSNorm in float32, attention scaled by
``query_pre_attn_scalar``^-½ with optional logit soft-capping, the gated GELU (tanh) MLP,
and the runner that scans the layers in groups of the local/global pattern.

Shape suffixes: B batch, T queries, S keys, N heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxpar.context import attend, masks_by_position
from jaxpar.logical import constrain
from jaxpar.models.fp8 import history
from jaxpar.models.gemma_config import GemmaConfig, LayerKind
from jaxpar.models.llama_attention import out, qkv
from jaxpar.models.lm import Documents
from jaxpar.models.transformer import MLP_DOWN, MLP_IN, MLP_OUT, MLP_UP, RESIDUAL, project, rms_norm
from jaxpar.ring_attention import visible

#: Parameters cast to the compute dtype; the norms' weights stay float32, as
#: transformers computes (1 + w) in float32 whatever the weights' dtype.
MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x / rms(x) · (1 + w), in float32, returned in ``x``'s dtype."""
    return rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


def in_compute_dtype(p: dict[str, jax.Array], dtype: Any) -> dict[str, jax.Array]:
    return {n: a.astype(dtype) if n in MATMULS else a for n, a in p.items()}


def gated_gelu(h: jax.Array, p: dict[str, jax.Array], precision: str = "default") -> jax.Array:
    """``down(gelu_tanh(gate(h)) · up(h))``: column-parallel in, row-parallel out; the
    projections in ``precision`` (``model.precision``)."""
    gate, up = (
        checkpoint_name(project("btd,df->btf", h, p[n], MLP_UP, precision, history(p, n)), MLP_IN)
        for n in ("w_gate", "w_up")
    )
    u = constrain(jax.nn.gelu(gate, approximate=True) * up, ("batch", "seq", "mlp"))
    down = project("btf,fd->btd", u, p["w_down"], MLP_DOWN, precision, history(p, "w_down"))
    return checkpoint_name(down, MLP_OUT)


def capped_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float, cap: float
) -> jax.Array:
    """Attention with soft-capped logits (cap · tanh(s / cap), then the mask, then a
    float32 softmax), written out: ``jax.nn.dot_product_attention`` has no cap. Plain
    jnp, so under context parallelism XLA partitions it like any other op."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))  # transformers' repeat_kv
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask, jnp.tanh(s / cap) * cap, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", w, v)


def projections(
    h: jax.Array,
    p: dict[str, jax.Array],
    pos: jax.Array,
    kind: LayerKind,
    precision: str = "default",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v [B, T, N|K, H] as the Llama's (:func:`qkv`, in ``precision``), its q/k
    norms in (1 + w) form."""
    if "q_norm" in p:
        p = {**p, **{n: 1.0 + p[n].astype(jnp.float32) for n in ("q_norm", "k_norm")}}
    return qkv(h, p, pos, kind, precision)


def self_attention(
    h: jax.Array,
    p: dict[str, jax.Array],
    kind: LayerKind,
    positions_T: np.ndarray,
    cfg: GemmaConfig,
    implementation: str,
    documents: Documents | None = None,
) -> jax.Array:
    """One layer's attention over the sequence (its tokens at ``positions_T``); packed
    ``documents``: each query sees its own document only (the window counted within
    it), rotated to its position within it."""
    pos = jnp.asarray(positions_T)
    rotated = pos if documents is None else documents.positions
    segments = None if documents is None else documents.segments
    q, k, v = projections(h, p, rotated, kind, cfg.precision)
    if cfg.attn_softcap:
        masks_by_position()  # right on a split sequence: the mask comes from positions
        o = capped_attention(
            q,
            k,
            v,
            visible(pos, pos, True, kind.window, segments, segments),
            cfg.scale,
            cfg.attn_softcap,
        )
    else:  # attend scales by H^-½: the queries carry the rest of Gemma's scale
        factor = cfg.scale * math.sqrt(cfg.head_dim)
        q = q if factor == 1.0 else q * jnp.asarray(factor, q.dtype)
        o = attend(
            q,
            k,
            v,
            positions_T,
            causal=True,
            window=kind.window,
            implementation=implementation,
            segments=segments,
        )
    return out(o, p, cfg.precision)


def cached_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: GemmaConfig
) -> jax.Array:
    """New queries over a KV cache's keys and values (``mask``: the slots each sees)."""
    if cfg.attn_softcap:
        return capped_attention(q, k, v, mask, cfg.scale, cfg.attn_softcap)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=cfg.scale, implementation="xla")


def block(
    x: jax.Array,
    p: dict[str, jax.Array],
    attention: Callable,
    eps: float,
    precision: str = "default",
) -> jax.Array:
    """One Gemma block: norms before and after attention and after the MLP (its
    projections in ``precision``)."""
    a = norm(attention(norm(x, p["attn_norm"], eps), p), p["post_attn_norm"], eps)
    x = constrain(x + a, RESIDUAL)
    m = norm(gated_gelu(norm(x, p["mlp_norm"], eps), p, precision), p["post_mlp_norm"], eps)
    return constrain(x + m, RESIDUAL)


# ---- the layers, in groups of the pattern ----------------------------------------------------
Step = Callable[[jax.Array, Any, LayerKind], tuple[jax.Array, Any]]


def over_layers(
    x: jax.Array, layers: Any, pattern: tuple[LayerKind, ...], step: Step, policy: Any = False
) -> tuple[jax.Array, Any]:
    """``step(x, layer, kind)`` for every layer of ``layers`` (a tree of [n, …] arrays),
    in order; layer j is of kind ``pattern[j % m]``. The window and rotary base must be
    static in each call, so a ``jax.lax.scan`` runs groups of m = len(pattern) layers, and
    inside a group each run of layers of one kind is a scan of its own (Gemma 3: five
    windowed layers, then a full one); the n mod m layers after the last whole group run
    the same way (Gemma 3 1B: 26 layers, pattern 6). Scans rather than unrolled layers:
    XLA keeps unrolled layers' activations alive together in the backward pass
    (docs/checkpoints.md, Gemma). ``policy``: a ``jax.checkpoint`` policy
    for each layer (None: recompute everything; False: no remat). Returns x and each
    layer's output stacked [n, …]."""
    m = len(pattern)
    n = jax.tree.leaves(layers)[0].shape[0]
    groups, rest = divmod(n, m)

    def run(x, chunk, kinds):
        outs = []
        start = 0
        for kind, count in _runs(kinds):
            one = lambda x, layer, kind=kind: step(x, layer, kind)  # noqa: E731
            one = one if policy is False else jax.checkpoint(one, policy=policy)
            part = jax.tree.map(lambda a, s=start, c=count: a[s : s + c], chunk)
            x, o = jax.lax.scan(one, x, part)
            outs.append(o)
            start += count
        return x, jax.tree.map(lambda *o: jnp.concatenate(o), *outs)

    parts = []
    if groups:
        head = jax.tree.map(lambda a: a[: groups * m].reshape(groups, m, *a.shape[1:]), layers)
        x, ys = jax.lax.scan(lambda x, chunk: run(x, chunk, pattern), x, head)
        parts.append(jax.tree.map(lambda a: a.reshape(groups * m, *a.shape[2:]), ys))
    if rest:
        x, ys = run(x, jax.tree.map(lambda a: a[groups * m :], layers), pattern[:rest])
        parts.append(ys)
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _runs(kinds: tuple[LayerKind, ...]) -> list[tuple[LayerKind, int]]:
    """Consecutive layers of one kind: (kind, how many)."""
    out: list[tuple[LayerKind, int]] = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + 1)
        else:
            out.append((kind, 1))
    return out
