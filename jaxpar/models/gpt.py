"""GPT-style decoder LM in Flax NNX, annotated with logical axes only.

Shape suffixes: B batch, T sequence, D embed (d_model), N heads, H head dim,
F mlp (d_ff), V vocab, L layers. Layers are stacked along a leading ``layers``
dim and run with ``jax.lax.scan``, so compile time does not grow with depth.

Parameters (logical axes):
  embed W[V, D] (vocab, embed); pos W[T, D] (seq, embed) when learned;
  per layer: ln scales/biases [L, D], wq/wk/wv [L, D, N, H] (layers, embed,
  heads, kv), wo [L, N, H, D], w_in [L, D, F] (layers, embed, mlp), b_in [L, F],
  w_out [L, F, D], b_out [L, D]; final norm [D]; head [D, V] unless tied; with
  ``attn_bias`` also bq/bk/bv [L, N·H] (layers, heads; head-major, kept vectors so they
  are not decayed) and bo [L, D] (layers, embed), as GPT-2 has them (see ``jaxpar/hf.py``).

Attention runs through ``jax.nn.dot_product_attention``: cuDNN's fused kernel on a
GPU (no [B, N, T, T] logits in memory, the masked half skipped), XLA's einsum +
softmax elsewhere (see :func:`attention_implementation`).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from pydantic import Field

from jaxpar.errors import ConfigError
from jaxpar.logical import constrain, shards
from jaxpar.models.family import (
    Counts,
    Dtype,
    Family,
    LabLayout,
    LabModel,
    ModelConfig,
    Term,
    register,
)
from jaxpar.schema import section
from jaxpar.task import DataNeeds, StageSplit, Task

_RESIDUAL = ("batch", "seq", "act_embed")


#: ``model.attention`` values; ``auto`` resolves per backend (:func:`attention_implementation`).
Attention = Literal["auto", "xla", "cudnn"]
#: ``model.remat`` values: what a block recomputes in the backward pass (:data:`REMAT_POLICIES`)
Remat = Literal["none", "full", "save_dots"]


@section("model")
class GPTConfig(ModelConfig):
    """``model.*`` keys of ``model.name=gpt``: shape and numerics."""

    vocab_size: int = Field(256, ge=1, description="vocabulary (at least the data's)")
    d_model: int = Field(128, ge=1, description="width D")
    n_layers: int = Field(4, ge=1, description="transformer blocks L")
    n_heads: int = Field(4, ge=1, description="attention heads N (divides d_model)")
    d_ff: int = Field(512, ge=1, description="MLP width F")
    max_seq_len: int = Field(128, ge=1, description="longest sequence")
    positions: Literal["learned", "rotary"] = Field("learned", description="position encoding")
    tie_embeddings: bool = Field(False, description="the output layer is the embedding "
                                                    "table's transpose")
    remat: Remat = Field("none", description="what each block recomputes in the backward pass")
    dtype: Dtype = Field("float32", description="compute dtype (parameters stay float32)")
    attention: Attention = Field("auto", description="jax.nn.dot_product_attention's "
                                 "implementation (auto: cuDNN on a GPU where it runs, XLA "
                                 "elsewhere)")
    attn_bias: bool = Field(False, description="biases on the q/k/v and output projections "
                                               "(GPT-2 has them)")
    init_from: str = Field("", description="a Hugging Face GPT-2 directory (config.json + "
                                           "model.safetensors) whose weights a fresh run "
                                           "starts from (jaxpar/hf.py)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...], scale: float) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(key, shape, jnp.float32), out_sharding=axes)


def _const(value: float, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), out_sharding=axes)


class Blocks(nnx.Module):
    """All transformer blocks, parameters stacked on a leading ``layers`` dim."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        L, D, N, H, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
        std, out_std = 0.02, 0.02 / (2 * L) ** 0.5  # GPT-2: scale residual projections
        self.ln1_scale = _const(1.0, (L, D), ("layers", "embed"))
        self.ln1_bias = _const(0.0, (L, D), ("layers", "embed"))
        self.wq = _param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wk = _param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wv = _param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wo = _param(rngs.params(), (L, N, H, D), ("layers", "heads", "kv", "embed"), out_std)
        self.ln2_scale = _const(1.0, (L, D), ("layers", "embed"))
        self.ln2_bias = _const(0.0, (L, D), ("layers", "embed"))
        self.w_in = _param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std)
        self.b_in = _const(0.0, (L, F), ("layers", "mlp"))
        self.w_out = _param(rngs.params(), (L, F, D), ("layers", "mlp", "embed"), out_std)
        self.b_out = _const(0.0, (L, D), ("layers", "embed"))
        if getattr(cfg, "attn_bias", False):  # BERT's config shares these blocks
            self.bq = _const(0.0, (L, N * H), ("layers", "heads"))
            self.bk = _const(0.0, (L, N * H), ("layers", "heads"))
            self.bv = _const(0.0, (L, N * H), ("layers", "heads"))
            self.bo = _const(0.0, (L, D), ("layers", "embed"))

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (what the layer scan slices)."""
        names = ("ln1_scale", "ln1_bias", "wq", "wk", "wv", "wo",
                 "ln2_scale", "ln2_bias", "w_in", "b_in", "w_out", "b_out")
        names += ("bq", "bk", "bv", "bo") if hasattr(self, "bq") else ()
        return {n: getattr(self, n)[...] for n in names}


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm computed in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias
    return y.astype(x.dtype)


def rotary(x_BTNH: jax.Array, positions_T: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (half-split form) over the head dim, at ``positions_T``
    (default 0 … T-1; a KV-cache step passes its own)."""
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, H // 2, dtype=jnp.float32) / (H // 2)))
    pos_T = jnp.arange(T) if positions_T is None else positions_T
    angle_TK = pos_T.astype(jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle_TK)[None, :, None, :], jnp.cos(angle_TK)[None, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x_BTNH.dtype)


#: What cuDNN's flash attention takes (jax's ``check_is_flash_attention``): 16-bit inputs and
#: a head dim that is a multiple of 8, at most 128 (256 from Hopper on; ``auto`` keeps to 128).
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128


def _default_backend() -> str:
    """``jax.default_backend()``, except that a ROCm GPU (no cuDNN) reads ``rocm``."""
    backend = jax.default_backend()
    if backend == "gpu" and "rocm" in jax.devices()[0].client.platform_version.lower():
        return "rocm"
    return backend


def attention_implementation(cfg: GPTConfig, backend: str | None = None) -> str:
    """The ``jax.nn.dot_product_attention`` implementation (``xla`` or ``cudnn``) that
    ``cfg.attention`` means on ``backend`` (default: JAX's default backend).

    ``auto`` is ``cudnn`` on a GPU when the compute dtype and head dim suit cuDNN's fused
    kernel, else ``xla``; ``xla`` and ``cudnn`` are taken as they are.

    Raises:
      ConfigError: for ``cudnn`` where it cannot run (no CUDA GPU, float32 compute, an
        unsupported head dim), with the fix.
    """
    backend = backend or _default_backend()
    H = cfg.head_dim
    fits = cfg.dtype in _CUDNN_DTYPES and H % 8 == 0 and H <= _CUDNN_MAX_HEAD_DIM
    if cfg.attention == "auto":
        return "cudnn" if backend == "gpu" and fits else "xla"
    if cfg.attention == "cudnn":
        if backend != "gpu":
            raise ConfigError(
                f"model.attention=cudnn needs an NVIDIA GPU (cuDNN); JAX's backend here is "
                f"{backend}: use model.attention=auto (cuDNN where it runs, XLA elsewhere) "
                "or model.attention=xla")
        if cfg.dtype not in _CUDNN_DTYPES:
            raise ConfigError(
                f"model.attention=cudnn needs bfloat16 compute, got model.dtype={cfg.dtype}: "
                "set model.dtype=bfloat16, or use model.attention=auto or xla")
        if H % 8:
            raise ConfigError(
                f"model.attention=cudnn needs a head dim that is a multiple of 8; "
                f"model.d_model/model.n_heads = {H}: change them, or use model.attention=xla")
    return cfg.attention


def attention(h_BTD: jax.Array, p: dict[str, jax.Array], use_rotary: bool,
              implementation: str = "xla", causal: bool = True) -> jax.Array:
    """Causal multi-head self-attention through ``jax.nn.dot_product_attention``.

    ``implementation`` is ``xla`` (logits and softmax in float32, [B, N, T, T] in memory)
    or ``cudnn`` (the fused kernel; 16-bit inputs, float32 accumulation inside).
    """
    q, k, v = _qkv(h_BTD, p)
    if use_rotary:
        q, k = rotary(q), rotary(k)
    o_BTNH = jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                          implementation=implementation)
    return _attention_out(o_BTNH, p)


def _qkv(h_BTD: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """q, k, v [B, T, N, H] of the attention input (with ``model.attn_bias``'s biases)."""
    # One projection for q, k and v: under tensor parallelism the backward pass then sums
    # the three input gradients before its one all-reduce (Megatron's count), instead of
    # all-reducing three partial sums.
    w_D3NH = jnp.stack([p["wq"], p["wk"], p["wv"]], axis=1)
    qkv = jnp.einsum("btd,dcnh->btcnh", h_BTD, w_D3NH)
    if "bq" in p:  # model.attn_bias
        qkv = qkv + jnp.stack([p["bq"], p["bk"], p["bv"]]).reshape(w_D3NH.shape[1:])
    qkv = constrain(qkv, ("batch", "seq", None, "heads", "kv"))
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _attention_out(o_BTNH: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """The output projection [B, T, D] of the heads' outputs."""
    o_BTNH = constrain(o_BTNH, ("batch", "seq", "heads", "kv"))
    out_BTD = jnp.einsum("btnh,nhd->btd", o_BTNH, p["wo"])
    return out_BTD + p["bo"] if "bo" in p else out_BTD


def mlp(h_BTD: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Two-layer GELU MLP: column-parallel in, row-parallel out under TP rules."""
    u_BTF = jnp.einsum("btd,df->btf", h_BTD, p["w_in"]) + p["b_in"]
    u_BTF = constrain(jax.nn.gelu(u_BTF), ("batch", "seq", "mlp"))
    return jnp.einsum("btf,fd->btd", u_BTF, p["w_out"]) + p["b_out"]


def block(x_BTD: jax.Array, p: dict[str, jax.Array], use_rotary: bool,
          implementation: str = "xla") -> jax.Array:
    """One pre-norm transformer block (``implementation``: see :func:`attention`)."""
    h = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    x_BTD = constrain(x_BTD + attention(h, p, use_rotary, implementation), _RESIDUAL)
    h = layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"])
    return constrain(x_BTD + mlp(h, p), _RESIDUAL)


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
}


class GPT(nnx.Module):
    """Decoder-only transformer LM: tokens [B, T] → logits [B, T, V] (float32)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        if cfg.d_model % cfg.n_heads:
            raise ConfigError(
                f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}"
            )
        if cfg.positions == "rotary" and cfg.head_dim % 2:
            raise ConfigError(
                f"rotary positions need an even head dim; d_model/n_heads = {cfg.head_dim}: "
                "change model.d_model or model.n_heads, or use model.positions=learned"
            )
        self.cfg = cfg
        self.attention_impl = attention_implementation(cfg)
        V, D = cfg.vocab_size, cfg.d_model
        self.embed = _param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        if cfg.positions == "learned":
            self.pos = _param(rngs.params(), (cfg.max_seq_len, D), ("seq", "embed"), 0.01)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.ln_f_scale = _const(1.0, (D,), ("embed",))
        self.ln_f_bias = _const(0.0, (D,), ("embed",))
        if not cfg.tie_embeddings:
            self.head = _param(rngs.params(), (D, V), ("embed", "vocab"), 0.02)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        """Logits [B, T, V] (float32) of tokens [B, T].

        A tied table is read once for the lookup and the head, as one gathered copy per
        batch shard, W[G, V, D] with G over the ``batch`` axes (each device holds one copy,
        as it holds one gathered table anyway): its two gradient contributions then add
        up on each device and are reduced once. Read twice, the partitioner would reduce
        each where it is computed: one table-sized all-reduce more per step.
        """
        tables_GVD = self._tables_per_batch_shard() if self.cfg.tie_embeddings else None
        return self.logits(self.run_blocks(self.embed_tokens(tokens_BT, tables_GVD)),
                           tables_GVD)

    def _tables_per_batch_shard(self) -> jax.Array:
        table_VD = self.table()
        tables_GVD = jnp.broadcast_to(table_VD[None], (shards("batch"), *table_VD.shape))
        return constrain(tables_GVD, ("batch", None, None))

    def embed_tokens(self, tokens_BT: jax.Array, tables_GVD: jax.Array | None = None
                     ) -> jax.Array:
        """Token (+ learned position) embeddings [B, T, D] in the compute dtype; rows of
        ``tables_GVD`` (one table per batch shard, see ``__call__``) when given."""
        cfg = self.cfg
        T = tokens_BT.shape[1]
        if T > cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {T} exceeds model.max_seq_len={cfg.max_seq_len}; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        if tables_GVD is None:
            x_BTD = jnp.take(self.table(), tokens_BT, axis=0)
        else:
            B, G = tokens_BT.shape[0], tables_GVD.shape[0]
            take = jax.vmap(lambda table_VD, ids: jnp.take(table_VD, ids, axis=0))
            x_BTD = take(tables_GVD, tokens_BT.reshape(G, B // G, T)).reshape(B, T, -1)
        if cfg.positions == "learned":
            x_BTD = x_BTD + self.pos[:T][None]
        return constrain(x_BTD.astype(jnp.dtype(cfg.dtype)), _RESIDUAL)

    def table(self) -> jax.Array:
        """The whole embedding table W[V, D], gathered over every mesh axis.

        Tokens are looked up in the whole table (FSDP gathers weights before use anyway):
        from a sharded table the partitioner cannot move the rows to the batch layout and
        falls back to replicating the gathered activations. A tied table is gathered in
        two steps, through the head's layout (:meth:`_tied_head_table`), so that the lookup and
        the head share one gather of its ``embed`` dim.
        """
        table_VD = self._tied_head_table() if self.cfg.tie_embeddings else self.embed[...]
        return constrain(table_VD, (None, None))

    def _tied_head_table(self) -> jax.Array:
        """A tied table in the head's layout, W[V_vocab, D]: its ``embed`` dim gathered
        (FSDP), ``vocab`` as the rules shard it (tensor parallelism: the logits' vocab
        dim). The same constraint on the same parameter in :meth:`table`, which XLA's
        CSE folds into one all-gather instead of one for the lookup and one for the head.
        """
        return constrain(self.embed[...], ("vocab", None))

    def logits(self, x_BTD: jax.Array, tables_GVD: jax.Array | None = None) -> jax.Array:
        """Final norm and output projection: [B, T, D] → float32 logits [B, T, V]; through
        ``tables_GVD`` (a tied table per batch shard, see ``__call__``) when given."""
        h = layer_norm(x_BTD, self.ln_f_scale[...], self.ln_f_bias[...])
        if tables_GVD is not None:
            (B, T, D), G = h.shape, tables_GVD.shape[0]
            logits = jnp.einsum("gbtd,gvd->gbtv", h.reshape(G, B // G, T, D),
                                tables_GVD.astype(h.dtype)).reshape(B, T, -1)
        else:
            head_DV = self._tied_head_table().T if self.cfg.tie_embeddings else self.head[...]
            logits = jnp.einsum("btd,dv->btv", h, head_DV.astype(x_BTD.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def run_blocks(self, x_BTD: jax.Array) -> jax.Array:
        """All blocks of ``self.blocks`` (however many are stacked there), in order."""
        dtype, use_rotary = x_BTD.dtype, self.cfg.positions == "rotary"

        def body(x, p):
            p = jax.tree.map(lambda a: a.astype(dtype), p)
            return block(x, p, use_rotary, self.attention_impl), None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        x_BTD, _ = jax.lax.scan(body, x_BTD, self.blocks.stacked())
        return x_BTD

    # ---- generation with a KV cache (jaxpar sample) ---------------------------------------
    def init_cache(self, batch: int) -> dict[str, jax.Array]:
        """An empty KV cache for ``batch`` sequences (see :func:`init_cache`)."""
        return init_cache(self.cfg, batch)

    def decode(self, tokens_BT: jax.Array, cache: dict[str, jax.Array], start: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits [B, T, V] (float32) of T tokens at positions ``start`` … ``start+T-1``,
        given a cache that holds positions ``< start``; returns them and the cache with
        the new positions written. One call with the prompt (``start`` 0) fills the cache,
        then one call per generated token (T = 1). The logits equal the last T rows of
        ``self(all tokens so far)``.
        """
        cfg, T = self.cfg, tokens_BT.shape[1]
        x_BTD = jnp.take(self.table(), tokens_BT, axis=0)
        if cfg.positions == "learned":
            x_BTD = x_BTD + jax.lax.dynamic_slice_in_dim(self.pos[...], start, T)[None]
        x_BTD = constrain(x_BTD.astype(jnp.dtype(cfg.dtype)), _RESIDUAL)
        use_rotary = cfg.positions == "rotary"

        def body(x, layer):
            p, k, v = layer
            p = jax.tree.map(lambda a: a.astype(x.dtype), p)
            x, k, v = decode_block(x, p, k, v, start, use_rotary)
            return x, (k, v)

        x_BTD, (k, v) = jax.lax.scan(body, x_BTD, (self.blocks.stacked(), cache["k"],
                                                    cache["v"]))
        return self.logits(x_BTD), {"k": k, "v": v}


# ---- generation with a KV cache --------------------------------------------------------------
#: logical names of one layer's cache K[B, S, N, H]: batch and heads sharded as the
#: activations are; S (the cache positions) never, as each step writes one position
_CACHE = ("batch", None, "heads", "kv")


def init_cache(cfg: GPTConfig, batch: int) -> dict[str, jax.Array]:
    """An empty KV cache: K and V [L, B, S, N, H] in the compute dtype, S = max_seq_len."""
    shape = (cfg.n_layers, batch, cfg.max_seq_len, cfg.n_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return {"k": zeros, "v": zeros}


def cached_attention(h_BTD: jax.Array, p: dict[str, jax.Array], k_BSNH: jax.Array,
                     v_BSNH: jax.Array, start: jax.Array, use_rotary: bool
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`attention` of T tokens at positions ``start`` … ``start+T-1`` over one
    layer's cache: their K and V are written into it at ``start``, and each query
    attends to every cached position up to its own. Returns the output [B, T, D] and
    the layer's updated K and V."""
    q, k, v = _qkv(h_BTD, p)
    pos_T = start + jnp.arange(q.shape[1])
    if use_rotary:
        q, k = rotary(q, pos_T), rotary(k, pos_T)
    k_BSNH = constrain(jax.lax.dynamic_update_slice_in_dim(
        k_BSNH, k.astype(k_BSNH.dtype), start, axis=1), _CACHE)
    v_BSNH = constrain(jax.lax.dynamic_update_slice_in_dim(
        v_BSNH, v.astype(v_BSNH.dtype), start, axis=1), _CACHE)
    mask_TS = jnp.arange(k_BSNH.shape[1])[None, :] <= pos_T[:, None]
    o_BTNH = jax.nn.dot_product_attention(q, k_BSNH, v_BSNH, mask=mask_TS[None, None],
                                          implementation="xla")
    return _attention_out(o_BTNH, p), k_BSNH, v_BSNH


def decode_block(x_BTD: jax.Array, p: dict[str, jax.Array], k_BSNH: jax.Array,
                 v_BSNH: jax.Array, start: jax.Array, use_rotary: bool
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`block` over one layer's KV cache (see :func:`cached_attention`)."""
    h = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    a_BTD, k_BSNH, v_BSNH = cached_attention(h, p, k_BSNH, v_BSNH, start, use_rotary)
    x_BTD = constrain(x_BTD + a_BTD, _RESIDUAL)
    h = layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"])
    return constrain(x_BTD + mlp(h, p), _RESIDUAL), k_BSNH, v_BSNH


# ---- the loss, cut into pipeline stages -----------------------------------------------------
def _lm_embed(model: GPT, batch: Any) -> jax.Array:
    return model.embed_tokens(batch["tokens"][:, :-1])


def _lm_head(model: GPT, x: jax.Array, batch: Any) -> tuple[jax.Array, dict]:
    return _loss_of_logits(model.logits(x), batch)


def lm_loss(model: GPT, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1].

    The whole model in one call (not embed, blocks, head one by one as a pipeline stage
    runs them): a tied table is then read once by the lookup and the head, and its
    gradient reduced once (see ``GPT.__call__``).
    """
    return _loss_of_logits(model(batch["tokens"][:, :-1]), batch)


def _loss_of_logits(logits: jax.Array, batch: Any) -> tuple[jax.Array, dict]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
    return loss, {}


#: The GPT cut into pipeline stages: embedding first, the stacked blocks split, head and loss
#: last.
STAGES = StageSplit("blocks", _lm_embed, lambda model, x, batch, first: model.run_blocks(x),
                    _lm_head)


# ---- what the layout lab knows of a transformer (shared with jaxpar/models/bert.py) ----------
def transformer_counts(cfg: Any, seq_len: int, head: bool = True) -> tuple[int, float]:
    """Parameters and training FLOPs per example of the stacked blocks, the token embedding,
    the final norm and (``head``) an untied output layer: every matmul, attention's two
    [T, T] products included (XLA computes the masked half too); the backward pass twice
    the forward, except that no gradient flows into the token lookup."""
    L, D, F, V, T = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size, seq_len
    per_layer = 4 * D + 4 * D * D + 2 * D * F + F + D  # norms, q/k/v/o, MLP
    params = V * D + L * per_layer + 2 * D
    macs = L * (4 * D * D + 2 * D * F + 2 * T * D) + D * V  # per token, forward
    if head and not getattr(cfg, "tie_embeddings", False):
        params += D * V
    return params, 2 * 3 * T * macs


def transformer_tensor_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """Megatron's activation all-reduces: per layer two of ``[b, T, D]`` forward (attention
    and MLP outputs) and two backward (their inputs), one more for the head's input
    gradient; the cross-entropy over vocab-sharded logits all-reduces three ``[b, T]``
    statistics; a vocab-sharded embedding table is gathered."""
    t = layout.sizes["tensor"]
    if t == 1:
        return []
    rows, seq, d = layout.rows, layout.seq_len, cfg.d_model
    activation = rows * seq * d * (4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize)
    # Without a pipeline: once per microbatch over all layers. In a pipeline every tick
    # counts as its costliest branch, the last stage's backward: its layers' recomputed
    # forward and backward plus the head, and the embedding of the first stage.
    k = layout.grad_accum
    if layout.stages is not None:
        ticks, p, v, m = layout.stages
        times, layers, div = ticks * k, cfg.n_layers // (p * v), m * k
    else:
        times, layers, div = k, cfg.n_layers, k
    terms = [Term("all-reduce", "Megatron activation all-reduces", activation / div, t,
                  times * (4 * layers + 1)),
             Term("all-reduce", "cross-entropy statistics", rows * seq * 4 / div, t, 3 * times)]
    if "tensor" in layout.rules.get("vocab", ()):
        # loop-invariant: XLA gathers the table once for all microbatches
        terms.append(Term("all-gather", "embedding table gather", cfg.vocab_size * d * 4,
                          t, times if layout.stages is not None else 1))
    return terms


class TransformerLab(LabModel):
    """What the lab knows of jaxpar's transformers (GPT and BERT)."""

    whole_params = frozenset({"embed"})  # tokens are looked up in the whole table

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_tensor_terms(cfg, layout)


# ---- the family ------------------------------------------------------------------------------
def task(cfg: GPTConfig, seq_len: int) -> Task:
    """The GPT's task: next-token prediction on windows of ``seq_len + 1`` tokens
    (``model.init_from``'s weights are wired in by :func:`jaxpar.run.build`)."""
    return Task(lambda rngs: GPT(cfg, rngs=rngs), lm_loss, {"tokens": ("batch", None)},
                tokens_per_example=seq_len, stages=STAGES, name="gpt")


def _needs(cfg: GPTConfig) -> DataNeeds:
    return DataNeeds("text", vocab_size=cfg.vocab_size)


def _counts(cfg: GPTConfig, data: Any) -> Counts:
    params, flops = transformer_counts(cfg, data.seq_len)
    if cfg.positions == "learned":
        params += cfg.max_seq_len * cfg.d_model
    if cfg.attn_bias:
        params += cfg.n_layers * 4 * cfg.d_model
    return Counts(params, flops)


GPT_FAMILY = register(Family(
    "gpt", GPTConfig, lambda cfg, data: task(cfg, data.seq_len), _needs, counts=_counts,
    lab=TransformerLab(),
    memory_fixes=lambda cfg: [] if cfg.remat == "full" else ["model.remat=full"],
    compute_dtype=lambda cfg: cfg.dtype,
    doc="decoder-only transformer LM; pipelines (stacked layers)"))
