"""The transformer layers jaxpar's GPT and BERT share, annotated with logical axes only,
and their parameter and FLOP counts (what the layout lab knows of them:
:mod:`jaxpar.lab.transformers`).

Shape suffixes: B batch, T sequence, D embed (d_model), N heads, H head dim, F mlp (d_ff),
V vocab, L layers. The blocks' parameters are stacked on a leading ``layers`` dim and run
with ``jax.lax.scan`` (compile time does not grow with depth).

Attention runs through ``jax.nn.dot_product_attention``: cuDNN's fused kernel on a GPU
(no [B, N, T, T] logits in memory, the masked half skipped), XLA's einsum + softmax
elsewhere (see :func:`attention_implementation`); where its probabilities drop out
(``model.attention_dropout``), written out as XLA's (:func:`dropped_attention`), since
that function has no dropout.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar import tensor_parallel
from jaxpar.context import attend, sequence_axes
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain
from jaxpar.models import fp8
from jaxpar.models.dropout import LayerNoise
from jaxpar.models.lm import Documents
from jaxpar.ring_attention import visible

#: the residual stream between blocks, [B, T, D]: its tokens split as ``act_seq`` rules (over
#: ``context``, and over ``tensor`` too under sequence parallelism)
RESIDUAL = ("batch", "act_seq", "act_embed")


def enter_stream(x_BTD: jax.Array) -> jax.Array:
    """Embeddings [B, T, D] into the residual stream (:data:`RESIDUAL`: under sequence
    parallelism their tokens split over ``tensor`` too, as
    :func:`jaxpar.tensor_parallel.lookup` leaves them)."""
    return constrain(x_BTD, RESIDUAL)


#: ``model.attention`` values; ``auto`` resolves per backend (:func:`attention_implementation`).
Attention = Literal["auto", "xla", "cudnn"]


#: ``model.remat`` values: what a block recomputes in the backward pass (:data:`REMAT_POLICIES`)
Remat = Literal[
    "none",
    "full",
    "save_dots",
    "save_qkv",
    "save_out",
    "save_matmuls",
    "save_matmuls_context",
    "offload",
]

#: The names a block gives its projections' outputs (``jax.ad_checkpoint.checkpoint_name``),
#: which the named ``model.remat`` policies save or offload: q, k and v (before norms and
#: rotation), the attention output projection, the MLP's input projections (before the
#: activation) and its output projection; and attention's output, the heads' weighted
#: values before the output projection (``CONTEXT``, MaxText's "context").
QKV, ATTN_OUT, MLP_IN, MLP_OUT = "qkv", "attn_out", "mlp_in", "mlp_out"
CONTEXT = "attn_context"


def check_heads(cfg: Any, rotary: bool = False) -> None:
    """``model.n_heads`` divides ``model.d_model`` (and, with rotary positions, the head dim
    is even): what a transformer config's validator checks.

    Raises:
      ConfigError: naming the keys and the fix.
    """
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}; "
            "change one of them"
        )
    if rotary and (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError(
            f"rotary positions need an even head dim; d_model/n_heads = "
            f"{cfg.d_model // cfg.n_heads}: change model.d_model or model.n_heads, or use "
            "model.positions=learned"
        )


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
        fp8.attach(self, cfg, ("wqkv", "wo", "w_in", "w_out"), (L,), ("layers",))

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name (what the layer scan slices)."""
        names = (
            "ln1_scale",
            "ln1_bias",
            "wq",
            "wk",
            "wv",
            "wo",
            "ln2_scale",
            "ln2_bias",
            "w_in",
            "b_in",
            "w_out",
            "b_out",
        )
        names += ("bq", "bk", "bv", "bo") if hasattr(self, "bq") else ()
        return {**{n: getattr(self, n)[...] for n in names}, **fp8.histories(self)}


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


def rotary(
    x_BTNH: jax.Array,
    positions_T: jax.Array | None = None,
    theta: float = 10000.0,
    inv_freq: np.ndarray | None = None,
) -> jax.Array:
    """Rotary position embedding (half-split form, as Hugging Face's ``rotate_half``) over
    the head dim, at ``positions_T`` [T] or [B, T] (default 0 … T-1; a KV-cache step
    passes its own; packed documents, each token's position within its document),
    with base ``theta``, or with the given inverse frequencies
    (:func:`jaxpar.models.rope.inv_frequencies`)."""
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    if inv_freq is None:
        freq = 1.0 / (theta ** (jnp.arange(0, H // 2, dtype=jnp.float32) / (H // 2)))
    else:
        freq = jnp.asarray(inv_freq, jnp.float32)
    pos_T = jnp.arange(T) if positions_T is None else jnp.asarray(positions_T)
    angle = pos_T.astype(jnp.float32)[..., None] * freq  # [T, K], or [B, T, K] per example
    angle_BTK = angle if angle.ndim == 3 else angle[None]
    sin, cos = jnp.sin(angle_BTK)[:, :, None, :], jnp.cos(angle_BTK)[:, :, None, :]
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
                "or model.attention=xla"
            )
        if cfg.dtype not in _CUDNN_DTYPES:
            raise ConfigError(
                f"model.attention=cudnn needs bfloat16 compute, got model.dtype={cfg.dtype}: "
                "set model.dtype=bfloat16, or use model.attention=auto or xla"
            )
        if H % 8:
            raise ConfigError(
                f"model.attention=cudnn needs a head dim that is a multiple of 8; "
                f"model.d_model/model.n_heads = {H}: change them, or use model.attention=xla"
            )
    return cfg.attention


def attention(
    h_BTD: jax.Array,
    p: dict[str, jax.Array],
    use_rotary: bool,
    implementation: str = "xla",
    causal: bool = True,
    positions_T: np.ndarray | None = None,
    documents: Documents | None = None,
    precision: str = "default",
    noise: LayerNoise | None = None,
) -> jax.Array:
    """Multi-head self-attention (causal or not) through ``jax.nn.dot_product_attention``,
    across the ``context`` axis when the layout splits the sequence
    (:func:`jaxpar.context.attend`); ``positions_T``: the tokens' positions (their
    natural order when None; a load-balanced layout reorders them); ``documents``: packed
    documents (:func:`jaxpar.models.lm.lm_documents`): each token sees its own document
    only, rotated to its position within it.

    ``implementation`` is ``xla`` (logits and softmax in float32, [B, N, T, T] in memory)
    or ``cudnn`` (the fused kernel; 16-bit inputs, float32 accumulation inside).
    ``precision``: the projections' (``model.precision``: :func:`jaxpar.models.fp8.einsum`;
    the QK^T and PV products stay in the compute dtype). ``noise``: the layer's dropout
    (:func:`dropped_attention` where its probabilities drop).
    """
    q, k, v = qkv(h_BTD, p, precision)
    if use_rotary:
        pos = None if positions_T is None else jnp.asarray(positions_T)
        pos = pos if documents is None else documents.positions
        q, k = rotary(q, pos), rotary(k, pos)
    segments = None if documents is None else documents.segments
    if noise is not None and noise.attention:
        o_BTNH = dropped_attention(q, k, v, causal, segments, noise)
    else:
        o_BTNH = attend(
            q, k, v, positions_T, causal=causal, implementation=implementation, segments=segments
        )
    return attention_out(o_BTNH, p, precision)


def dropped_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool,
    segments: jax.Array | None,
    noise: LayerNoise,
) -> jax.Array:
    """Attention whose probabilities [B, N, T, T] drop at ``noise.attention`` (GPT-2's
    ``attn_pdrop``, Megatron's ``attention_dropout``): written out, as XLA's
    implementation of ``jax.nn.dot_product_attention`` computes it (float32 logits and
    softmax, the scores in memory), which has no dropout. The whole sequence on each
    device: under context parallelism it is refused.

    Raises:
      ConfigError: where the rules split the sequence (``mesh.context`` > 1).
    """
    axes = sequence_axes()
    if axes:
        raise ConfigError(
            f"model.attention_dropout={noise.attention} drops attention probabilities over "
            f"the whole sequence, which mesh axes {', '.join(axes)} split; set "
            "model.attention_dropout=0, or split it over none (mesh.context=1, rules.seq=null)"
        )
    T = q.shape[1]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = logits * (q.shape[-1] ** -0.5)
    pos = jnp.arange(T)
    mask = visible(pos, pos, causal, 0, segments, segments)
    probs = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
    probs = noise.drop(probs, "probabilities", noise.attention)
    return jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype), v)


#: the logical names of an MLP's weights: into the hidden width [D, F], and back [F, D]
MLP_UP = ("embed", "mlp")
MLP_DOWN = ("mlp", "embed")


def project(
    subscripts: str,
    x: jax.Array,
    w: jax.Array,
    w_names: tuple[str | None, ...],
    precision: str = "default",
    history: jax.Array | None = None,
) -> jax.Array:
    """A weight projection ``einsum(subscripts, x, w)`` of an activation ``x`` [B, T, …]
    by a weight whose dims are named ``w_names``: in ``precision`` (``model.precision``:
    :func:`jaxpar.models.fp8.einsum`, scaled from ``history`` under delayed scaling), and
    as a collective matmul where the layout overlaps tensor parallelism's communication
    (:func:`jaxpar.tensor_parallel.matmul`)."""
    dot = functools.partial(fp8.einsum, precision=precision, history=history)
    return tensor_parallel.matmul(subscripts, x, w, w_names, dot=dot)


def qkv(
    h_BTD: jax.Array, p: dict[str, jax.Array], precision: str = "default"
) -> tuple[jax.Array, ...]:
    """q, k, v [B, T, N, H] of the attention input (with ``model.attn_bias``'s biases)."""
    # One projection for q, k and v: under tensor parallelism the backward pass then sums
    # the three input gradients before its one all-reduce (Megatron's count), instead of
    # all-reducing three partial sums.
    w_D3NH = jnp.stack([p["wq"], p["wk"], p["wv"]], axis=1)
    names = ("embed", None, "heads", "kv")
    qkv = project("btd,dcnh->btcnh", h_BTD, w_D3NH, names, precision, fp8.history(p, "wqkv"))
    if "bq" in p:  # model.attn_bias
        qkv = qkv + jnp.stack([p["bq"], p["bk"], p["bv"]]).reshape(w_D3NH.shape[1:])
    qkv = checkpoint_name(constrain(qkv, ("batch", "seq", None, "heads", "kv")), QKV)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def attention_out(
    o_BTNH: jax.Array, p: dict[str, jax.Array], precision: str = "default"
) -> jax.Array:
    """The output projection [B, T, D] of the heads' outputs."""
    o_BTNH = checkpoint_name(constrain(o_BTNH, ("batch", "seq", "heads", "kv")), CONTEXT)
    names = ("heads", "kv", "embed")
    out_BTD = project("btnh,nhd->btd", o_BTNH, p["wo"], names, precision, fp8.history(p, "wo"))
    return checkpoint_name(out_BTD + p["bo"] if "bo" in p else out_BTD, ATTN_OUT)


def mlp(h_BTD: jax.Array, p: dict[str, jax.Array], precision: str = "default") -> jax.Array:
    """Two-layer GELU MLP: column-parallel in, row-parallel out under TP rules."""
    up = project("btd,df->btf", h_BTD, p["w_in"], MLP_UP, precision, fp8.history(p, "w_in"))
    u_BTF = checkpoint_name(up + p["b_in"], MLP_IN)
    u_BTF = constrain(jax.nn.gelu(u_BTF), ("batch", "seq", "mlp"))
    down = project("btf,fd->btd", u_BTF, p["w_out"], MLP_DOWN, precision, fp8.history(p, "w_out"))
    return checkpoint_name(down + p["b_out"], MLP_OUT)


def block(
    x_BTD: jax.Array,
    p: dict[str, jax.Array],
    use_rotary: bool,
    implementation: str = "xla",
    positions_T: np.ndarray | None = None,
    documents: Documents | None = None,
    precision: str = "default",
    noise: LayerNoise | None = None,
) -> jax.Array:
    """One pre-norm causal transformer block (``implementation``, ``positions_T``,
    ``documents``, ``precision``: see :func:`attention`); ``noise``: the layer's dropout
    (of the attention and MLP outputs, and of the attention probabilities)."""
    h = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    # packed documents, a precision and dropout only when there are some: the plain call is
    # the one a stand-in for attention takes (the benchmarks' hand-written reference)
    extra = {} if documents is None else {"documents": documents}
    extra |= {} if precision == "default" else {"precision": precision}
    extra |= {} if noise is None else {"noise": noise}
    a_BTD = attention(h, p, use_rotary, implementation, positions_T=positions_T, **extra)
    x_BTD = constrain(x_BTD + _dropped(a_BTD, noise, "attention"), RESIDUAL)
    h = layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"])
    return constrain(x_BTD + _dropped(mlp(h, p, precision), noise, "mlp"), RESIDUAL)


def _dropped(x_BTD: jax.Array, noise: LayerNoise | None, kind: str) -> jax.Array:
    return x_BTD if noise is None else noise.drop(x_BTD, kind, noise.hidden)


_policies = jax.checkpoint_policies
_MATMULS = (QKV, ATTN_OUT, MLP_IN, MLP_OUT)

#: ``jax.checkpoint`` policy of each ``model.remat`` value but ``none`` (MaxText's names in
#: brackets). Each keeps the block's input (the layer scan's carry) on the device. A named
#: value is kept only where the backward reads it: GPT's and the Llama's MLP output is not
#: (the block's output is the next block's input), Gemma's post-MLP norm reads it.
REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    # every matmul's output, attention's [B, N, T, T] logits included
    "save_dots": _policies.checkpoint_dots,
    # q, k and v: the backward recomputes attention and the MLP (save_qkv_proj)
    "save_qkv": _policies.save_only_these_names(QKV),
    # the row-parallel outputs, which tensor parallelism all-reduces: the recompute
    # repeats no all-reduce (save_out_proj; collective matmuls gather the inputs again)
    "save_out": _policies.save_only_these_names(ATTN_OUT, MLP_OUT),
    # the four projections' outputs, not attention's logits (minimal)
    "save_matmuls": _policies.save_only_these_names(*_MATMULS),
    # and attention's output: the backward needs no attention output again; written out,
    # it runs the scores' product again (minimal_with_context, minimal_flash; a fused
    # kernel's own saved statistics are not named, and are not checked without a GPU)
    "save_matmuls_context": _policies.save_only_these_names(*_MATMULS, CONTEXT),
    # the same moved to the host's pinned memory in the forward and back for the
    # backward: device memory of "full", recompute of "save_matmuls" (minimal_offloaded)
    "offload": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(_MATMULS),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


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
