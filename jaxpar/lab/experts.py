"""What the layout lab knows of a mixture-of-experts MLP (:mod:`jaxpar.models.moe`, the
Llama family's with ``model.n_experts`` > 0): the experts' token dispatch under expert
parallelism, and the all-reduces their split F dim adds under ``tensor``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxpar.lab.activations import SAVED
from jaxpar.lab.terms import LabLayout, Term
from jaxpar.logical import BATCH, SEQ, split_over


def dispatch_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """The layout lab's expert-parallel dispatch per MoE layer (every ``cfg.moe_every``-th), for
    experts split over ``e`` devices: forward, the tokens [b·e, T, D] and their routing
    [b·e, T, k] (experts int32, weights float32) all-gathered, the outputs reduce-scattered;
    backward, their transposes — the output gradients all-gathered, the input and weight
    gradients reduce-scattered."""
    layers = cfg.n_layers // cfg.moe_every if cfg.n_experts else 0
    over = expert_axes(layout)
    e = math.prod(layout.sizes[a] for a in over)
    if e == 1 or not layers or layout.stages is not None:  # pipelines: jaxpar.lab.staged
        return []
    k = layout.grad_accum
    seq = layout.seq_len // math.prod(layout.sizes[a] for a in layout.rules.get(SEQ, ()))
    itemsize = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
    tokens = layout.rows * e * seq / k  # a group's tokens, per microbatch
    times = k * layers
    # a rematerialized forward gathers again; its reduce-scatter feeds nothing the backward
    # reads (the next group's input is kept): dead code
    again = times * (2 if cfg.remat != "none" else 1)
    if getattr(cfg, "moe_dispatch", "all_gather") == "all_to_all":
        # balanced routing: a device's n·k routed rows there and back, and their gradients
        # (not measured: XLA:CPU does not compile ragged_all_to_all; the count exchanges'
        # e·E/e integers left out)
        rows = tokens / e * cfg.top_k * cfg.d_model * itemsize
        return [
            Term(
                "all-to-all", "experts: routed rows there and back", rows, e, 2 * again, axes=over
            ),
            Term(
                "all-to-all",
                "experts: their gradients back and there",
                rows,
                e,
                2 * times,
                axes=over,
            ),
        ]
    return [
        Term(
            "all-gather",
            "experts: tokens and routing gathered",
            tokens * (cfg.d_model * itemsize + 8 * cfg.top_k),
            e,
            again,
            axes=over,
        ),
        Term(
            "reduce-scatter",
            "experts: outputs reduce-scattered",
            tokens * cfg.d_model * itemsize,
            e,
            times,
            axes=over,
        ),
        Term(
            "all-gather",
            "experts: output gradients gathered",
            tokens * cfg.d_model * itemsize,
            e,
            times,
            axes=over,
        ),
        Term(
            "reduce-scatter",
            "experts: input and weight gradients reduce-scattered",
            tokens * (cfg.d_model * itemsize + 4 * cfg.top_k),
            e,
            times,
            axes=over,
        ),
    ]


def expert_axes(layout: LabLayout) -> tuple[str, ...]:
    """The axes a group's experts are split over: those of the batch axes that
    ``rules.experts`` names — none inside the spmd pipeline's stages, which are manual over
    the batch axes and take the experts in gathered (as FSDP's weights)."""
    if layout.stages is not None and not layout.sub_mesh:
        return ()
    batch = list(split_over(layout.rules, layout.sizes, BATCH))
    return tuple(a for a in layout.rules.get("experts", ()) if a in batch)


def expert_degree(layout: LabLayout) -> int:
    """The devices a group's experts are split over (``e``: :func:`expert_axes`)."""
    return math.prod(layout.sizes[a] for a in expert_axes(layout))


#: The dense transformer's activation all-reduces (:mod:`jaxpar.lab.tensor_terms`).
MEGATRON = "Megatron activation all-reduces"


def tensor_terms(cfg: Any, layout: LabLayout, dense: list[Term]) -> list[Term]:
    """A dense transformer's activation all-reduces under ``tensor`` (``dense``: Megatron's
    count, a SwiGLU MLP in every layer) with the MoE layers' own (measured, XLA:CPU).

    The experts' F dim is split over ``tensor`` inside :func:`jaxpar.models.moe.moe_mlp`'s
    ``shard_map`` (manual over the batch axes only), so a grouped matmul's output rows,
    ``[b·e·T·k, D]`` (the group's assignments: every token ``top_k`` times, ``e`` devices'
    tokens under expert parallelism), are partial sums: XLA all-reduces the down
    projection's once a forward — again in a recomputed one, ``save_dots`` included (the
    routing weights' gradient reads them) — and the gate and up projections' input gradients
    once each a backward. Shared experts are one dense SwiGLU, which Megatron's count
    covers; without them an MoE layer has no dense MLP, whose all-reduces come off the
    count. A rematerialized group that does not keep the MLPs' outputs (``full``,
    ``save_qkv``) also recomputes its first ``moe_every − 1`` MLPs' outputs (the next layer
    reads them), all-reducing them again. Pipelines as Megatron's count: every tick as its
    costliest branch (spmd), a device of the first stage (mpmd: its forward and its
    backward's recompute, in each of its chunks)."""
    megatron = next((t for t in dense if t.what == MEGATRON), None)
    if not cfg.n_experts or megatron is None:
        return dense
    layers = cfg.n_layers // cfg.moe_every
    passes = layout.grad_accum  # microbatches
    forward = counted = 1  # a pass's forwards that all-reduce the rows; that count a dense MLP
    again = cfg.remat != "none" and not layout.sub_mesh
    if layout.stages is not None:
        ticks, p, v, m = layout.stages
        # a tick runs one chunk; the sub-mesh pipeline runs each microbatch through all v
        # of the stage's chunks, each its own program
        layers //= p if layout.sub_mesh else p * v
        passes *= m if layout.sub_mesh else ticks
        if layout.sub_mesh:
            counted = 2
            forward = 1 if layout.residuals else 2
    n = passes * layers
    mlps = (cfg.moe_every - 1) * (again and "mlp_out" not in SAVED[cfg.remat]) - (
        0 if cfg.n_shared_experts else counted + 2
    )
    rows = megatron.payload_bytes * cfg.top_k * expert_degree(layout)
    return [
        dataclasses.replace(x, times=x.times + n * mlps) if x is megatron else x for x in dense
    ] + [
        Term(
            "all-reduce",
            "experts: routed outputs all-reduced over tensor",
            rows,
            megatron.group,
            n * (forward + again),
            axes=megatron.axes,
        ),
        Term(
            "all-reduce",
            "experts: routed input gradients all-reduced over tensor",
            rows,
            megatron.group,
            n * 2,
            axes=megatron.axes,
        ),
    ]
