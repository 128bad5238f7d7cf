"""The activations a transformer keeps for its backward pass, per device, from its shape
and the layout: what a step's temporaries mostly are (:mod:`jaxpar.lab.analytic`).

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models") count a layer's activations per token in multiples of the width: the
inputs and outputs of its norms (held whole on every device of ``tensor`` unless sequence
parallelism splits them too), q, k, v and the attention output, the MLP's inputs and
activation (split over ``tensor``), and attention's [heads, T, T] scores (split over the
heads; none where a fused kernel, cuDNN's flash attention, recomputes them). How many of
each XLA keeps depends on the block and on XLA's fusion, so each family states its own
counts (:class:`Kept`), read from the programs XLA compiles (the per-layer difference of
4- and 8-layer models on 8 CPU devices, JAX 0.10; ``tests/test_analytic.py`` checks the
whole step's temporaries against them).

Per device, for ``b`` rows (a microbatch's), ``s`` tokens of the sequence (its part under
``context``), ``S`` keys a query sees (the whole sequence, a ring step's part under ring
attention), width ``D``, MLP width ``F``, ``a`` heads, vocabulary ``V``, ``t`` the tensor
degree, ``e`` the bytes of an activation element::

    a layer, kept:          e·b·s·(D·replicated/t_sp + (W·attention + F·mlp)/t)
                            + e·b·a·s·S·scores/t     (W: q, k and v's width)
    a layer under remat:    e·b·s·D·remat  (the block's input, and what XLA keeps with it)
    the head:               4·b·s·V·head/t  (float32 logits, their softmax and gradient)
    the step:               layers·in_flight·(a layer) + the head + one layer recomputed

where ``t_sp`` is ``t`` under sequence parallelism and 1 without, ``layers`` the layers a
device holds in one chunk (over ``stage`` and virtual stages), and ``in_flight`` the most
microbatch chunks a pipeline's device holds activations of at once (1 without a pipeline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.lab.terms import LabLayout
from jaxpar.logical import ACT_SEQ, SEQ, split_over


@dataclass(frozen=True)
class Kept:
    """A family's activation counts per token (the module docstring): multiples of ``D``
    held whole over ``tensor`` (``replicated``), of q, k and v's width split
    (``attention``), of ``F`` split (``mlp``), of the [heads, keys] scores split
    (``scores``), of ``D`` per layer under ``model.remat=full`` (``remat``) and of the
    vocabulary in float32 at the head (``head``)."""

    replicated: float
    attention: float
    mlp: float
    scores: float
    remat: float
    head: float


def activation_bytes(cfg: Any, layout: LabLayout, kept: Kept, fused_attention: bool) -> float:
    """Bytes of the activations one device holds at the peak of a step (the module
    docstring); ``fused_attention``: a kernel recomputes the scores (none kept)."""
    sizes = layout.sizes
    t = sizes[Axis.TENSOR]
    c = math.prod(sizes[a] for a in split_over(layout.rules, sizes, SEQ))
    sequence = math.prod(sizes[a] for a in split_over(layout.rules, sizes, ACT_SEQ))
    t_sp = sequence // c if sequence > c else 1
    e = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
    b = layout.rows / layout.grad_accum / (layout.stages[3] if layout.stages else 1)
    T = layout.seq_len
    s = T / c
    keys = s if layout.context == "ring" else T
    scores = 0.0 if fused_attention else kept.scores * b * cfg.n_heads * s * keys / t
    heads = cfg.n_heads * _head_dim(cfg)
    width = heads + 2 * getattr(cfg, "n_kv_heads", cfg.n_heads) * _head_dim(cfg)
    split = width * kept.attention + cfg.d_ff * kept.mlp
    layer = e * (b * s * (cfg.d_model * kept.replicated / t_sp + split / t) + scores)
    layers = cfg.n_layers / sizes[Axis.STAGE] / (layout.stages[2] if layout.stages else 1)
    head = 4 * b * s * cfg.vocab_size * kept.head / t
    block_input = e * b * s * cfg.d_model
    if layout.stages is not None and not layout.residuals:
        # a pipeline's backward recomputes its chunk from the chunk's input: a device keeps
        # one input per microbatch in flight, and one chunk's layers while recomputing
        return layout.in_flight * block_input + layers * layer + head
    if getattr(cfg, "remat", "none") == "full":
        return layers * layout.in_flight * block_input * kept.remat + head + layer
    return layers * layout.in_flight * layer + head


def _head_dim(cfg: Any) -> int:
    """A head's width: the config's (``head_dim``), else ``d_model / n_heads``."""
    return getattr(cfg, "head_dim", cfg.d_model // cfg.n_heads)
