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
    a stack of one layer:   alone·(a layer)   (no loop: XLA keeps less; t = 1)
    the head:               4·b·s·V·head/t  (float32 logits, their softmax and gradient)
    the step:               layers·in_flight·(a layer) + the head
    the step under remat:   layers·in_flight·(a layer under remat) + the head
                            + recompute·(a layer)   (what the recomputing backward holds)

where ``t_sp`` is ``t`` under sequence parallelism and 1 without, ``layers`` the layers a
device holds in one chunk (over ``stage`` and virtual stages), and ``in_flight`` the most
microbatch chunks a pipeline's device holds activations of at once (1 without a pipeline).

The same shapes give what else the estimate reads of a transformer
(:mod:`jaxpar.lab.kernels`, :mod:`jaxpar.lab.analytic`): its matmuls on one device, the
bytes its other kernels move (passes over what a layer keeps), the share of a layer a
recomputation runs again, and the FLOPs of key and value heads held whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.lab.terms import LabLayout, Matmul
from jaxpar.logical import ACT_SEQ, SEQ, split_over


@dataclass(frozen=True)
class Kept:
    """A family's activation counts per token (the module docstring): multiples of ``D``
    held whole over ``tensor`` (``replicated``), of q, k and v's width split
    (``attention``), of ``F`` split (``mlp``), of the [heads, keys] scores split
    (``scores``), of ``D`` per layer under ``model.remat=full`` (``remat``) and of the
    vocabulary in float32 at the head (``head``); and, under ``model.remat=full``, the
    share of a layer's kept bytes live while the backward recomputes it (``recompute``: a
    layer's are freed as its gradients are made, where a scan of groups of layers holds
    a group's); and the share a stack of one layer holds (``alone``: XLA removes a loop of
    one trip, and with the layer's forward and backward in one computation recomputes
    cheap elementwise results in the backward rather than keep them); and the multiples of
    ``D`` a layer keeps beside its input and the values a saving policy names (``saved``:
    ``save_qkv``, ``save_out``, ``save_matmuls``, ``save_dots``; measured per layer as the
    other counts: none for GPT and the Llama, 3 for Gemma's norms); and whether the
    backward reads the MLP's output (``mlp_out``, 1: a norm after the MLP), so that a
    policy naming it keeps it and a recomputation runs it again."""

    replicated: float
    attention: float
    mlp: float
    scores: float
    remat: float
    head: float
    recompute: float = 1.0
    alone: float = 1.0
    saved: float = 0.0
    mlp_out: float = 0.0


@dataclass(frozen=True)
class Routed:
    """What a mixture of experts' routed tokens add beside the counts (:mod:`jaxpar.lab.
    experts`), on one device for one microbatch: the bytes a layer keeps for its backward,
    averaged over the layers (``kept``), the bytes one MoE layer's backward holds at once
    beyond them (``transient``) and, where it recomputes the layer, its forward
    (``recomputed``), and the layers a recomputing backward holds at once (``group``)."""

    kept: float = 0.0
    transient: float = 0.0
    #: what a recomputed MoE layer's forward holds beside that
    recomputed: float = 0.0
    #: the layers a recomputing backward holds at once (a scan step's)
    group: int = 1


#: a dense model's: nothing routed
NO_ROUTED = Routed()


#: a layer's forward matmuls, in :func:`transformer_matmuls`' order
LAYER_MATMULS = ("qkv", "out", "mlp_in", "mlp_out", "scores", "values")
#: the layer's matmul outputs the backward finds without recomputing them under each
#: ``model.remat`` (:data:`jaxpar.models.transformer.REMAT_POLICIES`): all without remat;
#: the named projections' under the saving policies (``offload``'s on the host), and
#: attention's weighted values (its output) under ``save_matmuls_context``; every dot's
#: under ``save_dots``, attention's scores and weighted values included
SAVED = {
    "none": LAYER_MATMULS,
    "full": (),
    "save_qkv": ("qkv",),
    "save_out": ("out", "mlp_out"),
    "save_matmuls": ("qkv", "out", "mlp_in", "mlp_out"),
    "save_matmuls_context": ("qkv", "out", "mlp_in", "mlp_out", "values"),
    "offload": ("qkv", "out", "mlp_in", "mlp_out"),
    "save_dots": LAYER_MATMULS,
}


#: the layer values each policy keeps under their names: :data:`SAVED`'s but for
#: ``save_dots``, which keeps the dots' products, before what follows them. A collective
#: between a matmul and a named value (a row-parallel projection's reduce-scatter under
#: collective matmuls, Ulysses's exchange of attention's output) is not run again where
#: the recomputation finds that value kept
KEPT_BY_NAME = {**SAVED, "save_dots": ()}


def remat_of(cfg: Any) -> str:
    """The config's ``model.remat`` (``none`` for a model without one)."""
    return getattr(cfg, "remat", "none")


def recomputes(cfg: Any, layout: LabLayout) -> bool:
    """Whether a layer's forward runs again for its backward: under ``model.remat``, or in
    a pipeline that recomputes its chunks (not the sub-mesh executor's kept residuals)."""
    return remat_of(cfg) != "none" or (layout.stages is not None and not layout.residuals)


def activation_bytes(
    cfg: Any,
    layout: LabLayout,
    kept: Kept,
    fused_attention: bool,
    gated: bool = False,
    routed: Routed = NO_ROUTED,
) -> float:
    """Bytes of the activations one device holds at the peak of a step (the module
    docstring); ``fused_attention``: a kernel recomputes the scores (none kept); under a
    saving ``model.remat``, what :func:`saved_layer_bytes` counts a layer; ``routed``: a
    mixture of experts' routed tokens, kept in every layer and held at the peak."""
    layer = layer_bytes(cfg, layout, kept, fused_attention) + routed.kept
    layers = layers_per_chunk(cfg, layout)
    # beside the layers: the head's logits, and what one MoE layer's backward holds at
    # once (and its recomputed forward, where one runs)
    beside = head_bytes(cfg, layout, kept) + routed.transient
    beside += routed.recomputed * recomputes(cfg, layout)
    # a recomputing backward holds a scan step's layers: a group of them in a mixture of
    # experts (every moe_every-th an MoE layer)
    layer_recomputed = layer * kept.recompute * routed.group
    # a stack of one layer, no loop (measured without tensor parallelism: under it counted
    # as a loop's layer)
    alone = layers == 1 and layout.sizes[Axis.TENSOR] == 1
    stacked = layer * (kept.alone if alone else 1.0)
    block_input = (
        activation_itemsize(cfg, layout) * microbatch_rows(layout) * device_tokens(layout)[0]
    )
    block_input *= cfg.d_model
    if layout.stages is not None and not layout.residuals:
        # a pipeline's backward recomputes its chunk from the chunk's input: a device keeps
        # one input per microbatch in flight, and one chunk's layers while recomputing
        return layout.in_flight * block_input + layers * stacked + beside
    policy = remat_of(cfg)
    if policy in ("full", "offload"):  # offload's saved values live on the host
        # the saved inputs: a scan step's (a group's, in a mixture of experts)
        inputs = layers / routed.group * layout.in_flight * block_input * kept.remat
        return inputs + beside + layer_recomputed
    if policy != "none":  # and while a layer is recomputed, what it did not keep
        saved = saved_layer_bytes(cfg, layout, kept, fused_attention, gated)
        unsaved = (1 - saved / layer) * layer_recomputed
        return layers * layout.in_flight * saved + beside + unsaved
    return layers * layout.in_flight * stacked + beside


def saved_layer_bytes(
    cfg: Any, layout: LabLayout, kept: Kept, fused_attention: bool, gated: bool
) -> float:
    """Bytes one layer keeps for one microbatch on one device under a saving
    ``model.remat``: its input and :attr:`Kept.saved` more widths of ``D``, and the outputs
    the policy names (:data:`SAVED`): q, k and v's, the attention and MLP outputs (``D``,
    split as the stream; the MLP's only where the backward reads it,
    :attr:`Kept.mlp_out`), the MLP's first (a gated one's two widths), and under
    ``save_dots`` attention's weighted values and scores (none where a fused kernel
    computes them). Against the compiled programs' bytes a layer (gpt_tiny, llama_tiny and
    gemma_tiny at 4 and 8 layers, ``data=8``, less the layer's gradients): equal to 4%
    under ``save_qkv``, ``save_matmuls`` and ``save_dots``; under ``save_out`` 18–44% short
    for GPT and the Llama (XLA keeps more than the two outputs there)."""
    t, t_sp = layout.sizes[Axis.TENSOR], _sequence_parallel(layout)
    s, keys, _ = device_tokens(layout)
    b, names = microbatch_rows(layout), SAVED[remat_of(cfg)]
    widths = {
        "qkv": q_k_v_width(cfg) / t,
        "out": cfg.d_model / t_sp,
        "mlp_in": cfg.d_ff * (2 if gated else 1) / t * dense_mlps(cfg),
        "mlp_out": cfg.d_model / t_sp * kept.mlp_out * dense_mlps(cfg),
        "values": cfg.n_heads * head_dim(cfg) / t,
        "scores": 0.0,
    }
    width = cfg.d_model * (1 + kept.saved) / t_sp + sum(widths[n] for n in names)
    scores = "scores" in names and not fused_attention
    return activation_itemsize(cfg, layout) * b * (s * width + scores * cfg.n_heads * s * keys / t)


#: HBM passes over each byte a layer keeps, for the bytes its kernels other than matmuls
#: move (:mod:`jaxpar.lab.kernels`), counted rather than measured: the forward writes it
#: and the next kernel reads it (2); the backward reads it, and writes and reads its
#: gradient (3); a forward run again for the backward (recomputation) writes and reads it
#: once more (2)
FORWARD_PASSES, BACKWARD_PASSES, RECOMPUTE_PASSES = 2, 3, 2


def elementwise_bytes(
    cfg: Any, layout: LabLayout, kept: Kept, fused_attention: bool, routed: Routed = NO_ROUTED
) -> float:
    """HBM bytes one device's kernels other than matmuls move in a step: the passes over
    each byte its layers (and their routed tokens) and head keep (:data:`FORWARD_PASSES`
    …), every microbatch."""
    passes = FORWARD_PASSES + BACKWARD_PASSES + RECOMPUTE_PASSES * recomputes(cfg, layout)
    layers = cfg.n_layers / layout.sizes[Axis.STAGE]
    layer = layer_bytes(cfg, layout, kept, fused_attention) + routed.kept
    # the head runs on the last stage: a device's share of it
    head = (FORWARD_PASSES + BACKWARD_PASSES) * head_bytes(cfg, layout, kept)
    head /= layout.sizes[Axis.STAGE]
    return microbatches(layout) * (passes * layers * layer + head)


def transformer_matmuls(cfg: Any, layout: LabLayout, gated: bool) -> list[Matmul]:
    """A transformer's forward matmuls on one device over a step: the projections (q, k
    and v as one), the MLP's two (a gated one's first makes two widths), attention's
    scores and weighted values per head (each ring step's keys under ring attention),
    and the head; the projections and the MLP's in FP8 under ``model.precision=fp8``. A
    mixture of experts' dense MLPs only (:func:`dense_mlps`; its routed ones:
    :func:`jaxpar.lab.experts.expert_matmuls`)."""
    t = layout.sizes[Axis.TENSOR]
    s, keys, c = device_tokens(layout)
    steps = microbatches(layout)
    layers = cfg.n_layers / layout.sizes[Axis.STAGE] * steps
    m, d, hd = microbatch_rows(layout) * s, cfg.d_model, head_dim(cfg)
    per_head = (
        layers * microbatch_rows(layout) * cfg.n_heads / t * (c if layout.context == "ring" else 1)
    )
    kv = q_k_v_width(cfg) - cfg.n_heads * hd  # held whole where not split as the queries
    whole = layout.rules.get("kv_heads", ()) != layout.rules.get("heads", ())
    fp8 = getattr(cfg, "precision", "default") == "fp8"  # the weight matmuls
    mlps = layers * dense_mlps(cfg)
    return [
        Matmul(m, cfg.n_heads * hd / t + (kv if whole else kv / t), d, layers, fp8),
        Matmul(m, d, cfg.n_heads * hd / t, layers, fp8),
        Matmul(m, cfg.d_ff * (2 if gated else 1) / t, d, mlps, fp8),
        Matmul(m, d, cfg.d_ff / t, mlps, fp8),
        Matmul(s, keys, hd, per_head),
        Matmul(s, hd, keys, per_head),
        Matmul(m, cfg.vocab_size / t, d, steps),
    ]


#: attention's two matmuls, which cuDNN's fused kernel computes in one call
ATTENTION_MATMULS = ("scores", "values")


def recomputed_share(
    cfg: Any,
    layout: LabLayout,
    gated: bool,
    policy: str = "full",
    reads_mlp_out: bool = False,
    fused_attention: bool = False,
    routed: Sequence[Matmul] = (),
) -> float:
    """The share of a layer's forward FLOPs a recomputation under ``policy`` runs again:
    every matmul whose output it does not keep (:data:`SAVED`) but the MLP's output
    projection where the backward does not read its output (``reads_mlp_out``: Gemma's
    does; elsewhere XLA leaves it out: gpt_tiny's recomputing backward measured 2.72
    forwards, its MLP output 25% of a layer's). The compiled FLOPs of gpt_tiny and
    llama_tiny under every policy, and gemma_tiny's, are the estimate's to 0.3%.

    ``fused_attention`` (cuDNN's kernel, on a GPU): a recomputing policy runs attention's
    forward call again whatever it keeps, for its softmax statistics, which no policy
    saves (the step compiled for an H200 under ``save_dots`` runs it twice:
    ``tests/test_analytic.py``).

    ``routed``: a mixture of experts' routed matmuls (:func:`jaxpar.lab.experts.
    expert_matmuls`), which no policy names, so every recomputation runs them again; the
    routing weights' gradient reads their output, and a group of layers recomputes its
    dense MLPs' outputs, which the next layer reads (llama_tiny with 4 experts: the
    compiled step's FLOPs under full, save_matmuls and save_dots to 0.1%)."""
    *layer, _head = transformer_matmuls(cfg, layout, gated)
    read = reads_mlp_out or bool(routed)
    saved = {*SAVED[policy], *(("mlp_out",) if not read else ())}
    if fused_attention and policy != "none":
        saved -= set(ATTENTION_MATMULS)
    again = sum(m.flops for m, name in zip(layer, LAYER_MATMULS) if name not in saved)
    again += sum(m.flops for m in routed)
    return again / sum(m.flops for m in (*layer, *routed))


def fused_backward_share(
    cfg: Any, layout: LabLayout, gated: bool, routed: Sequence[Matmul] = ()
) -> float:
    """The share of a layer's forward FLOPs (its ``routed`` experts' among them) cuDNN's
    fused attention backward computes beyond XLA's backward: the scores again
    (FlashAttention-2 keeps only the softmax statistics), :func:`jaxpar.hlo.program_cost`'s
    five products against four."""
    *layer, _head = transformer_matmuls(cfg, layout, gated)
    scores = layer[LAYER_MATMULS.index("scores")].flops
    return scores / sum(m.flops for m in (*layer, *routed))


def unsplit_kv_flops(cfg: Any, layout: LabLayout) -> float:
    """Training FLOPs a device computes beyond its 1/t share where the key and value heads
    are not split over ``tensor`` as the query heads are (held whole): their projections,
    forward and backward, for all of the device's tokens, the forward only under sequence
    parallelism (checked against the compiled step: ``tests/test_analytic.py``)."""
    t = layout.sizes[Axis.TENSOR]
    if t == 1 or layout.rules.get("kv_heads", ()) == layout.rules.get("heads", ()):
        return 0.0
    width = 2 * getattr(cfg, "n_kv_heads", cfg.n_heads) * head_dim(cfg)
    tokens = layout.rows * device_tokens(layout)[0]
    layers = cfg.n_layers / layout.sizes[Axis.STAGE]
    # under sequence parallelism only the forward runs on the whole (gathered) sequence:
    # the backward's matmuls split it (measured: a third of the extra, Llama tensor=4)
    passes = 1 if _sequence_parallel(layout) > 1 else 3
    return passes * 2 * tokens * cfg.d_model * width * (1 - 1 / t) * layers


def microbatches(layout: LabLayout) -> int:
    """The microbatches a device runs in a step (accumulated and pipelined)."""
    return layout.grad_accum * (layout.stages[3] if layout.stages else 1)


def microbatch_rows(layout: LabLayout) -> float:
    """The rows one device computes at once: a microbatch's (``b``)."""
    return layout.rows / layout.grad_accum / (layout.stages[3] if layout.stages else 1)


def layers_per_chunk(cfg: Any, layout: LabLayout) -> float:
    """The layers of one pipeline chunk a device holds (all of its layers without virtual
    stages)."""
    return cfg.n_layers / layout.sizes[Axis.STAGE] / (layout.stages[2] if layout.stages else 1)


def device_tokens(layout: LabLayout) -> tuple[float, float, int]:
    """``(s, S, c)``: a device's queries, the keys each sees, the context degree."""
    c = math.prod(layout.sizes[a] for a in split_over(layout.rules, layout.sizes, SEQ))
    s = layout.seq_len / c
    return s, (s if layout.context == "ring" else layout.seq_len), c


def _sequence_parallel(layout: LabLayout) -> int:
    """How many ways sequence parallelism splits the residual stream beyond ``context``
    (``t`` under ``tensor.sequence``, else 1)."""
    sizes = layout.sizes
    c = device_tokens(layout)[2]
    sequence = math.prod(sizes[a] for a in split_over(layout.rules, sizes, ACT_SEQ))
    return sequence // c if sequence > c else 1


def activation_itemsize(cfg: Any, layout: LabLayout) -> int:
    """Bytes of an activation element (XLA:CPU holds bfloat16 as float32)."""
    return 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize


def layer_bytes(cfg: Any, layout: LabLayout, kept: Kept, fused_attention: bool) -> float:
    """Bytes one layer keeps for one microbatch on one device (the module docstring)."""
    t = layout.sizes[Axis.TENSOR]
    s, keys, _ = device_tokens(layout)
    t_sp = _sequence_parallel(layout)
    b = microbatch_rows(layout)
    scores = 0.0 if fused_attention else kept.scores * b * cfg.n_heads * s * keys / t
    split = q_k_v_width(cfg) * kept.attention + cfg.d_ff * kept.mlp * dense_mlps(cfg)
    return activation_itemsize(cfg, layout) * (
        b * s * (cfg.d_model * kept.replicated / t_sp + split / t) + scores
    )


def dense_mlps(cfg: Any) -> float:
    """Dense SwiGLU MLPs of width ``d_ff`` per layer: 1 in a dense model; in a mixture of
    experts, the layers between its MoE ones (every ``moe_every``-th) and its shared experts
    (``n_shared_experts``, each one's worth), over the layers."""
    if not getattr(cfg, "n_experts", 0):
        return 1.0
    return (cfg.moe_every - 1 + cfg.n_shared_experts) / cfg.moe_every


def head_bytes(cfg: Any, layout: LabLayout, kept: Kept) -> float:
    """Bytes the head keeps for one microbatch on one device: float32 logits."""
    s = device_tokens(layout)[0]
    return 4 * microbatch_rows(layout) * s * cfg.vocab_size * kept.head / layout.sizes[Axis.TENSOR]


def q_k_v_width(cfg: Any) -> int:
    """q, k and v's width together."""
    return (cfg.n_heads + 2 * getattr(cfg, "n_kv_heads", cfg.n_heads)) * head_dim(cfg)


def head_dim(cfg: Any) -> int:
    """A head's width: the config's (``head_dim``), else ``d_model / n_heads``."""
    return getattr(cfg, "head_dim", cfg.d_model // cfg.n_heads)
