"""The transformer layers jaxpar's GPT and BERT share, annotated with logical axes only,
and what the layout lab knows of them.

Shape suffixes: B batch, T sequence, D embed (d_model), N heads, H head dim, F mlp (d_ff),
V vocab, L layers. The blocks' parameters are stacked on a leading ``layers`` dim and run
with ``jax.lax.scan`` (compile time does not grow with depth).

Attention runs through ``jax.nn.dot_product_attention``: cuDNN's fused kernel on a GPU
(no [B, N, T, T] logits in memory, the masked half skipped), XLA's einsum + softmax
elsewhere (see :func:`attention_implementation`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.context import attend, order, positions
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain
from jaxpar.models.family import LabLayout, LabModel, Term

RESIDUAL = ("batch", "seq", "act_embed")


#: ``model.attention`` values; ``auto`` resolves per backend (:func:`attention_implementation`).
Attention = Literal["auto", "xla", "cudnn"]


#: ``model.remat`` values: what a block recomputes in the backward pass (:data:`REMAT_POLICIES`)
Remat = Literal["none", "full", "save_dots"]


def check_heads(cfg: Any, rotary: bool = False) -> None:
    """``model.n_heads`` divides ``model.d_model`` (and, with rotary positions, the head dim
    is even): what a transformer config's validator checks.

    Raises:
      ConfigError: naming the keys and the fix.
    """
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}; "
            "change one of them")
    if rotary and (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError(
            f"rotary positions need an even head dim; d_model/n_heads = "
            f"{cfg.d_model // cfg.n_heads}: change model.d_model or model.n_heads, or use "
            "model.positions=learned")


def param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...], scale: float) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(key, shape, jnp.float32), out_sharding=axes)


def const(value: float, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), out_sharding=axes)


class Blocks(nnx.Module):
    """All transformer blocks, parameters stacked on a leading ``layers`` dim."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        L, D, N, H, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
        std, out_std = 0.02, 0.02 / (2 * L) ** 0.5  # GPT-2: scale residual projections
        self.ln1_scale = const(1.0, (L, D), ("layers", "embed"))
        self.ln1_bias = const(0.0, (L, D), ("layers", "embed"))
        self.wq = param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wk = param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wv = param(rngs.params(), (L, D, N, H), ("layers", "embed", "heads", "kv"), std)
        self.wo = param(rngs.params(), (L, N, H, D), ("layers", "heads", "kv", "embed"), out_std)
        self.ln2_scale = const(1.0, (L, D), ("layers", "embed"))
        self.ln2_bias = const(0.0, (L, D), ("layers", "embed"))
        self.w_in = param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std)
        self.b_in = const(0.0, (L, F), ("layers", "mlp"))
        self.w_out = param(rngs.params(), (L, F, D), ("layers", "mlp", "embed"), out_std)
        self.b_out = const(0.0, (L, D), ("layers", "embed"))
        if getattr(cfg, "attn_bias", False):  # BERT's config shares these blocks
            self.bq = const(0.0, (L, N * H), ("layers", "heads"))
            self.bk = const(0.0, (L, N * H), ("layers", "heads"))
            self.bv = const(0.0, (L, N * H), ("layers", "heads"))
            self.bo = const(0.0, (L, D), ("layers", "embed"))

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


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def rotary(x_BTNH: jax.Array, positions_T: jax.Array | None = None,
           theta: float = 10000.0, inv_freq: np.ndarray | None = None) -> jax.Array:
    """Rotary position embedding (half-split form, as Hugging Face's ``rotate_half``) over
    the head dim, at ``positions_T`` (default 0 … T-1; a KV-cache step passes its own),
    with base ``theta``, or with the given inverse frequencies
    (:func:`jaxpar.models.rope.inv_frequencies`)."""
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    if inv_freq is None:
        freq = 1.0 / (theta ** (jnp.arange(0, H // 2, dtype=jnp.float32) / (H // 2)))
    else:
        freq = jnp.asarray(inv_freq, jnp.float32)
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


def attention_implementation(cfg: Any, backend: str | None = None) -> str:
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
              implementation: str = "xla", causal: bool = True,
              positions_T: np.ndarray | None = None) -> jax.Array:
    """Multi-head self-attention (causal or not) through ``jax.nn.dot_product_attention``,
    across the ``context`` axis when the layout splits the sequence
    (:func:`jaxpar.context.attend`); ``positions_T``: the tokens' positions (their
    natural order when None; a load-balanced layout reorders them).

    ``implementation`` is ``xla`` (logits and softmax in float32, [B, N, T, T] in memory)
    or ``cudnn`` (the fused kernel; 16-bit inputs, float32 accumulation inside).
    """
    q, k, v = qkv(h_BTD, p)
    if use_rotary:
        pos = None if positions_T is None else jnp.asarray(positions_T)
        q, k = rotary(q, pos), rotary(k, pos)
    o_BTNH = attend(q, k, v, positions_T, causal=causal, implementation=implementation)
    return attention_out(o_BTNH, p)


def qkv(h_BTD: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
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


def refuse_init_from(cfg: Any) -> None:
    """A family's task builder starts from initializers: Hugging Face weights
    (``model.init_from``) are read where the config is.

    Raises:
      ConfigError: for a config with ``init_from`` set.
    """
    if cfg.init_from:
        raise ConfigError(f"model.init_from={cfg.init_from}: the weights of a Hugging Face "
                          "directory are read by jaxpar.task_for(config) (and jaxpar.build); "
                          "call that, or build this task without init_from")


def kv_cache(cfg: Any, batch: int, heads: int) -> dict[str, jax.Array]:
    """An empty KV cache for generation: K and V [L, B, S, heads, H] in the compute dtype,
    S = ``max_seq_len``."""
    shape = (cfg.n_layers, batch, cfg.max_seq_len, heads, cfg.head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return {"k": zeros, "v": zeros}


def lm_sequence(batch: Any) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """Inputs and targets [B, T] of ``batch['tokens']`` [B, T+1] and their positions, in
    the order the layout runs a sequence (balanced under context parallelism:
    :func:`jaxpar.context.positions`)."""
    tokens = batch["tokens"]
    pos_T = positions(tokens.shape[1] - 1)
    return order(tokens[:, :-1], pos_T), order(tokens[:, 1:], pos_T), pos_T


def next_token_loss(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict]:
    """Mean next-token cross entropy (the same in any order the layout runs the tokens)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), {}


def attention_out(o_BTNH: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
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
          implementation: str = "xla", positions_T: np.ndarray | None = None) -> jax.Array:
    """One pre-norm causal transformer block (``implementation``, ``positions_T``: see
    :func:`attention`)."""
    h = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    a_BTD = attention(h, p, use_rotary, implementation, positions_T=positions_T)
    x_BTD = constrain(x_BTD + a_BTD, RESIDUAL)
    h = layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"])
    return constrain(x_BTD + mlp(h, p), RESIDUAL)


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
}


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


def transformer_tensor_terms(cfg: Any, layout: LabLayout, backward: int = 2) -> list[Term]:
    """Megatron's activation all-reduces: per layer two of ``[b, T, D]`` forward (attention
    and MLP outputs) and two backward (their inputs), one more for the head's input
    gradient; the cross-entropy over vocab-sharded logits all-reduces three ``[b, T]``
    statistics; a vocab-sharded embedding table is gathered."""
    t = layout.sizes["tensor"]
    if t == 1:
        return []
    # a sequence split over the context axes: each device holds its part of every sequence
    split = math.prod(layout.sizes[a] for a in layout.rules.get("seq", ()))
    rows, seq, d = layout.rows, layout.seq_len // split, cfg.d_model
    activation = rows * seq * d * (4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize)
    # Without a pipeline: once per microbatch over all layers. In a pipeline every tick
    # counts as its costliest branch, the last stage's backward: its layers' recomputed
    # forward and backward plus the head, and the embedding of the first stage.
    k = layout.grad_accum
    if layout.sub_mesh:
        return _first_stage_terms(cfg, layout, activation, backward)
    # a rematerialized block all-reduces its attention output again (the MLP output it
    # recomputes feeds nothing in the backward pass: dead code)
    forward_again = 1 if cfg.remat == "full" else 0
    if layout.stages is not None:
        ticks, p, v, m = layout.stages
        times, layers, div = ticks * k, cfg.n_layers // (p * v), m * k
    else:
        times, layers, div = k, cfg.n_layers, k
    terms = [Term("all-reduce", "Megatron activation all-reduces", activation / div, t,
                  times * ((2 + backward + forward_again) * layers + 1)),
             Term("all-reduce", "cross-entropy statistics", rows * seq * 4 / div, t, 3 * times)]
    if "tensor" in layout.rules.get("vocab", ()):
        # loop-invariant: XLA gathers the table once for all microbatches
        terms.append(Term("all-gather", "embedding table gather", cfg.vocab_size * d * 4,
                          t, times if layout.stages is not None else 1))
    return terms


def _first_stage_terms(cfg: Any, layout: LabLayout, activation: float, backward: int
                       ) -> list[Term]:
    """A device of the first stage under the sub-mesh pipeline, a program per action: each
    microbatch's forward all-reduces twice a layer, its backward (or weight-gradient half:
    the first chunk has no input gradient) four times — the recomputed forward's and both
    input gradients' — and each of the two gathers a vocab-sharded table."""
    t, k = layout.sizes["tensor"], layout.grad_accum
    _, p, v, m = layout.stages
    layers = cfg.n_layers // (p * v)
    terms = [Term("all-reduce", "Megatron activation all-reduces", activation / (m * k), t,
                  m * k * (4 + backward) * layers)]
    if "tensor" in layout.rules.get("vocab", ()):
        terms.append(Term("all-gather", "embedding table gather",
                          cfg.vocab_size * cfg.d_model * 4, t, 2 * m * k))
    return terms


def transformer_context_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """Attention across ``c`` devices of a split sequence, per layer. ``all_gather``: K and
    V gathered in the forward (again in a rematerialized backward), dK and dV
    reduce-scattered in the backward, the positions gathered once. ``ring``: K and V pass
    c−1 blocks on in the forward and again in the backward, where dK and dV travel with
    them and home (c sends); the positions' c−1 sends are the same for every layer.
    Without a pipeline (inside one, the lab predicts no context terms yet)."""
    c = math.prod(layout.sizes[a] for a in layout.rules.get("seq", ()))
    if c == 1 or layout.stages is not None:
        return []
    k, L, T = layout.grad_accum, cfg.n_layers, layout.seq_len
    # grouped-query attention gathers its K key/value heads, unless they are repeated to
    # the query heads first (ring, or key/value heads not split as the query heads are)
    rules, n_kv = layout.rules, getattr(cfg, "n_kv_heads", cfg.n_heads)
    grouped = (n_kv != cfg.n_heads and layout.context != "ring"
               and rules.get("kv_heads", ()) == rules.get("heads", ()))
    width = (n_kv if grouped else cfg.n_heads) * cfg.head_dim
    heads = math.prod(layout.sizes[a] for a in rules.get("kv_heads" if grouped else "heads", ()))
    itemsize = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
    kv = layout.rows * T * width // heads * itemsize / k  # one of K, V: whole sequence
    # measured: a tied table's two gradients (the lookup's, the head's) reduced apart
    tied = ([Term("all-reduce", "context: tied table gradient reduced over context",
                  cfg.vocab_size * cfg.d_model * 4, c)]
            if getattr(cfg, "tie_embeddings", False) else [])
    if layout.context == "ring":  # a custom VJP: a rematerialized block keeps its result
        block = kv / c
        return [*tied,
                Term("collective-permute", "context: K and V blocks round the ring", block, c,
                     k * L * 2 * (c - 1) * 2),
                Term("collective-permute", "context: dK and dV blocks home",  # float32
                     block * 4 / itemsize, c, k * L * 2 * c),
                Term("collective-permute", "context: positions round the ring", T // c * 4,
                     c, c - 1)]
    forward = 2 if cfg.remat != "none" else 1
    return [*tied,
            Term("all-gather", "context: K and V gathered", kv, c, k * L * 2 * forward),
            Term("reduce-scatter", "context: dK and dV reduce-scattered", kv, c, k * L * 2),
            Term("all-gather", "context: positions gathered", T * 4, c, 1)]


class TransformerLab(LabModel):
    """What the lab knows of jaxpar's transformers (GPT and BERT)."""

    whole_params = frozenset({"embed"})  # tokens are looked up in the whole table
    #: activation all-reduces per layer in the backward pass under tensor parallelism: the
    #: input gradients of the attention's projection (q, k, v stacked: one sum) and of the
    #: MLP's first matmul
    backward_all_reduces = 2

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_tensor_terms(cfg, layout, self.backward_all_reduces)

    def context_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_context_terms(cfg, layout)
