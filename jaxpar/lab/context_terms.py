"""The collectives attention adds across a sequence split over devices
(``mesh.context``) in jaxpar's transformers, per layer, by how attention runs across the
split (``context.attention``: ``all_gather``, ``ring`` or ``ulysses``); the family lab
modules (:mod:`jaxpar.lab.transformers`) report them."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from jaxpar.lab.activations import KEPT_BY_NAME
from jaxpar.lab.terms import LabLayout, Term
from jaxpar.logical import SEQ


def transformer_context_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """Attention across ``c`` devices of a split sequence, per layer. ``all_gather``: K and
    V gathered in the forward (again in a rematerialized backward), dK and dV
    reduce-scattered in the backward, the positions gathered once. ``ring``: K and V pass
    c−1 blocks on in the forward and again in the backward, where dK and dV travel with
    them and home (c sends); the positions' c−1 sends are the same for every layer.
    ``ulysses``: per layer 4 all-to-alls of a device's ``[b, T/c, N, H]`` share forward (q,
    k, v in, the output back; k and v with their K heads where they are not repeated),
    again in a rematerialized backward, and their 4 gradients backward; the positions
    gathered once. Without a pipeline: inside one, :func:`jaxpar.lab.staged.
    context_terms_in_pipeline` rescales these per microbatch and tick."""
    seq = tuple(layout.rules.get(SEQ, ()))
    c = math.prod(layout.sizes[a] for a in seq)
    if c == 1 or layout.stages is not None:
        return []
    k, L, T = layout.grad_accum, cfg.n_layers, layout.seq_len
    # grouped-query attention moves its K key/value heads, unless they are repeated to
    # the query heads first (ring; key/value heads not split as the query heads are; or,
    # for ulysses, a device's key/value heads that c does not divide)
    rules = layout.rules
    n_kv = getattr(cfg, "n_kv_heads", cfg.n_heads)
    kv_split = math.prod(layout.sizes[a] for a in rules.get("kv_heads", ()))
    grouped = (
        n_kv != cfg.n_heads
        and layout.context != "ring"
        and rules.get("kv_heads", ()) == rules.get("heads", ())
        and (layout.context != "ulysses" or n_kv // kv_split % c == 0)
    )
    width = (n_kv if grouped else cfg.n_heads) * cfg.head_dim
    heads = math.prod(layout.sizes[a] for a in rules.get("kv_heads" if grouped else "heads", ()))
    itemsize = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
    kv = layout.rows * T * width // heads * itemsize / k  # one of K, V: whole sequence
    # measured: a tied table's two gradients (the lookup's, the head's) reduced apart;
    # the head's split as its vocabulary is
    vocab = math.prod(layout.sizes[a] for a in rules.get("vocab", ()))
    tied = (
        [
            Term(
                "all-reduce",
                "context: tied table gradient reduced over context",
                cfg.vocab_size * cfg.d_model * 4 / vocab,
                c,
                axes=seq,
            )
        ]
        if getattr(cfg, "tie_embeddings", False)
        else []
    )
    if layout.context == "ring":
        return [*tied, *_ring_terms(cfg, layout, c, kv, itemsize)]
    forward = 2 if cfg.remat != "none" else 1
    if layout.context == "ulysses":
        return [*tied, *_ulysses_terms(cfg, layout, c, kv, itemsize)]
    return [
        *tied,
        Term("all-gather", "context: K and V gathered", kv, c, k * L * 2 * forward, axes=seq),
        Term("reduce-scatter", "context: dK and dV reduce-scattered", kv, c, k * L * 2, axes=seq),
        Term("all-gather", "context: positions gathered", T * 4, c, 1, axes=seq),
    ]


def _ring_terms(cfg: Any, layout: LabLayout, c: int, kv: float, itemsize: int) -> list[Term]:
    """Ring attention's sends (``kv``: one of K, V over the whole sequence, per device): a
    custom VJP, so a rematerialized block keeps its result."""
    k, L, T = layout.grad_accum, cfg.n_layers, layout.seq_len
    seq = tuple(layout.rules.get(SEQ, ()))
    block = kv / c
    return [
        Term(
            "collective-permute",
            "context: K and V blocks round the ring",
            block,
            c,
            k * L * 2 * (c - 1) * 2,
            axes=seq,
        ),
        Term(
            "collective-permute",
            "context: dK and dV blocks home",  # float32
            block * 4 / itemsize,
            c,
            k * L * 2 * c,
            axes=seq,
        ),
        Term(
            "collective-permute",
            "context: positions round the ring",
            T // c * 4,
            c,
            c - 1,
            axes=seq,
        ),
    ]


def _ulysses_terms(cfg: Any, layout: LabLayout, c: int, kv: float, itemsize: int) -> list[Term]:
    """Ulysses's all-to-alls (``kv``: one of K, V over the whole sequence, per device). A
    rematerialized backward exchanges again, but for attention's output where the policy
    keeps it by name (``save_matmuls_context``: measured, rotary GPT at ``data=4,context=2``
    and GPT at ``data=2,context=4``, ``tests/test_ulysses.py``)."""
    k, L, T = layout.grad_accum, cfg.n_layers, layout.seq_len
    again = cfg.remat != "none"
    forward = 1 + again
    output = 1 + (again and "values" not in KEPT_BY_NAME[cfg.remat])
    q_heads = math.prod(layout.sizes[a] for a in layout.rules.get("heads", ()))
    q = layout.rows * T * cfg.n_heads * cfg.head_dim // q_heads * itemsize / k / c
    seq = tuple(layout.rules.get(SEQ, ()))
    exchanges = k * L * (forward + output)
    return [
        Term("all-to-all", "context: q and output exchanged", q, c, exchanges, axes=seq),
        Term("all-to-all", "context: K and V exchanged", kv / c, c, k * L * 2 * forward, axes=seq),
        Term("all-to-all", "context: dq and d(output) exchanged", q, c, k * L * 2, axes=seq),
        Term("all-to-all", "context: dK and dV exchanged", kv / c, c, k * L * 2, axes=seq),
        Term("all-gather", "context: positions gathered", T * 4, c, 1, axes=seq),
    ]
