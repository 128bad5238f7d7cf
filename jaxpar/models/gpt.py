"""GPT-style decoder LM in Flax NNX, annotated with logical axes only.

Shape suffixes: B batch, T sequence, D embed (d_model), N heads, H head dim,
F mlp (d_ff), V vocab, L layers. Layers are stacked along a leading ``layers``
dim and run with ``jax.lax.scan``, so compile time does not grow with depth.

Parameters (logical axes):
  embed W[V, D] (vocab, embed); pos W[T, D] (seq, embed) when learned;
  per layer: ln scales/biases [L, D], wq/wk/wv [L, D, N, H] (layers, embed,
  heads, kv), wo [L, N, H, D], w_in [L, D, F] (layers, embed, mlp), b_in [L, F],
  w_out [L, F, D], b_out [L, D]; final norm [D]; head [D, V] unless tied.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.logical import constrain

_RESIDUAL = ("batch", "seq", "act_embed")


@dataclass(frozen=True)
class GPTConfig:
    """GPT shape and numerics; see ``jaxpar.config.ModelConfig`` for meanings."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    max_seq_len: int = 128
    positions: str = "learned"
    tie_embeddings: bool = False
    remat: str = "none"
    dtype: str = "float32"

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

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (what the layer scan slices)."""
        names = ("ln1_scale", "ln1_bias", "wq", "wk", "wv", "wo",
                 "ln2_scale", "ln2_bias", "w_in", "b_in", "w_out", "b_out")
        return {n: getattr(self, n)[...] for n in names}


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm computed in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias
    return y.astype(x.dtype)


def rotary(x_BTNH: jax.Array) -> jax.Array:
    """Rotary position embedding (half-split form) over the head dim."""
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, H // 2, dtype=jnp.float32) / (H // 2)))
    angle_TK = jnp.arange(T, dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle_TK)[None, :, None, :], jnp.cos(angle_TK)[None, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x_BTNH.dtype)


def attention(h_BTD: jax.Array, p: dict[str, jax.Array], use_rotary: bool) -> jax.Array:
    """Causal multi-head self-attention; softmax in float32."""
    # One projection for q, k and v: under tensor parallelism the backward pass then sums
    # the three input gradients before its one all-reduce (Megatron's count), instead of
    # all-reducing three partial sums.
    w_D3NH = jnp.stack([p["wq"], p["wk"], p["wv"]], axis=1)
    qkv = constrain(jnp.einsum("btd,dcnh->btcnh", h_BTD, w_D3NH),
                    ("batch", "seq", None, "heads", "kv"))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if use_rotary:
        q, k = rotary(q), rotary(k)
    T, H = q.shape[1], q.shape[-1]
    logits_BNTS = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) / jnp.sqrt(H)
    causal = jnp.tril(jnp.ones((T, T), bool))
    logits_BNTS = jnp.where(causal, logits_BNTS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BNTS, axis=-1).astype(v.dtype)
    o_BTNH = constrain(jnp.einsum("bnts,bsnh->btnh", probs, v), ("batch", "seq", "heads", "kv"))
    return jnp.einsum("btnh,nhd->btd", o_BTNH, p["wo"])


def mlp(h_BTD: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Two-layer GELU MLP: column-parallel in, row-parallel out under TP rules."""
    u_BTF = jnp.einsum("btd,df->btf", h_BTD, p["w_in"]) + p["b_in"]
    u_BTF = constrain(jax.nn.gelu(u_BTF), ("batch", "seq", "mlp"))
    return jnp.einsum("btf,fd->btd", u_BTF, p["w_out"]) + p["b_out"]


def block(x_BTD: jax.Array, p: dict[str, jax.Array], use_rotary: bool) -> jax.Array:
    """One pre-norm transformer block."""
    h = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    x_BTD = constrain(x_BTD + attention(h, p, use_rotary), _RESIDUAL)
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
            raise ValueError(
                f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}"
            )
        if cfg.positions == "rotary" and cfg.head_dim % 2:
            raise ValueError(
                f"rotary positions need an even head dim; d_model/n_heads = {cfg.head_dim}: "
                "change model.d_model or model.n_heads, or use model.positions=learned"
            )
        self.cfg = cfg
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
        return self.logits(self.run_blocks(self.embed_tokens(tokens_BT)))

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """Token (+ learned position) embeddings [B, T, D] in the compute dtype."""
        cfg = self.cfg
        T = tokens_BT.shape[1]
        if T > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds model.max_seq_len={cfg.max_seq_len}; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        # Gather rows from the whole table (FSDP gathers weights before use anyway): from a
        # sharded table the partitioner cannot move the rows to the batch layout and falls
        # back to replicating the gathered activations.
        table_VD = constrain(self.embed[...], (None, None))
        x_BTD = jnp.take(table_VD, tokens_BT, axis=0)
        if cfg.positions == "learned":
            x_BTD = x_BTD + self.pos[:T][None]
        return constrain(x_BTD.astype(jnp.dtype(cfg.dtype)), _RESIDUAL)

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final norm and output projection: [B, T, D] → float32 logits [B, T, V]."""
        h = layer_norm(x_BTD, self.ln_f_scale[...], self.ln_f_bias[...])
        head_DV = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        logits = jnp.einsum("btd,dv->btv", h, head_DV.astype(x_BTD.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def run_blocks(self, x_BTD: jax.Array) -> jax.Array:
        """All blocks of ``self.blocks`` (however many are stacked there), in order."""
        dtype, use_rotary = x_BTD.dtype, self.cfg.positions == "rotary"

        def body(x, p):
            p = jax.tree.map(lambda a: a.astype(dtype), p)
            return block(x, p, use_rotary), None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        x_BTD, _ = jax.lax.scan(body, x_BTD, self.blocks.stacked())
        return x_BTD
