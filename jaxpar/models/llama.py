"""A Llama-style decoder LM in Flax NNX (``model.name=llama``), annotated with logical axes
only: RMSNorm, a SwiGLU MLP, rotary positions with base ``rope_theta``, grouped-query
attention (``n_kv_heads`` key/value heads shared by groups of ``n_heads / n_kv_heads``
query heads), no biases, an untied (or tied) output layer; bfloat16 compute over float32
parameters when ``model.dtype=bfloat16``. Hugging Face interchange: ``jaxpar/hf/llama.py``.
With ``model.n_experts`` > 0 every ``moe_every``-th MLP is a mixture of experts (router
[G, D, E], e_gate, e_up [G, E, D, F], e_down [G, E, F, D], G = L / moe_every; layers scanned
in groups of moe_every; a pipeline stage adds its share of the routers' losses).
Shape suffixes: B batch, T sequence, D embed, N heads, K key/value heads, H head dim, F
mlp, V vocab, L layers (stacked on a leading ``layers`` dim and scanned).

Parameters (logical axes):
  embed W[V, D] (vocab, embed); per layer: attn_norm, mlp_norm [L, D] (layers, embed);
  wq [L, D, N, H] (layers, embed, heads, kv); wk, wv [L, D, K, H] (layers, embed,
  kv_heads, kv); wo [L, N, H, D]; w_gate, w_up [L, D, F] (layers, embed, mlp); w_down
  [L, F, D]; norm [D]; head [D, V] (embed, vocab) unless tied. ``kv_heads`` is split over
  ``tensor`` where the tensor degree divides K, and held whole on every device of the
  tensor group where it does not (a warning says so: ``jaxpar/sharding.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import tensor_parallel
from jaxpar.context import attend
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain, gathered
from jaxpar.models import fp8, lm, moe
from jaxpar.models.family import Counts, Family, register
from jaxpar.models.llama_attention import (
    ATTENTION,
    attention_params,
    cached_mask,
    out,
    qkv,
)
from jaxpar.models.llama_config import LlamaConfig
from jaxpar.models.transformer import (
    REMAT_POLICIES,
    RESIDUAL,
    attention_implementation,
    const,
    enter_stream,
    param,
    rms_norm,
)
from jaxpar.task import DataNeeds, StageSplit, Task

__all__ = ["Llama", "LlamaConfig", "llama_loss"]


class LlamaBlocks(nnx.Module):
    """All blocks, parameters stacked on a leading ``layers`` dim."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
        std, out_std = 0.02, 0.02 / (2 * L) ** 0.5
        for name, value in attention_params(cfg, rngs).items():
            setattr(self, name, value)
        # dense MLPs [L, …]; in a mixture-of-experts model the groups' first moe_every − 1
        # layers' [G, moe_every − 1, …], and each group's experts [G, E, …]
        G, E, S = L // cfg.group, cfg.n_experts, cfg.n_shared_experts
        dense = (L,) if not E else (G, cfg.moe_every - 1)
        lead = ("layers",) if not E else ("layers", None)
        if math.prod(dense):
            self.w_gate = param(rngs.params(), (*dense, D, F), (*lead, "embed", "mlp"), std)
            self.w_up = param(rngs.params(), (*dense, D, F), (*lead, "embed", "mlp"), std)
            self.w_down = param(rngs.params(), (*dense, F, D), (*lead, "mlp", "embed"), out_std)
        if E:
            self.router = param(rngs.params(), (G, D, E), ("layers", "embed", None), std)
            experts = ("layers", "experts")
            self.e_gate = param(rngs.params(), (G, E, D, F), (*experts, "embed", "mlp"), std)
            self.e_up = param(rngs.params(), (G, E, D, F), (*experts, "embed", "mlp"), std)
            self.e_down = param(rngs.params(), (G, E, F, D), (*experts, "mlp", "embed"), out_std)
        if E and S:
            self.s_gate = param(rngs.params(), (G, D, S * F), ("layers", "embed", "mlp"), std)
            self.s_up = param(rngs.params(), (G, D, S * F), ("layers", "embed", "mlp"), std)
            self.s_down = param(rngs.params(), (G, S * F, D), ("layers", "mlp", "embed"), out_std)
        fp8.attach(self, cfg, ("wq", "wk", "wv", "wo"), (L,), ("layers",))
        fp8.attach(self, cfg, DENSE if math.prod(dense) else (), dense, lead)
        fp8.attach(self, cfg, SHARED if E and S else (), (G,), ("layers",))

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (what the layer scan slices)."""
        names = (*ATTENTION, *DENSE, *EXPERTS, *SHARED)
        return {
            **{n: getattr(self, n)[...] for n in names if hasattr(self, n)},
            **fp8.histories(self),
        }


DENSE = ("w_gate", "w_up", "w_down")
EXPERTS = ("router", "e_gate", "e_up", "e_down")
SHARED = ("s_gate", "s_up", "s_down")


def grouped(stacked: dict[str, jax.Array], cfg: LlamaConfig) -> dict[str, jax.Array]:
    """The stacked parameters by group of ``cfg.group`` layers: [L, …] → [G, group, …]."""
    m = cfg.group
    per_layer = (*ATTENTION, *(() if cfg.n_experts else DENSE))
    return {
        n: a.reshape(a.shape[0] // m, m, *a.shape[1:])
        if n.removeprefix(fp8.PREFIX) in per_layer
        else a
        for n, a in stacked.items()
    }


def _named(p: dict[str, jax.Array], names: tuple[str, ...], j: Any = None, to: Any = None):
    """Parameters ``names`` of ``p`` (layer ``j`` of each where given) with their FP8
    histories, renamed ``to`` where given."""
    to = to or names
    out = {}
    for old, new in zip(names, to, strict=True):
        for prefix in ("", fp8.PREFIX):
            if prefix + old in p:
                a = p[prefix + old]
                out[prefix + new] = a if j is None else a[j]
    return out


def layer_group(
    x: jax.Array, p: dict[str, jax.Array], cfg: LlamaConfig, attention: Any, positions_T: Any = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One group's pre-norm blocks: ``attention(h, layer params, j)`` then the SwiGLU MLP,
    the last block's a mixture of experts in an MoE model (its router statistics
    returned)."""
    m = p["wq"].shape[0]
    stats = {}
    for j in range(m):
        pj = _named(p, ATTENTION, j)
        x = constrain(x + attention(rms_norm(x, pj["attn_norm"], cfg.norm_eps), pj, j), RESIDUAL)
        h = rms_norm(x, pj["mlp_norm"], cfg.norm_eps)
        if cfg.n_experts and j == m - 1:
            experts = dict(zip(("router", *DENSE), (p[n] for n in EXPERTS)))
            y, stats = moe.moe_mlp(
                h, experts, cfg.top_k, cfg.capacity_factor, positions_T, cfg.moe_dispatch
            )
            if cfg.n_shared_experts:
                y = y + moe.swiglu(h, _named(p, SHARED, to=DENSE), cfg.precision)
        else:
            y = moe.swiglu(h, _named(p, DENSE, j), cfg.precision)
        x = constrain(x + y, RESIDUAL)
    return x, stats


class Llama(nnx.Module):
    """Decoder-only LM: tokens [B, T] → logits [B, T, V] (float32)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attention_impl = attention_implementation(cfg)
        V, D = cfg.vocab_size, cfg.d_model
        self.embed = param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        self.blocks = LlamaBlocks(cfg, rngs=rngs)
        self.norm = const(1.0, (D,), ("embed",))
        if not cfg.tie_embeddings:
            self.head = param(rngs.params(), (D, V), ("embed", "vocab"), 0.02)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_T: np.ndarray | None = None,
        documents: lm.Documents | None = None,
    ) -> jax.Array:
        """Logits [B, T, V] of tokens at ``positions_T`` (0 … T-1 when None), packed as
        ``documents`` (:func:`~jaxpar.models.lm.lm_documents`) when given."""
        return self.forward(tokens_BT, positions_T, documents)[0]

    def forward(
        self,
        tokens_BT: jax.Array,
        positions_T: np.ndarray | None = None,
        documents: lm.Documents | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits and the routers' statistics (empty for a dense model): the load-balancing
        and z-losses averaged over the MoE layers, the dropped assignments summed, each
        expert's share of the assignments averaged."""
        pos = np.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
        x, stats = self.blocks_and_stats(self.embed_tokens(tokens_BT), pos, documents)
        return self.logits(x), stats

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype (:func:`tensor_parallel.lookup`)."""
        if tokens_BT.shape[1] > self.cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {tokens_BT.shape[1]} exceeds model.max_seq_len="
                f"{self.cfg.max_seq_len}; raise it or lower data.seq_len"
            )
        x = tensor_parallel.lookup(self.embed[...], tokens_BT, ("vocab", "embed"))
        return enter_stream(x.astype(jnp.dtype(self.cfg.dtype)))

    def run_blocks(
        self, x_BTD: jax.Array, positions_T: np.ndarray, documents: lm.Documents | None = None
    ) -> jax.Array:
        return self.blocks_and_stats(x_BTD, positions_T, documents)[0]

    def blocks_and_stats(
        self, x_BTD: jax.Array, positions_T: np.ndarray, documents: lm.Documents | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """All blocks, in order, and the routers' statistics (see :meth:`forward`); packed
        ``documents``: rotary positions within each, attention within each."""
        cfg = self.cfg
        dtype = x_BTD.dtype
        pos = jnp.asarray(positions_T)
        rotated = pos if documents is None else documents.positions
        segments = None if documents is None else documents.segments

        def attention(h, p, j):
            q, k, v = qkv(h, p, rotated, cfg, cfg.precision)
            return out(
                attend(
                    q,
                    k,
                    v,
                    positions_T,
                    causal=True,
                    window=cfg.sliding_window,
                    implementation=self.attention_impl,
                    segments=segments,
                ),
                p,
                cfg.precision,
            )

        def body(x, p):
            return layer_group(x, moe.in_compute_dtype(p, dtype), cfg, attention, positions_T)

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat])
        x, stats = jax.lax.scan(body, x_BTD, grouped(self.blocks.stacked(), cfg))
        return x, moe.over_layers(stats)

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final RMSNorm and output layer: float32 logits [B, T, V]."""
        h = rms_norm(x_BTD, self.norm[...], self.cfg.norm_eps)
        head = (
            constrain(self.embed[...], ("vocab", None)).T
            if self.cfg.tie_embeddings
            else gathered(self.head[...], ("embed", "vocab"))
        )
        logits = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    # ---- generation with a KV cache (jaxpar sample) ---------------------------------------
    def init_cache(self, batch: int) -> dict[str, jax.Array]:
        """An empty KV cache: K and V [L, B, S, K, H] in the compute dtype."""
        return lm.kv_cache(self.cfg, batch, self.cfg.n_kv_heads)

    def decode(
        self, tokens_BT: jax.Array, cache: dict[str, jax.Array], start: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits [B, T, V] of T tokens at positions ``start`` … ``start+T-1`` over a cache
        holding the positions before; returns them and the cache with the new positions."""
        cfg = self.cfg
        x = constrain(
            jnp.take(self.embed[...], tokens_BT, axis=0).astype(jnp.dtype(cfg.dtype)), RESIDUAL
        )
        pos = start + jnp.arange(tokens_BT.shape[1])
        names = ("batch", None, "kv_heads", "kv")

        def body(x, layer):
            p, k_group, v_group = layer
            caches = []

            def attention(h, pj, j):
                q, k, v = qkv(h, pj, pos, cfg, cfg.precision)
                write = lambda c, new: constrain(
                    jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=1),
                    names,
                )
                k_cache, v_cache = write(k_group[j], k), write(v_group[j], v)
                caches.append((k_cache, v_cache))
                mask = cached_mask(k_cache.shape[1], pos, cfg.sliding_window)
                return out(
                    jax.nn.dot_product_attention(
                        q, k_cache, v_cache, mask=mask, implementation="xla"
                    ),
                    pj,
                    cfg.precision,
                )

            x, _ = layer_group(x, moe.in_compute_dtype(p, x.dtype), cfg, attention)
            return x, tuple(jnp.stack(c) for c in zip(*caches))

        m = cfg.group
        by_group = lambda c: c.reshape(c.shape[0] // m, m, *c.shape[1:])  # noqa: E731
        x, (k, v) = jax.lax.scan(
            body,
            x,
            (grouped(self.blocks.stacked(), cfg), by_group(cache["k"]), by_group(cache["v"])),
        )
        k, v = (c.reshape(-1, *c.shape[2:]) for c in (k, v))
        return self.logits(x), {"k": k, "v": v}


# ---- the loss, cut into pipeline stages -----------------------------------------------------
def llama_loss(model: Llama, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1]; with experts, plus the
    weighted load-balancing and z-losses, each reported as a metric with the dropped
    assignments and each expert's load (``moe_load_<e>``)."""
    inputs, targets, pos_T = lm.lm_sequence(batch)
    logits, stats = model.forward(inputs, pos_T, lm.lm_documents(batch, pos_T))
    loss, metrics = lm.next_token_loss(logits, targets, lm.lm_weights(batch, pos_T))
    if not stats:
        return loss, metrics
    cfg = model.cfg
    extra, moe_metrics = moe.loss_terms(stats, 1.0, cfg.aux_loss_coef, cfg.z_loss_coef)
    return loss + extra, {"ce": loss, **moe_metrics}


def _embed(model: Llama, batch: Any) -> jax.Array:
    return model.embed_tokens(lm.lm_sequence(batch)[0])


def _stage(model: Llama, x: jax.Array, batch: Any, first: Any) -> Any:
    """The chunk's blocks; with experts, also its share of the routers' terms."""
    pos_T = lm.lm_sequence(batch)[2]
    x, stats = model.blocks_and_stats(x, pos_T, lm.lm_documents(batch, pos_T))
    if not stats:
        return x
    cfg = model.cfg
    groups = model.blocks.router.shape[0]  # the chunk's MoE layers
    return x, moe.loss_terms(
        stats, groups * cfg.group / cfg.n_layers, cfg.aux_loss_coef, cfg.z_loss_coef
    )


def _head(model: Llama, x: jax.Array, batch: Any) -> tuple[jax.Array, dict]:
    _, targets, pos_T = lm.lm_sequence(batch)
    loss, metrics = lm.next_token_loss(model.logits(x), targets, lm.lm_weights(batch, pos_T))
    return loss, ({"ce": loss} if model.cfg.n_experts else metrics)


STAGES = StageSplit("blocks", _embed, _stage, _head)


# ---- the family ------------------------------------------------------------------------------
def task(cfg: LlamaConfig, seq_len: int, documents: bool = False, loss_mask: bool = False) -> Task:
    """The Llama's task: next-token prediction on windows of ``seq_len + 1`` tokens (with
    ``documents``, their packed documents attending each within itself; with
    ``loss_mask``, only the targets it marks counting)."""
    lm.refuse_init_from(cfg)
    return Task(
        lambda rngs: Llama(cfg, rngs=rngs),
        llama_loss,
        lm.lm_batch_axes(documents, loss_mask),
        tokens_per_example=seq_len,
        name="llama",
        context_parallel=True,
        stages=STAGES,
    )


def llama_counts(cfg: LlamaConfig, seq_len: int) -> tuple[int, float]:
    """Parameters and training FLOPs per example: every matmul, attention's two [T, T]
    products included; the backward twice the forward, no gradient into the lookup."""
    L, D, N, K, H, F, V, T = (
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
        seq_len,
    )
    attention = 2 * D * N * H + 2 * D * K * H
    # the variants' per-layer vectors: q/k/v biases (Qwen2), q/k norms (Qwen3)
    extra = (N * H + 2 * K * H) * cfg.qkv_bias + 2 * H * cfg.qk_norm
    mlp_params, mlp_macs = moe.mlp_counts(
        L, D, F, cfg.n_experts and L // cfg.group, cfg.n_experts, cfg.top_k, cfg.n_shared_experts
    )
    params = (
        V * D
        + L * (2 * D + attention + extra)
        + mlp_params
        + D
        + (0 if cfg.tie_embeddings else D * V)
    )
    macs = L * (attention + 2 * T * N * H) + mlp_macs + D * V
    return params, 2 * 3 * T * macs


LLAMA_FAMILY = register(
    Family(
        "llama",
        LlamaConfig,
        lambda cfg, data: task(
            dataclasses.replace(cfg, init_from=""),
            data.seq_len,
            lm.packs_documents(data),
            lm.masks_loss(data),
        ),
        lambda cfg: DataNeeds("text", vocab_size=cfg.vocab_size, documents=True, loss_mask=True),
        counts=lambda cfg, data: Counts(*llama_counts(cfg, data.seq_len)),
        memory_fixes=lambda cfg: [] if cfg.remat == "full" else ["model.remat=full"],
        compute_dtype=lambda cfg: cfg.dtype,
        doc="Llama-style decoder LM: RMSNorm, SwiGLU, rotary, grouped-query attention",
    )
)
