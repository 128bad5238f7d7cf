"""A Llama-style decoder LM in Flax NNX (``model.name=llama``), annotated with logical axes
only: RMSNorm, a SwiGLU MLP, rotary positions with base ``rope_theta``, grouped-query
attention (``n_kv_heads`` key/value heads shared by groups of ``n_heads / n_kv_heads``
query heads), no biases, an untied (or tied) output layer; bfloat16 compute over float32
parameters when ``model.dtype=bfloat16``. Hugging Face interchange: ``jaxpar/hf/llama.py``.

Shape suffixes: B batch, T sequence, D embed, N heads, K key/value heads, H head dim,
F mlp, V vocab, L layers. The blocks are stacked on a leading ``layers`` dim and scanned.

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, model_validator

from jaxpar.context import attend
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain
from jaxpar.models.family import (
    Counts,
    Dtype,
    Family,
    LabLayout,
    ModelConfig,
    Term,
    register,
)
from jaxpar.models.transformer import (
    REMAT_POLICIES,
    RESIDUAL,
    Attention,
    Remat,
    TransformerLab,
    attention_implementation,
    check_heads,
    const,
    kv_cache,
    lm_sequence,
    next_token_loss,
    param,
    refuse_init_from,
    rotary,
    transformer_tensor_terms,
)
from jaxpar.schema import Float, section
from jaxpar.task import DataNeeds, StageSplit, Task


@section("model")
class LlamaConfig(ModelConfig):
    """``model.*`` keys of ``model.name=llama``: shape and numerics."""

    vocab_size: int = Field(256, ge=1, description="vocabulary (at least the data's)")
    d_model: int = Field(128, ge=1, description="width D")
    n_layers: int = Field(4, ge=1, description="transformer blocks L")
    n_heads: int = Field(4, ge=1, description="query heads N (divides d_model)")
    n_kv_heads: int = Field(2, ge=1, description="key/value heads K (divides n_heads; "
                                                 "n_heads: multi-head attention)")
    d_ff: int = Field(344, ge=1, description="SwiGLU MLP width F")
    max_seq_len: int = Field(128, ge=1, description="longest sequence (the KV cache)")
    rope_theta: Float = Field(10000.0, gt=0, description="rotary base (Llama 3: 500000)")
    norm_eps: Float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="the output layer is the token "
                                                    "table's transpose")
    remat: Remat = Field("none", description="what each block recomputes in the backward pass")
    dtype: Dtype = Field("float32", description="compute dtype (parameters stay float32)")
    attention: Attention = Field("auto", description="jax.nn.dot_product_attention's "
                                 "implementation (auto: cuDNN on a GPU where it runs, XLA "
                                 "elsewhere)")
    init_from: str = Field("", description="a Hugging Face Llama directory (config.json + "
                                           "model.safetensors) a fresh run starts from")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @model_validator(mode="after")
    def _heads(self) -> LlamaConfig:
        check_heads(self, rotary=True)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads="
                f"{self.n_heads}: each key/value head serves a group of query heads; pick a "
                "divisor of n_heads")
        return self


class LlamaBlocks(nnx.Module):
    """All blocks, parameters stacked on a leading ``layers`` dim."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        L, D, N, K, H, F = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                            cfg.head_dim, cfg.d_ff)
        std, out_std = 0.02, 0.02 / (2 * L) ** 0.5
        self.attn_norm = const(1.0, (L, D), ("layers", "embed"))
        self.wq = param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wk = param(rngs.params(), (L, D, K, H), ("layers", "embed", "kv_heads", "kv"), std)
        self.wv = param(rngs.params(), (L, D, K, H), ("layers", "embed", "kv_heads", "kv"), std)
        self.wo = param(rngs.params(), (L, N, H, D), ("layers", "heads", "kv", "embed"), out_std)
        self.mlp_norm = const(1.0, (L, D), ("layers", "embed"))
        self.w_gate = param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_up = param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_down = param(rngs.params(), (L, F, D), ("layers", "mlp", "embed"), out_std)

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (what the layer scan slices)."""
        names = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
        return {n: getattr(self, n)[...] for n in names}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def _qkv(h: jax.Array, p: dict[str, jax.Array], pos: jax.Array, theta: float
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = constrain(jnp.einsum("btd,dnh->btnh", h, p["wq"]), ("batch", "seq", "heads", "kv"))
    k = constrain(jnp.einsum("btd,dkh->btkh", h, p["wk"]), ("batch", "seq", "kv_heads", "kv"))
    v = constrain(jnp.einsum("btd,dkh->btkh", h, p["wv"]), ("batch", "seq", "kv_heads", "kv"))
    return rotary(q, pos, theta), rotary(k, pos, theta), v


def _out(o_BTNH: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    o_BTNH = constrain(o_BTNH, ("batch", "seq", "heads", "kv"))
    return jnp.einsum("btnh,nhd->btd", o_BTNH, p["wo"])


def swiglu(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """``down(silu(gate(h)) · up(h))``: column-parallel in, row-parallel out under TP."""
    gate = jnp.einsum("btd,df->btf", h, p["w_gate"])
    up = jnp.einsum("btd,df->btf", h, p["w_up"])
    u = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    return jnp.einsum("btf,fd->btd", u, p["w_down"])


def block(x: jax.Array, p: dict[str, jax.Array], cfg: LlamaConfig, implementation: str,
          positions_T: np.ndarray) -> jax.Array:
    """One pre-norm block: grouped-query attention (across the context axis when the layout
    splits the sequence) and the SwiGLU MLP."""
    h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
    q, k, v = _qkv(h, p, jnp.asarray(positions_T), cfg.rope_theta)
    o = attend(q, k, v, positions_T, causal=True, implementation=implementation)
    x = constrain(x + _out(o, p), RESIDUAL)
    return constrain(x + swiglu(rms_norm(x, p["mlp_norm"], cfg.norm_eps), p), RESIDUAL)


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

    def __call__(self, tokens_BT: jax.Array, positions_T: np.ndarray | None = None
                 ) -> jax.Array:
        """Logits [B, T, V] of tokens at ``positions_T`` (0 … T-1 when None)."""
        pos = np.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
        return self.logits(self.run_blocks(self.embed_tokens(tokens_BT), pos))

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype (looked up in the whole table)."""
        if tokens_BT.shape[1] > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {tokens_BT.shape[1]} exceeds model.max_seq_len="
                              f"{self.cfg.max_seq_len}; raise it or lower data.seq_len")
        x = jnp.take(constrain(self.embed[...], (None, None)), tokens_BT, axis=0)
        return constrain(x.astype(jnp.dtype(self.cfg.dtype)), RESIDUAL)

    def run_blocks(self, x_BTD: jax.Array, positions_T: np.ndarray) -> jax.Array:
        """All blocks stacked in ``self.blocks``, in order."""
        cfg, dtype = self.cfg, x_BTD.dtype

        def body(x, p):
            p = jax.tree.map(lambda a: a.astype(dtype), p)
            return block(x, p, cfg, self.attention_impl, positions_T), None

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat])
        return jax.lax.scan(body, x_BTD, self.blocks.stacked())[0]

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final RMSNorm and output layer: float32 logits [B, T, V]."""
        h = rms_norm(x_BTD, self.norm[...], self.cfg.norm_eps)
        head = (constrain(self.embed[...], ("vocab", None)).T if self.cfg.tie_embeddings
                else self.head[...])
        logits = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    # ---- generation with a KV cache (jaxpar sample) ---------------------------------------
    def init_cache(self, batch: int) -> dict[str, jax.Array]:
        """An empty KV cache: K and V [L, B, S, K, H] in the compute dtype."""
        return kv_cache(self.cfg, batch, self.cfg.n_kv_heads)

    def decode(self, tokens_BT: jax.Array, cache: dict[str, jax.Array], start: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits [B, T, V] of T tokens at positions ``start`` … ``start+T-1`` over a cache
        holding the positions before; returns them and the cache with the new positions."""
        cfg = self.cfg
        x = constrain(jnp.take(self.embed[...], tokens_BT, axis=0).astype(
            jnp.dtype(cfg.dtype)), RESIDUAL)
        pos = start + jnp.arange(tokens_BT.shape[1])
        names = ("batch", None, "kv_heads", "kv")

        def body(x, layer):
            p, k_cache, v_cache = layer
            p = jax.tree.map(lambda a: a.astype(x.dtype), p)
            h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
            q, k, v = _qkv(h, p, pos, cfg.rope_theta)
            write = lambda c, new: constrain(jax.lax.dynamic_update_slice_in_dim(
                c, new.astype(c.dtype), start, axis=1), names)
            k_cache, v_cache = write(k_cache, k), write(v_cache, v)
            mask = jnp.arange(k_cache.shape[1])[None, :] <= pos[:, None]
            o = jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[None, None],
                                             implementation="xla")
            x = constrain(x + _out(o, p), RESIDUAL)
            x = constrain(x + swiglu(rms_norm(x, p["mlp_norm"], cfg.norm_eps), p), RESIDUAL)
            return x, (k_cache, v_cache)

        x, (k, v) = jax.lax.scan(body, x, (self.blocks.stacked(), cache["k"], cache["v"]))
        return self.logits(x), {"k": k, "v": v}


# ---- the loss, cut into pipeline stages -----------------------------------------------------
def llama_loss(model: Llama, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1]."""
    inputs, targets, pos_T = lm_sequence(batch)
    return next_token_loss(model(inputs, pos_T), targets)


def _embed(model: Llama, batch: Any) -> jax.Array:
    return model.embed_tokens(lm_sequence(batch)[0])


def _stage(model: Llama, x: jax.Array, batch: Any, first: Any) -> jax.Array:
    return model.run_blocks(x, lm_sequence(batch)[2])


def _head(model: Llama, x: jax.Array, batch: Any) -> tuple[jax.Array, dict]:
    return next_token_loss(model.logits(x), lm_sequence(batch)[1])


STAGES = StageSplit("blocks", _embed, _stage, _head)


# ---- the family ------------------------------------------------------------------------------
def task(cfg: LlamaConfig, seq_len: int) -> Task:
    """The Llama's task: next-token prediction on windows of ``seq_len + 1`` tokens."""
    refuse_init_from(cfg)
    return Task(lambda rngs: Llama(cfg, rngs=rngs), llama_loss, {"tokens": ("batch", None)},
                tokens_per_example=seq_len, stages=STAGES, name="llama", context_parallel=True)


def llama_counts(cfg: LlamaConfig, seq_len: int) -> tuple[int, float]:
    """Parameters and training FLOPs per example: every matmul, attention's two [T, T]
    products included; the backward twice the forward, no gradient into the lookup."""
    L, D, N, K, H, F, V, T = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                              cfg.head_dim, cfg.d_ff, cfg.vocab_size, seq_len)
    per_layer = 2 * D + 2 * D * N * H + 2 * D * K * H + 3 * D * F
    params = V * D + L * per_layer + D + (0 if cfg.tie_embeddings else D * V)
    macs = L * (2 * D * N * H + 2 * D * K * H + 3 * D * F + 2 * T * N * H) + D * V
    return params, 2 * 3 * T * macs


def _counts(cfg: LlamaConfig, data: Any) -> Counts:
    return Counts(*llama_counts(cfg, data.seq_len))


class LlamaLab(TransformerLab):
    """The lab's Llama: its q, k and v projections (different head counts: not stacked)
    and SwiGLU's gate and up matmuls each give the backward pass an input gradient that XLA
    all-reduces apart under tensor parallelism — 5 per layer (measured), not 2; 4 where the
    key/value heads are not split (more tensor devices than key/value heads: there XLA also
    gathers some of their activations, and the step measures 0.96× this prediction)."""

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        split_kv = layout.rules.get("kv_heads", ()) == layout.rules.get("heads", ())
        return transformer_tensor_terms(cfg, layout, 5 if split_kv else 4)


LLAMA_FAMILY = register(Family(
    "llama", LlamaConfig,
    lambda cfg, data: task(dataclasses.replace(cfg, init_from=""), data.seq_len),
    lambda cfg: DataNeeds("text", vocab_size=cfg.vocab_size),
    counts=_counts,
    lab=LlamaLab(),
    memory_fixes=lambda cfg: [] if cfg.remat == "full" else ["model.remat=full"],
    compute_dtype=lambda cfg: cfg.dtype,
    doc="Llama-style decoder LM: RMSNorm, SwiGLU, rotary, grouped-query attention"))

