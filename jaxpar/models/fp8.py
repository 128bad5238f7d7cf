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
layout (XLA all-reduces the max of a sharded tensor). FP8 compute moves no fewer bytes
between devices here: weights are gathered in float32 (or the compute dtype) and then
quantized. On XLA:CPU the FP8 dots are computed after an upcast (no FP8 units): the
numerics are FP8's, the speed is not; only a GPU with FP8 tensor cores (Hopper and
later) can measure the speed-up.

The building blocks are Flax's (``flax.linen.fp8_ops``: ``quantize``, ``dequantize``,
``compute_scale``, ``get_fp8_max``, and the dot transposes its own FP8 dot uses); Flax's
``fp8_scaled_dot_general`` itself scales the gradient from the *previous* step's amax
(delayed scaling, its history kept as gradient-overwritten parameters), which is why the
current-scaling dot here is a ``custom_vjp`` of its own.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jaxpar.errors import ConfigError

#: ``model.precision`` values: ``default`` computes every matmul in ``model.dtype``.
Precision = Literal["default", "fp8"]

#: ``model.fp8_scaling`` values: ``current`` only (``delayed``: see :func:`check_scaling`).
Fp8Scaling = Literal["current"]

FORWARD = jnp.float8_e4m3fn
GRADIENT = jnp.float8_e5m2
Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def einsum(spec: str, x: jax.Array, w: jax.Array, *, precision: str = "default") -> jax.Array:
    """``jnp.einsum(spec, x, w)`` computed in ``precision``: the compute dtype
    (``default``), or FP8 with per-tensor current scaling (``fp8``: see the module
    docstring; its result has ``x``'s dtype, its gradients their operands' dtypes).

    ``spec`` names each dim of ``x`` and ``w`` once; a letter in both operands and not in
    the output is contracted, one in both and in the output is a batch dim.
    """
    if precision == "default":
        return jnp.einsum(spec, x, w)
    dims, order = _dimensions(spec, x.ndim, w.ndim)
    y = _fp8_dot(dims, jnp.dtype(x.dtype), jnp.dtype(w.dtype), x, w)
    return y if order == tuple(range(y.ndim)) else jnp.transpose(y, order)


def check_scaling(scaling: Any) -> Any:
    """``model.fp8_scaling`` as given, but ``delayed`` refused: scaling each step from an
    amax history (Transformer Engine's default) is not built, as the gradient's amax is
    known only in the backward pass and would have to reach the model state through the
    gradients; current scaling needs no state.

    Raises:
      ConfigError: naming the key and the value to use instead.
    """
    if scaling == "delayed":
        raise ConfigError(
            "model.fp8_scaling=delayed (scales from an amax history) is not built: use "
            "model.fp8_scaling=current (each tensor scaled from its own amax this step)"
        )
    return scaling


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


def _scale(t: jax.Array, dtype: Any) -> jax.Array:
    """The per-tensor scale amax / max(dtype) of ``t`` (float32; 1 where t is all zeros)."""
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
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
    kw = dict(dimension_numbers=dims, precision=None, preferred_element_type=jnp.float32)
    dx = fp8_ops.dot_general_transpose_lhs(g_q, x_q, w_q, **kw)
    dw = fp8_ops.dot_general_transpose_rhs(g_q, x_q, w_q, **kw)
    dx = fp8_ops.dequantize(dx, jnp.float32, g_scale * w_scale)
    dw = fp8_ops.dequantize(dw, jnp.float32, g_scale * x_scale)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)
