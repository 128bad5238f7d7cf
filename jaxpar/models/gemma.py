"""Gemma 2 and Gemma 3 text decoders in Flax NNX (``model.name=gemma``), annotated with
logical axes only: embeddings scaled by √D, (1 + w) RMSNorms before and after attention
and the MLP, a gated GELU (tanh) MLP, grouped-query attention scaled by
``query_pre_attn_scalar``^-½, sliding-window layers alternating with full ones (each kind
with its own rotary base), soft-capped attention and output logits where the config has
them, Gemma 3's per-head q/k norms, a tied output layer (or an untied one). The keys:
:mod:`jaxpar.models.gemma_config`; the arithmetic: :mod:`jaxpar.models.gemma_layers`;
Hugging Face interchange: ``jaxpar/hf/gemma.py``. Shape suffixes as in
:mod:`jaxpar.models.llama`. Packed documents (``data.pack=documents``): every layer,
windowed or full, soft-capped or not, attends within each document, rotary positions
restarting at each; loss masks weigh the targets as the GPT's and the Llama's do.

Parameters (logical axes): embed W[V, D] (vocab, embed); per layer, stacked on a leading
``layers`` dim: attn_norm, post_attn_norm, mlp_norm, post_mlp_norm [L, D] (layers, embed);
wq [L, D, N, H] (layers, embed, heads, kv); wk, wv [L, D, K, H] (layers, embed, kv_heads,
kv); wo [L, N, H, D]; with ``qk_norm`` q_norm, k_norm [L, H] (layers, kv); w_gate, w_up
[L, D, F] (layers, embed, mlp); w_down [L, F, D]; norm [D]; head [D, V] unless tied.
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
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain, gathered
from jaxpar.models import fp8, lm
from jaxpar.models import gemma_layers as layers
from jaxpar.models.family import Counts, Family, register
from jaxpar.models.gemma_config import GemmaConfig
from jaxpar.models.llama_attention import attention_params, cached_mask, out
from jaxpar.models.transformer import (
    REMAT_POLICIES,
    attention_implementation,
    const,
    enter_stream,
    param,
)
from jaxpar.task import DataNeeds, StageSplit, Task

__all__ = ["Gemma", "GemmaConfig", "gemma_loss"]

NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm")
PROJECTIONS = ("wq", "wk", "wv", "wo")
MLP = ("w_gate", "w_up", "w_down")


class GemmaBlocks(nnx.Module):
    """All blocks, parameters stacked on a leading ``layers`` dim; the norms' weights start
    at 0 (the (1 + w) form's identity)."""

    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        L, D, F, H = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.head_dim
        std, out_std = 0.02, 0.02 / (2 * L) ** 0.5
        attention = attention_params(cfg, rngs)
        for name in PROJECTIONS:
            setattr(self, name, attention[name])
        for name in NORMS[:4]:
            setattr(self, name, const(0.0, (L, D), ("layers", "embed")))
        if cfg.qk_norm:
            self.q_norm = const(0.0, (L, H), ("layers", "kv"))
            self.k_norm = const(0.0, (L, H), ("layers", "kv"))
        self.w_gate = param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_up = param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_down = param(rngs.params(), (L, F, D), ("layers", "mlp", "embed"), out_std)
        fp8.attach(self, cfg, (*PROJECTIONS, *MLP), (L,), ("layers",))

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (what the layer scan slices)."""
        names = (*NORMS, *PROJECTIONS, *MLP)
        return {
            **{n: getattr(self, n)[...] for n in names if hasattr(self, n)},
            **fp8.histories(self),
        }


class Gemma(nnx.Module):
    """Decoder-only LM: tokens [B, T] → logits [B, T, V] (float32)."""

    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attention_impl = attention_implementation(cfg)
        V, D = cfg.vocab_size, cfg.d_model
        self.embed = param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        self.blocks = GemmaBlocks(cfg, rngs=rngs)
        self.norm = const(0.0, (D,), ("embed",))
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
        pos = np.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
        return self.logits(self.run_blocks(self.embed_tokens(tokens_BT), pos, documents))

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """Token embeddings × √D [B, T, D], in the compute dtype (transformers casts the
        normalizer to the embeddings' dtype: in bfloat16 √3072 is 55.5)."""
        cfg = self.cfg
        if tokens_BT.shape[1] > cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {tokens_BT.shape[1]} exceeds model.max_seq_len="
                f"{cfg.max_seq_len}; raise it or lower data.seq_len"
            )
        dtype = jnp.dtype(cfg.dtype)
        x = tensor_parallel.lookup(self.embed[...], tokens_BT, ("vocab", "embed")).astype(dtype)
        return enter_stream(x * jnp.asarray(math.sqrt(cfg.d_model), dtype))

    def run_blocks(
        self, x_BTD: jax.Array, positions_T: np.ndarray, documents: lm.Documents | None = None
    ) -> jax.Array:
        """All blocks, in order (a pipeline chunk: its own; see :func:`_stage`); packed
        ``documents``: attention and rotary positions within each."""
        cfg = self.cfg
        dtype = x_BTD.dtype

        def step(x, p, kind):
            attention = lambda h, p: layers.self_attention(  # noqa: E731
                h, p, kind, positions_T, cfg, self.attention_impl, documents
            )
            p = layers.in_compute_dtype(p, dtype)
            return layers.block(x, p, attention, cfg.norm_eps, cfg.precision), None

        policy = REMAT_POLICIES[cfg.remat] if cfg.remat != "none" else False
        return layers.over_layers(x_BTD, self.blocks.stacked(), cfg.pattern, step, policy)[0]

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final norm and output layer: float32 logits [B, T, V], soft-capped where the
        config caps them."""
        cfg = self.cfg
        h = layers.norm(x_BTD, self.norm[...], cfg.norm_eps)
        head = (
            constrain(self.embed[...], ("vocab", None)).T
            if cfg.tie_embeddings
            else gathered(self.head[...], ("embed", "vocab"))
        )
        logits = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype)).astype(jnp.float32)
        if cfg.final_softcap:
            logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return constrain(logits, ("batch", "seq", "vocab"))

    # ---- generation with a KV cache (jaxpar sample) ---------------------------------------
    def init_cache(self, batch: int) -> dict[str, jax.Array]:
        """An empty KV cache: K and V [L, B, S, K, H] in the compute dtype (a windowed
        layer's too: its mask, not its cache, keeps to the window)."""
        return lm.kv_cache(self.cfg, batch, self.cfg.n_kv_heads)

    def decode(
        self, tokens_BT: jax.Array, cache: dict[str, jax.Array], start: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits [B, T, V] of T tokens at positions ``start`` … ``start+T-1`` over a cache
        holding the positions before; returns them and the cache with the new positions."""
        cfg = self.cfg
        x = self.embed_tokens(tokens_BT)
        pos = start + jnp.arange(tokens_BT.shape[1])
        names = ("batch", None, "kv_heads", "kv")

        def step(x, layer, kind):
            p = layers.in_compute_dtype(layer["p"], x.dtype)
            caches = []

            def attention(h, p):
                q, k, v = layers.projections(h, p, pos, kind, cfg.precision)
                k_cache, v_cache = (
                    constrain(
                        jax.lax.dynamic_update_slice_in_dim(
                            layer[n], new.astype(layer[n].dtype), start, axis=1
                        ),
                        names,
                    )
                    for n, new in (("k", k), ("v", v))
                )
                caches.append((k_cache, v_cache))
                mask = cached_mask(k_cache.shape[1], pos, kind.window)
                o = layers.cached_attention(q, k_cache, v_cache, mask, cfg)
                return out(o, p, cfg.precision)

            return layers.block(x, p, attention, cfg.norm_eps, cfg.precision), caches[0]

        stacked = {"p": self.blocks.stacked(), "k": cache["k"], "v": cache["v"]}
        x, (k, v) = layers.over_layers(x, stacked, cfg.pattern, step)
        return self.logits(x), {"k": k, "v": v}


# ---- the loss, cut into pipeline stages -----------------------------------------------------
def gemma_loss(model: Gemma, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1] (its packed documents
    and loss weights, where the batch has them)."""
    inputs, targets, pos_T = lm.lm_sequence(batch)
    return lm.next_token_loss(
        model(inputs, pos_T, lm.lm_documents(batch, pos_T)), targets, lm.lm_weights(batch, pos_T)
    )


def _embed(model: Gemma, batch: Any) -> jax.Array:
    return model.embed_tokens(lm.lm_sequence(batch)[0])


def _stage(model: Gemma, x: jax.Array, batch: Any, first: Any) -> jax.Array:
    """The chunk's blocks. A chunk whose layer count the local/global pattern divides
    starts on the pattern's first layer (chunks are equal), so its kinds are static."""
    cfg = model.cfg
    n = model.blocks.wq.shape[0]
    m = len(cfg.pattern)
    if n % m:
        raise ConfigError(
            f"mesh.stage: each pipeline chunk holds {n} of the "
            f"{cfg.n_layers} layers, not a multiple of the {m}-layer "
            "local/global attention pattern (model.sliding_window_pattern); "
            "pick mesh.stage and pipeline.virtual_stages that make it one"
        )
    pos_T = lm.lm_sequence(batch)[2]
    return model.run_blocks(x, pos_T, lm.lm_documents(batch, pos_T))


def _head(model: Gemma, x: jax.Array, batch: Any) -> tuple[jax.Array, dict]:
    _, targets, pos_T = lm.lm_sequence(batch)
    return lm.next_token_loss(model.logits(x), targets, lm.lm_weights(batch, pos_T))


STAGES = StageSplit("blocks", _embed, _stage, _head)


# ---- the family ------------------------------------------------------------------------------
def task(cfg: GemmaConfig, seq_len: int, documents: bool = False, loss_mask: bool = False) -> Task:
    """The Gemma's task: next-token prediction on windows of ``seq_len + 1`` tokens (with
    ``documents``, their packed documents attending each within itself, windowed layers
    too; with ``loss_mask``, only the targets it marks counting)."""
    lm.refuse_init_from(cfg)
    return Task(
        lambda rngs: Gemma(cfg, rngs=rngs),
        gemma_loss,
        lm.lm_batch_axes(documents, loss_mask),
        tokens_per_example=seq_len,
        name="gemma",
        context_parallel=True,
        stages=STAGES,
    )


def gemma_counts(cfg: GemmaConfig, seq_len: int) -> tuple[int, float]:
    """Parameters and training FLOPs per example: every matmul, attention's two [T, T]
    products included (the windowed layers' too: the masked scores are computed); the
    backward twice the forward, no gradient into the lookup."""
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
    norms = 4 * D + (2 * H if cfg.qk_norm else 0)
    params = V * D + L * (norms + attention + 3 * D * F) + D + (0 if cfg.tie_embeddings else D * V)
    macs = L * (attention + 2 * T * N * H + 3 * D * F) + D * V
    return params, 2 * 3 * T * macs


GEMMA_FAMILY = register(
    Family(
        "gemma",
        GemmaConfig,
        lambda cfg, data: task(
            dataclasses.replace(cfg, init_from=""),
            data.seq_len,
            lm.packs_documents(data),
            lm.masks_loss(data),
        ),
        lambda cfg: DataNeeds("text", vocab_size=cfg.vocab_size, documents=True, loss_mask=True),
        counts=lambda cfg, data: Counts(*gemma_counts(cfg, data.seq_len)),
        memory_fixes=lambda cfg: [] if cfg.remat == "full" else ["model.remat=full"],
        compute_dtype=lambda cfg: cfg.dtype,
        doc="Gemma 2/3 text decoder: scaled embeddings, (1 + w) pre/post norms, GeGLU, "
        "alternating local/global attention, soft-capping",
    )
)
