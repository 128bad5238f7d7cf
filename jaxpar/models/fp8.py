"""FP8 matmuls (``model.precision=fp8``): the transformer's weight projections computed
from 8-bit floating-point operands, as NVIDIA's Transformer Engine and torchtitan's
float8 training run them.

What runs in FP8: q/k/v, the attention output projection and the MLP's projections of
GPT, BERT, the Llama family (its dense and shared-expert MLPs) and Gemma. What stays in
the compute dtype (``model.dtype``): the token embedding lookup, the LM head (logits),
attention's own QK^T and PV products, the norms, a mixture of experts' router and
experts — as in Transformer Engine and torchtitan, where these are the layers whose
precision the loss is most sensitive to, or that are not plain weight matmuls.

One matmul ``y = x · w`` (:func:`einsum`), per-tensor "current" scaling:

* forward: x and w are each divided by a scale s = amax / max(E4M3), amax being the
  largest |value| of that tensor in this step (``flax.linen.fp8_ops.compute_scale``),
  and rounded to E4M3 (``jnp.float8_e4m3fn``: 3 mantissa bits, largest 448); the dot
  takes the two FP8 tensors, accumulates in float32, and the result is multiplied by
  s_x · s_w and cast to the compute dtype;
* backward: the incoming gradient g is scaled the same way but rounded to E5M2
  (``jnp.float8_e5m2``: 2 mantissa bits, largest 57344: the range gradients need), and
  dx = g · w_q^T, dw = x_q^T · g are FP8 × FP8 dots rescaled likewise.

Master weights stay float32: the optimizer updates them; the FP8 copies live only inside
the step. A scale is a global max over the whole tensor, so it is the same under every
layout (XLA all-reduces the max of a sharded tensor). The partitioner quantizes an
FSDP-sharded weight on its shard and gathers the FP8 tensor (1 byte an element), and under
sequence parallelism gathers the quantized activations; XLA:CPU widens those gathers to
float16 after partitioning (the lab counts 2 bytes there). On XLA:CPU the FP8 dots are
computed after an upcast (no FP8 units): the numerics are FP8's, the speed is not; only a
GPU with FP8 tensor cores (Hopper and later) can measure the speed-up.

Delayed scaling (``model.fp8_scaling=delayed``, Transformer Engine's default recipe):
each tensor of a matmul is scaled from the largest amax of its last ``model.fp8_history``
steps instead of its own, so the scale is known before the tensor is (no extra pass over
it). Each projection keeps an :class:`Fp8History` (model state, not a parameter: saved,
resumed and restored onto other meshes with the rest of the state): for x, w and the
incoming gradient g, the scale last used and the amax history, newest first. The step
quantizes with scale = compute_scale(max(history)) — 1 while the history is empty, so
the first step saturates what exceeds the format's range — and pushes this step's amax.
The gradient's amax is known only in the backward pass, so the dot's ``custom_vjp``
returns the updated history as the history's "gradient", and the train step takes it as
the next value (:class:`jaxpar.state.FromGradient`, as Flax's
``_overwrite_with_gradient`` collection).

The building blocks are Flax's (``flax.linen.fp8_ops``: ``quantize``, ``dequantize``,
``compute_scale``, ``get_fp8_max``, and the dot transposes its own FP8 dot uses); Flax's
``fp8_scaled_dot_general`` itself scales the gradient from the *previous* step's amax
(delayed scaling, its history kept as gradient-overwritten parameters of a custom dtype
whose sum is a max), which is why both dots here are custom VJPs of their own.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jaxpar.axes import BATCH_AXES, Axis
from jaxpar.state import FromGradient

#: ``model.precision`` values: ``default`` computes every matmul in ``model.dtype``.
Precision = Literal["default", "fp8"]

#: ``model.fp8_scaling`` values: each tensor's own amax this step, or an amax history.
Fp8Scaling = Literal["current", "delayed"]

#: The rows of an :class:`Fp8History`: the matmul's input, its weight, its output's gradient.
X, W, G = 0, 1, 2
#: The key of a projection's history beside its weight ``name`` in a layer's parameters.
PREFIX = "fp8_"

FORWARD = jnp.float8_e4m3fn
GRADIENT = jnp.float8_e5m2
Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


class Fp8History(FromGradient):
    """A projection's delayed-scaling state [..., 3, 1 + n]: per row (:data:`X`,
    :data:`W`, :data:`G`) the scale last used, then the last ``n`` amaxes, newest first.
    Its gradient is its next value (:class:`jaxpar.state.FromGradient`)."""


def einsum(
    spec: str,
    x: jax.Array,
    w: jax.Array,
    *,
    precision: str = "default",
    history: jax.Array | None = None,
) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` computed in ``precision``: the compute dtype
    (``default``), or FP8 (``fp8``: see the module docstring; its result has ``x``'s
    dtype, its gradients their operands' dtypes) — per-tensor current scaling, or delayed
    scaling from ``history`` (an :class:`Fp8History`'s value [3, 1 + n]) where given.

    ``spec`` names each dim of ``x`` and ``w`` once; a letter in both operands and not in
    the output is contracted, one in both and in the output is a batch dim.
    """
    if precision == "default":
        return jnp.einsum(spec, x, w)
    dims, order = _dimensions(spec, x.ndim, w.ndim)
    types = (dims, jnp.dtype(x.dtype), jnp.dtype(w.dtype))
    if history is None:
        y = _fp8_dot(*types, x, w)
    else:
        y = _delayed_dot(*types, x, w, history)
    return y if order == tuple(range(y.ndim)) else jnp.transpose(y, order)


def empty_history(lead: tuple[int, ...], length: int) -> jax.Array:
    """A history before the first step: every scale 1, every amax 0 ([*lead, 3, 1 + n])."""
    row = jnp.zeros((1 + length,), jnp.float32).at[0].set(1.0)
    return jnp.broadcast_to(row, (*lead, 3, 1 + length))


def attach(
    module: Any, cfg: Any, names: tuple[str, ...], lead: tuple[int, ...], axes: tuple
) -> None:
    """Gives ``module`` an :class:`Fp8History` ``fp8_<name>`` for each projection
    ``name`` whose weights have leading dims ``lead`` (named ``axes``), where the model
    runs FP8 with delayed scaling (``cfg.precision``, ``cfg.fp8_scaling``)."""
    if cfg.precision != "fp8" or cfg.fp8_scaling != "delayed":
        return
    for name in names:
        value = empty_history(lead, cfg.fp8_history)
        setattr(module, PREFIX + name, Fp8History(value, out_sharding=(*axes, None, None)))


def histories(module: Any) -> dict[str, jax.Array]:
    """The values of ``module``'s :class:`Fp8History` attributes by name (none without
    delayed scaling): what a layer scan slices beside the stacked weights."""
    return {n: v[...] for n, v in vars(module).items() if isinstance(v, Fp8History)}


def history(p: dict[str, jax.Array], name: str) -> jax.Array | None:
    """Projection ``name``'s history in a layer's parameters ``p``, None without one."""
    return p.get(PREFIX + name)


def in_dtype(p: dict[str, jax.Array], dtype: Any) -> dict[str, jax.Array]:
    """A layer's parameters in ``dtype``, its histories kept float32."""
    return {n: a if n.startswith(PREFIX) else a.astype(dtype) for n, a in p.items()}


def _dimensions(spec: str, x_ndim: int, w_ndim: int) -> tuple[Dims, tuple[int, ...]]:
    """``lax.dot_general``'s dimension numbers for an einsum ``spec`` of two operands and
    the permutation of its output (batch, x's kept, w's kept dims) into the spec's."""
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    assert len(a) == x_ndim and len(b) == w_ndim, f"einsum {spec}: operand ranks"
    assert len(set(a)) == len(a) and len(set(b)) == len(b), f"einsum {spec}: repeated dim"
    contract = [c for c in a if c in b and c not in out]
    batch = [c for c in a if c in b and c in out]
    kept = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    assert sorted(kept) == sorted(out), f"einsum {spec}: every kept dim must be in the output"
    dims = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    return dims, tuple(kept.index(c) for c in out)


def _amax(t: jax.Array) -> jax.Array:
    """The largest |value| of the whole tensor ``t`` (float32): inside a ``shard_map``
    (a step that sums its gradients itself, with ``data`` manual) the max of every
    shard's over the manual axes that split its rows, so that the scale is the one
    device's (a pipeline's manual ``stage`` holds other layers: not those)."""
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    split = (*BATCH_AXES, Axis.CONTEXT)  # the axes that split an activation's rows
    manual = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a in split)
    return jax.lax.pmax(amax, manual) if manual else amax


def _scale(t: jax.Array, dtype: Any) -> jax.Array:
    """The per-tensor scale amax / max(dtype) of ``t`` (float32; 1 where t is all zeros)."""
    amax = _amax(t)
    fp8_max = fp8_ops.get_fp8_max(dtype, jnp.float32)
    return fp8_ops.compute_scale(amax, jnp.ones((), jnp.float32), fp8_max)


def _quantize(t: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``t`` scaled into ``dtype``'s range and rounded to it (the division in float32),
    and its scale."""
    scale = _scale(t, dtype)
    return fp8_ops.quantize(t, dtype, scale, jnp.float32), scale


def _dot(a: jax.Array, b: jax.Array, dims: Dims) -> jax.Array:
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_dot(dims: Dims, x_dtype: Any, w_dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    return _fp8_dot_fwd(dims, x_dtype, w_dtype, x, w)[0]


def _fp8_dot_fwd(dims: Dims, x_dtype: Any, w_dtype: Any, x: jax.Array, w: jax.Array):
    x_q, x_scale = _quantize(x, FORWARD)
    w_q, w_scale = _quantize(w, FORWARD)
    y = fp8_ops.dequantize(_dot(x_q, w_q, dims), jnp.float32, x_scale * w_scale)
    # the FP8 operands are what the backward pass reads: a quarter of float32's bytes
    return y.astype(x_dtype), (x_q, x_scale, w_q, w_scale)


def _fp8_dot_bwd(dims: Dims, x_dtype: Any, w_dtype: Any, res: tuple, g: jax.Array):
    x_q, x_scale, w_q, w_scale = res
    g_q, g_scale = _quantize(g, GRADIENT)
    dx, dw = _transposes(dims, g_q, g_scale, x_q, x_scale, w_q, w_scale)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _advance(t: jax.Array, row: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """The scale to quantize ``t`` with from its history ``row`` [1 + n] (the largest amax
    of the last n steps; the last scale while none is recorded or one is not finite), and
    the row after this step: that scale, then ``t``'s amax pushed in front."""
    fp8_max = fp8_ops.get_fp8_max(dtype, jnp.float32)
    scale = fp8_ops.compute_scale(jnp.max(row[1:]), row[0], fp8_max)
    amax = _amax(t)
    return scale, jnp.concatenate([scale[None], amax[None], row[1:-1]])


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _delayed_dot(
    dims: Dims, x_dtype: Any, w_dtype: Any, x: jax.Array, w: jax.Array, history: jax.Array
) -> jax.Array:
    return _delayed_dot_fwd(dims, x_dtype, w_dtype, x, w, history)[0]


def _delayed_dot_fwd(dims, x_dtype, w_dtype, x, w, history):
    x_scale, x_row = _advance(x, history[X], FORWARD)
    w_scale, w_row = _advance(w, history[W], FORWARD)
    x_q = fp8_ops.quantize(x, FORWARD, x_scale, jnp.float32)
    w_q = fp8_ops.quantize(w, FORWARD, w_scale, jnp.float32)
    y = fp8_ops.dequantize(_dot(x_q, w_q, dims), jnp.float32, x_scale * w_scale)
    return y.astype(x_dtype), (x_q, x_scale, w_q, w_scale, x_row, w_row, history[G])


def _delayed_dot_bwd(dims, x_dtype, w_dtype, res, g):
    x_q, x_scale, w_q, w_scale, x_row, w_row, g_history = res
    g_scale, g_row = _advance(g, g_history, GRADIENT)
    g_q = fp8_ops.quantize(g, GRADIENT, g_scale, jnp.float32)
    dx, dw = _transposes(dims, g_q, g_scale, x_q, x_scale, w_q, w_scale)
    # the history's "gradient" is its next value (jaxpar.state.FromGradient)
    return dx.astype(x_dtype), dw.astype(w_dtype), jnp.stack([x_row, w_row, g_row])


def _transposes(dims, g_q, g_scale, x_q, x_scale, w_q, w_scale):
    """dx and dw (float32) of an FP8 dot from its quantized gradient and operands."""
    kw = dict(dimension_numbers=dims, precision=None, preferred_element_type=jnp.float32)
    dx = fp8_ops.dot_general_transpose_lhs(g_q, x_q, w_q, **kw)
    dw = fp8_ops.dot_general_transpose_rhs(g_q, x_q, w_q, **kw)
    dx = fp8_ops.dequantize(dx, jnp.float32, g_scale * w_scale)
    dw = fp8_ops.dequantize(dw, jnp.float32, g_scale * x_scale)
    return dx, dw


_delayed_dot.defvjp(_delayed_dot_fwd, _delayed_dot_bwd)
