"""What the layout lab knows of a mixture-of-experts MLP (:mod:`jaxpar.models.moe`, the
Llama family's with ``model.n_experts`` > 0): the experts' token dispatch under expert
parallelism, the all-reduces their split F dim adds under ``tensor``, and the routed
tokens' matmuls and activations.

**Routed rows.** A device's grouped matmuls take, per MoE layer and microbatch, ``R = b·s·k·e``
rows: its ``b·s`` tokens (its part of the sequences under context parallelism) ``top_k``
times each, ``e`` devices' under expert parallelism (the all-gather dispatch gathers the
group's tokens; the all-to-all dispatch's receive buffer is the dropless worst case, as
many). Balanced routing puts ``b·s·k`` of them in the device's ``E/e`` experts.

**How XLA computes them.** On a GPU ``jax.lax.ragged_dot`` is a grouped matmul: each local
expert's rows against its weights, the FLOPs the family counts (``top_k`` experts a token).
XLA:CPU has no such kernel: JAX's fallback masks the rows into one copy per local expert
(``[E/e, R, D]``) and contracts over experts and width, so every routed row meets every
local expert — ``E`` times the grouped FLOPs (``E/e`` experts × ``e``·``b·s·k`` rows), forward
and backward, and what its backward holds ``E/e`` times. The lab counts each form where it
runs (:attr:`~jaxpar.lab.terms.LabLayout.cpu`), so a plan compiled here is priced as the
GPU's program (:func:`jaxpar.lab.kernels.gpu_flops_factor`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.lab.activations import (
    NO_ROUTED,
    SAVED,
    Routed,
    activation_itemsize,
    device_tokens,
    microbatch_rows,
    microbatches,
    remat_of,
)
from jaxpar.lab.terms import LabLayout, Matmul, Term
from jaxpar.logical import BATCH, SEQ, split_over

#: what an MoE layer keeps for its backward per routed row, in widths: 6 of the experts'
#: ``F/t`` and 2.5 of ``D`` — measured as :class:`~jaxpar.lab.activations.Kept`'s counts
#: (the per-layer difference of 4- and 8-layer steps less the layer's gradients, 8 CPU
#: devices): llama_tiny with 2, 4 and 8 experts, top-1 and top-2, ``d_ff`` 344 and 688
#: (6.0 of F), ``d_model`` 128 and 256 (2.5 and 2.1 of D), under ``tensor`` 2 and 4 (F
#: split, D not) and experts over data (the gathered rows); the number of experts changes
#: nothing (14.31-14.34 MiB a layer for 2-8 experts)
ROUTED_F, ROUTED_D = 6.0, 2.5
#: what one MoE layer's backward holds at once beyond that, per routed row and copy: 4 of
#: ``F/t`` and 2 of ``D`` (its products' operands: the rows and the gate's, up's and
#: down's inputs or output gradients); XLA:CPU holds a copy per local expert — the step's
#: temporaries beyond its layers grew by 4.0 F + 2.4 D a routed row per expert (2-8
#: experts, top-1 and 2, F 344 and 688); a GPU's grouped matmul one (not measured here)
TRANSIENT_F, TRANSIENT_D = 4.0, 2.0
#: and where the backward recomputes the layer (``model.remat``, a pipeline), what its
#: forward's products hold beside, per routed row and copy: 1 of ``F/t`` and 1 of ``D``
#: (the down and the gate/up products' inputs; measured: the compiled steps under full,
#: save_matmuls and save_dots held 8.6-10.6 MiB more than without, at 4 experts × 1,024
#: rows: 7.4 MiB so counted)
RECOMPUTED_F, RECOMPUTED_D = 1.0, 1.0


def dispatch_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """The layout lab's expert-parallel dispatch per MoE layer (every ``cfg.moe_every``-th), for
    experts split over ``e`` devices: forward, the tokens [b·e, T, D] and their routing
    [b·e, T, k] (experts int32, weights float32) all-gathered, the outputs reduce-scattered;
    backward, their transposes — the output gradients all-gathered, the input and weight
    gradients reduce-scattered (T: a device's part of the sequence under context
    parallelism, over whose axes the layer runs manual too)."""
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


def router_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """The routers' statistics summed over the devices that split a MoE layer's tokens
    (:func:`jaxpar.models.moe.route`: the batch's and the sequence's axes), a few bytes
    each but a collective's latency each, per MoE layer and microbatch: the forward's
    (each expert's load and summed probability, the z-loss) and, where the backward
    recomputes the layer, again (the load the balance loss's gradient reads); the
    backward's (the probabilities' gradient); with a capacity factor the dropped
    assignments counted, and under context parallelism the sequence's parts' expert
    choices gathered (again where recomputed); and the step's token count once (XLA
    hoists it out of the layer scan). Counted as XLA:CPU executes them at ``data=8``
    (``tests/test_analytic.py``); pipelines leave them out (their stages' counts per
    action are :mod:`jaxpar.lab.staged`'s, not yet the routers')."""
    layers = cfg.n_layers // cfg.moe_every if cfg.n_experts else 0
    batch = split_over(layout.rules, layout.sizes, BATCH)
    seq = tuple(a for a in split_over(layout.rules, layout.sizes, SEQ) if a not in batch)
    axes = batch + seq
    group = math.prod(layout.sizes[a] for a in axes)
    if group == 1 or not layers or layout.stages is not None:
        return []
    n = layout.grad_accum * layers
    again = n if remat_of(cfg) != "none" else 0
    E = cfg.n_experts
    summed = functools.partial(Term, "all-reduce", group=group, axes=axes)
    terms = [
        summed("routers: statistics summed", (2 * E + 1) * 4, times=n),
        summed("routers: load summed again", E * 4, times=again),
        summed("routers: statistics' gradient summed", (E + 1) * 4, times=n),
        summed("routers: tokens counted", 4, times=1),
    ]
    if getattr(cfg, "capacity_factor", 0):
        c = math.prod(layout.sizes[a] for a in seq)
        choices = microbatch_rows(layout) * layout.seq_len * cfg.top_k * 4
        terms += [
            summed("routers: dropped assignments counted", 4, times=n),
            Term("all-gather", "routers: expert choices gathered", choices, c, n + again, axes=seq),
        ]
    return [t for t in terms if t.times and t.group > 1]


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
    ``shard_map`` (manual over the batch and sequence axes only), so a grouped matmul's output rows,
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


def routed_rows(cfg: Any, layout: LabLayout) -> float:
    """``R``: the rows a device's grouped matmuls take in one MoE layer for one microbatch
    (the module docstring)."""
    tokens = microbatch_rows(layout) * device_tokens(layout)[0]
    return tokens * cfg.top_k * expert_degree(layout)


def local_experts(cfg: Any, layout: LabLayout) -> int:
    """The experts a device holds (``E/e``)."""
    return cfg.n_experts // expert_degree(layout)


def routed(cfg: Any, layout: LabLayout) -> Routed:
    """What the routed rows add to a device's activations (:class:`~jaxpar.lab.activations.
    Routed`): :data:`ROUTED_F` and :data:`ROUTED_D` widths a row kept in each MoE layer
    (averaged over the layers), and :data:`TRANSIENT_F` and :data:`TRANSIENT_D` a row held
    by one MoE layer's backward — once per local expert on the CPU."""
    if not getattr(cfg, "n_experts", 0):
        return NO_ROUTED
    rows = routed_rows(cfg, layout) * activation_itemsize(cfg, layout)
    f, d = cfg.d_ff / layout.sizes[Axis.TENSOR], cfg.d_model
    copies = local_experts(cfg, layout) if layout.cpu else 1
    return Routed(
        kept=rows * (ROUTED_F * f + ROUTED_D * d) / cfg.moe_every,
        transient=rows * copies * (TRANSIENT_F * f + TRANSIENT_D * d),
        recomputed=rows * copies * (RECOMPUTED_F * f + RECOMPUTED_D * d),
        group=cfg.moe_every,
    )


def expert_matmuls(cfg: Any, layout: LabLayout) -> list[Matmul]:
    """The routed experts' forward matmuls on one device over a step (gate and up as one
    of ``2F/t``, then down), as they run (the module docstring): on a GPU each local
    expert's balanced share of the device's ``b·s·k`` assignments against its weights; on
    the CPU every routed row against the stacked weights of every local expert."""
    if not getattr(cfg, "n_experts", 0):
        return []
    f, d = cfg.d_ff / layout.sizes[Axis.TENSOR], cfg.d_model
    times = cfg.n_layers // cfg.moe_every / layout.sizes[Axis.STAGE] * microbatches(layout)
    local = local_experts(cfg, layout)
    if layout.cpu:
        rows = routed_rows(cfg, layout)
        return [Matmul(rows, 2 * f, d * local, times), Matmul(rows, d, f * local, times)]
    rows = routed_rows(cfg, layout) / expert_degree(layout) / local  # its own b·s·k
    return [Matmul(rows, 2 * f, d, times * local), Matmul(rows, d, f, times * local)]


def expanded_flops(cfg: Any, layout: LabLayout) -> float:
    """The training FLOPs (forward and backward: 3 forwards) XLA:CPU's dense products add
    to the grouped ones the family counts (none elsewhere)."""
    if not layout.cpu:
        return 0.0
    grouped = dataclasses.replace(layout, cpu=False)
    flops = [sum(m.flops for m in expert_matmuls(cfg, x)) for x in (layout, grouped)]
    return 3 * (flops[0] - flops[1])
