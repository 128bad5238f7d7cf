"""The collectives tensor parallelism adds to a step of jaxpar's transformers (the families
of :mod:`jaxpar.lab.transformers`): Megatron's activation all-reduces, sequence
parallelism's gathers and reduce-scatters, collective matmuls' sends, the vocabulary-parallel
lookup's rows (:func:`jaxpar.tensor_parallel.lookup`) or the table's gather, and the first
stage's under the sub-mesh pipeline."""

from __future__ import annotations

import math
from typing import Any

from jaxpar.axes import Axis
from jaxpar.lab import experts
from jaxpar.lab.activations import KEPT_BY_NAME, SAVED, activation_itemsize
from jaxpar.lab.terms import LabLayout, Term, fp8_itemsize
from jaxpar.logical import ACT_SEQ, SEQ, split_over
from jaxpar.tensor_parallel import scatters_rows

#: the axes of tensor parallelism's activation collectives
TP = (Axis.TENSOR,)


def transformer_tensor_terms(
    cfg: Any,
    layout: LabLayout,
    backward: int = 2,
    norm_weights: int | None = None,
    columns: int = 2,
    inputs: int = 2,
    positions: bool = False,
) -> list[Term]:
    """Megatron's activation all-reduces: per layer two of ``[b, T, D]`` forward (attention
    and MLP outputs) and two backward (their inputs), one more for the head's input
    gradient; the cross-entropy over vocab-sharded logits all-reduces three ``[b, T]``
    statistics; the rows of a vocab-sharded embedding table are looked up where they lie
    and summed (:func:`jaxpar.tensor_parallel.lookup`: one all-reduce of the ``[b, T, D]``
    rows in float32 a microbatch, under sequence parallelism a reduce-scatter and their
    gradient's gather; :func:`_vocab_terms`). Under
    sequence parallelism (:func:`_sequence_parallel_terms`) ``norm_weights`` is a layer's
    norm weights (GPT's and BERT's two layer norms' scales and biases when None);
    overlapped by collective
    matmuls (:func:`_overlapped_terms`), ``columns`` is a layer's column-parallel
    projections (GPT's two: q, k, v stacked, and the MLP's first); in FP8, ``inputs`` is a
    layer's projections of the norms' outputs (GPT's two; the Llama's five), each of which
    quantizes and gathers its input apart; ``positions``: learned position rows ``[T, D]``
    are added to the looked-up rows (:meth:`TransformerLab.learned_positions`)."""
    t = layout.sizes[Axis.TENSOR]
    if t == 1:
        return []
    # a sequence split over the context axes: each device holds its part of every sequence
    split = math.prod(layout.sizes[a] for a in layout.rules.get(SEQ, ()))
    rows, seq, d = layout.rows, layout.seq_len // split, cfg.d_model
    activation = rows * seq * d * activation_itemsize(cfg, layout)
    # Without a pipeline: once per microbatch over all layers. In a pipeline every tick
    # counts as its costliest branch, the last stage's backward: its layers' recomputed
    # forward and backward plus the head, and the embedding of the first stage.
    k = layout.grad_accum
    norms = 4 * cfg.d_model if norm_weights is None else norm_weights
    rows_bytes = rows * seq * d * 4  # the rows looked up, float32 (the table's)
    # under sequence parallelism the learned positions' gradient, gathered (float32)
    positions_bytes = seq * d * 4 if positions and _scatters_rows(layout) else 0.0
    if layout.sub_mesh:
        sizes = (activation, rows_bytes, positions_bytes)
        return _first_stage_terms(cfg, layout, sizes, backward, norms)
    # a rematerialized block that keeps no attention output all-reduces it again (the MLP
    # output it recomputes feeds nothing in the backward pass: dead code)
    forward_again = int("out" not in SAVED[cfg.remat])
    if layout.stages is not None:
        ticks, p, v, m = layout.stages
        times = ticks * k
        layers = cfg.n_layers // (p * v)
        div = m * k
    else:
        times = k
        layers = cfg.n_layers
        div = k
    reductions = times * ((2 + backward + forward_again) * layers + 1)
    if (
        Axis.TENSOR in layout.rules.get(ACT_SEQ, ())
        and layout.tensor_overlap == "collective_matmul"
    ):
        chains = (times * layers * c for c in _chains(columns, cfg.remat))
        terms = _overlapped_terms(layout, activation / div, times, chains, 4 * norms * layers)
    elif Axis.TENSOR in layout.rules.get(ACT_SEQ, ()):
        counts = (times, layers, reductions, inputs)
        terms = _unoverlapped_terms(cfg, layout, activation, div, counts, 4 * norms * layers)
    else:
        terms = [Term("all-reduce", experts.MEGATRON, activation / div, t, reductions, axes=TP)]
    terms.append(
        Term("all-reduce", "cross-entropy statistics", rows * seq * 4 / div, t, 3 * times, axes=TP)
    )
    rows = (rows_bytes / div, positions_bytes)
    return terms + _vocab_terms(cfg, layout, rows, times, times)


def _vocab_terms(
    cfg: Any, layout: LabLayout, rows: tuple[float, float], times: int, backwards: int
) -> list[Term]:
    """A vocab-sharded table's: where ``tensor`` alone splits the vocabulary, ``times`` sums
    of the rows looked up where they lie (``rows``: their bytes, and those of the learned
    positions added to them; :func:`jaxpar.tensor_parallel.lookup`; in the one-program
    pipeline only the first stage's forward does: not the costliest branch, and none
    counted) — under sequence parallelism reduce-scatters, and each of the ``backwards``
    gathers the rows' gradient and the positions' (:func:`_scatters_rows`); split over
    more axes, the table gathered whole (once, in a pipeline once a tick)."""
    rows_bytes, positions_bytes = rows
    vocab = layout.rules.get("vocab", ())
    if Axis.TENSOR not in vocab:
        return []
    t = layout.sizes[Axis.TENSOR]
    if rows_lie(layout):
        if layout.stages is not None and not layout.sub_mesh:
            return []
        if _scatters_rows(layout):
            terms = [
                Term("reduce-scatter", LOOKUP, rows_bytes, t, times, axes=TP),
                Term("all-gather", LOOKUP_GRADIENT, rows_bytes, t, backwards, axes=TP),
            ]
            if positions_bytes:
                gathered = Term("all-gather", POSITIONS, positions_bytes, t, backwards, axes=TP)
                terms.append(gathered)
            return terms
        return [Term("all-reduce", LOOKUP, rows_bytes, t, times, axes=TP)]
    ticks = times if layout.stages is not None else 1
    table = cfg.vocab_size * cfg.d_model * 4
    return [Term("all-gather", "embedding table gather", table, t, ticks, axes=TP)]


def rows_lie(layout: LabLayout) -> bool:
    """Whether the tokens are looked up where the table's rows lie: ``tensor`` alone
    splits the vocabulary (:func:`jaxpar.tensor_parallel.lookup`)."""
    return split_over(layout.rules, layout.sizes, "vocab") == (Axis.TENSOR,)


def _scatters_rows(layout: LabLayout) -> bool:
    """Whether the rows looked up where they lie are reduce-scattered along the sequence
    (:func:`jaxpar.tensor_parallel.scatters_rows`), their gradient gathered in the backward
    in the embeddings' gradient's place."""
    return rows_lie(layout) and scatters_rows(layout.rules, layout.sizes, layout.seq_len)


#: what the lab calls the vocabulary-parallel lookup's sum (:func:`transformer_tensor_terms`)
LOOKUP = "embedding rows looked up where they lie, summed"
#: … and, under sequence parallelism, the gather of the scattered rows' gradient
LOOKUP_GRADIENT = "embedding rows' gradient gathered (sequence parallel)"
#: … and of the learned positions added to the rows each device keeps
POSITIONS = "learned positions' gradient gathered (sequence parallel)"
#: what the lab calls sequence parallelism's gathers (:func:`transformer_tensor_terms`)
SP_GATHERS = "sequence parallel: activations gathered before the column-parallel matmuls"
#: … and those of FP8 activations (``model.precision=fp8``): the partitioner gathers the
#: quantized activations the FP8 matmuls read, the layers' six (measured)
SP_FP8_GATHERS = "sequence parallel: FP8 activations gathered before the FP8 matmuls"


def _sequence_parallel_terms(
    layout: LabLayout, activation: float, counts: tuple[int, int], norms: tuple[int, int]
) -> list[Term]:
    """Sequence parallelism (``tensor.sequence``): each of Megatron's activation
    all-reduces becomes a reduce-scatter (XLA:CPU: an all-reduce of the whole activation
    and a slice), and activations are gathered before the column-parallel matmuls (per
    layer, measured: two forward, two of the output gradients before the row-parallel
    matmuls' transposes, two of the inputs again for the weight gradients, which a
    rematerialized block's recomputed forward provides; once for the head's input and once
    for the embeddings' gradient, where the lookup does not gather it itself:
    :func:`_scatters_rows`). ``counts``: the reductions and the gathers;
    ``norms``: the bytes of the norms' weight gradients — partial sums over the sequence's
    shards, all-reduced over ``tensor`` — and how often."""
    t = layout.sizes[Axis.TENSOR]
    kind = "all-reduce" if layout.cpu else "reduce-scatter"
    reductions, gathers = counts
    return [
        Term(
            kind,
            "sequence parallel: activations reduce-scattered",
            activation,
            t,
            reductions,
            axes=TP,
        ),
        Term("all-gather", SP_GATHERS, activation, t, gathers, axes=TP),
        Term("all-reduce", "sequence parallel: norm gradients", norms[0], t, norms[1], axes=TP),
    ]


def _unoverlapped_terms(
    cfg: Any, layout: LabLayout, activation: float, div: int, counts: tuple, norm_bytes: int
) -> list[Term]:
    """Sequence parallelism's terms without overlap (:func:`_sequence_parallel_terms`):
    per layer six gathers, and those of the head's input and the embeddings' gradient (in
    a pipeline tick's costliest branch, the last stage's backward, the head's only). In FP8
    the layers' gathers carry the quantized activations: each of the layer's ``inputs``
    projections gathers its own input twice (forward, weight gradient), and the two
    row-parallel ones their output gradients (measured). ``counts``: the passes, the
    layers, the reductions and the inputs."""
    times, layers, reductions, inputs = counts
    t = layout.sizes[Axis.TENSOR]
    # the head's input, and the embeddings' gradient (the lookup's own where it scatters)
    outside = times * (2 if layout.stages is None and not _scatters_rows(layout) else 1)
    gathers = times * 6 * layers
    terms = []
    if cfg.precision == "fp8":
        fp8 = activation / activation_itemsize(cfg, layout) * fp8_itemsize(layout.cpu) / div
        terms.append(
            Term("all-gather", SP_FP8_GATHERS, fp8, t, times * (2 * inputs + 2) * layers, axes=TP)
        )
        gathers = 0
    counts = (reductions, gathers + outside)
    return terms + _sequence_parallel_terms(layout, activation / div, counts, (norm_bytes, times))


def _chains(columns: int, remat: str) -> tuple[int, int]:
    """A layer's chains of t−1 sends under collective matmuls, measured: forward one per
    input of the column-parallel projections (XLA merges the chains of projections that
    share it: attention's and the MLP's) and one per row-parallel projection (2 each);
    backward one per projection (``columns`` + 2); a rematerialized block's recomputed
    forward (``remat``: the policy) gathers the two inputs again, which the weights'
    gradients read and no policy keeps, and reduce-scatters attention's output projection
    again unless the policy keeps its output by name (the MLP's output feeds nothing
    there): gpt_tiny at ``data=4,tensor=2`` under each policy, the compiled sends."""
    forward = 2 + 2
    again = 0 if remat == "none" else 2 + ("out" not in KEPT_BY_NAME[remat])
    return forward + columns + 2, again


def _overlapped_terms(
    layout: LabLayout, activation: float, times: int, chains: Any, norm_bytes: int
) -> list[Term]:
    """Sequence parallelism overlapped by collective matmuls (``tensor.overlap=
    collective_matmul``): each chain sends a sequence chunk (``activation`` / t) t−1
    times round the ring, hidden behind the matmul pieces; what stays exposed is the
    head's (its input gathered, its input gradient reduce-scattered), the embeddings'
    gradient gathered, and the norm gradients summed over ``tensor``."""
    t = layout.sizes[Axis.TENSOR]
    sends = sum(chains) * (t - 1)
    hidden = Term(
        "collective-permute", OVERLAP_SENDS, activation / t, t, sends, hidden=True, axes=TP
    )
    # the head's input, and the embeddings' gradient (the lookup's own where it scatters)
    scatters = layout.stages is None and _scatters_rows(layout)
    counts = (times, (1 if scatters else 2) * times)
    return [hidden, *_sequence_parallel_terms(layout, activation, counts, (norm_bytes, times))]


#: what the lab calls the collective matmuls' sends (:func:`_overlapped_terms`)
OVERLAP_SENDS = "tensor overlap: sequence chunks passed round the tensor group"


def _first_stage_terms(
    cfg: Any,
    layout: LabLayout,
    sizes: tuple[float, float, float],
    backward: int,
    norm_weights: int,
) -> list[Term]:
    """A device of the first stage under the sub-mesh pipeline, a program per action: each
    microbatch's forward all-reduces twice a layer, its backward (or weight-gradient half:
    the first chunk has no input gradient) four times — the recomputed forward's and both
    input gradients' — in each of the stage's ``v`` chunks (a one-layer chunk's backward
    three), and the first chunk's two programs each sum the rows looked up where a
    vocab-sharded table's rows lie (:func:`_vocab_terms`). ``sizes``: a step's activation,
    looked-up rows and learned positions' gradient (under sequence parallelism). Under
    sequence parallelism those reductions are reduce-scatters, and each microbatch gathers eight
    activations a layer (two forward, two recomputed, two output gradients, two inputs for
    the weight gradients) and one for the embeddings' gradient (measured; the lookup's own
    where it scatters the rows: :func:`_vocab_terms`)."""
    t = layout.sizes[Axis.TENSOR]
    k = layout.grad_accum
    _, p, v, m = layout.stages
    activation, rows_bytes, positions_bytes = sizes
    layers = cfg.n_layers // p  # the stage's, over its v chunks
    # a one-layer chunk's recomputed MLP output feeds nothing in its backward: XLA drops
    # its all-reduce where no loop over layers is left to share it (measured)
    dropped = v if layers == v else 0
    # reading the forward's residuals, the backward recomputes nothing (no second forward)
    forwards = 1 if layout.residuals else 2
    reductions = m * k * ((2 * forwards + backward) * layers - dropped * (forwards - 1))
    if Axis.TENSOR in layout.rules.get(ACT_SEQ, ()):
        counts = (reductions, m * k * (8 * layers + (not _scatters_rows(layout))))
        norms = (4 * norm_weights * layers, m * k)
        terms = _sequence_parallel_terms(layout, activation / (m * k), counts, norms)
    else:
        terms = [Term("all-reduce", experts.MEGATRON, activation / (m * k), t, reductions, axes=TP)]
    rows = (rows_bytes / (m * k), positions_bytes)
    return terms + _vocab_terms(cfg, layout, rows, forwards * m * k, m * k)
