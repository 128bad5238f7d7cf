"""What the layout lab knows of jaxpar's transformer families (GPT, BERT, the Llama family
and Gemma; their layers: :mod:`jaxpar.models.transformer`): the collectives tensor and
context parallelism add to a step, and, for a Llama with experts, the experts' own
(:mod:`jaxpar.lab.experts`). Registered by family name in :data:`LABS`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.errors import ConfigError
from jaxpar.lab import experts
from jaxpar.lab.activations import (
    Kept,
    activation_bytes,
    elementwise_bytes,
    recomputed_share,
    transformer_matmuls,
    unsplit_kv_flops,
)
from jaxpar.lab.context_terms import transformer_context_terms
from jaxpar.lab.terms import LabLayout, LabModel, Matmul, TableReads, Term, fp8_itemsize
from jaxpar.logical import ACT_SEQ, SEQ, split_over
from jaxpar.models.bert import BERT_FAMILY
from jaxpar.models.gemma import GEMMA_FAMILY
from jaxpar.models.gpt import GPT_FAMILY
from jaxpar.models.llama import LLAMA_FAMILY
from jaxpar.models.transformer import attention_implementation

#: the axes of tensor parallelism's activation collectives
TP = (Axis.TENSOR,)


def transformer_tensor_terms(
    cfg: Any,
    layout: LabLayout,
    backward: int = 2,
    norm_weights: int | None = None,
    columns: int = 2,
    inputs: int = 2,
) -> list[Term]:
    """Megatron's activation all-reduces: per layer two of ``[b, T, D]`` forward (attention
    and MLP outputs) and two backward (their inputs), one more for the head's input
    gradient; the cross-entropy over vocab-sharded logits all-reduces three ``[b, T]``
    statistics; the rows of a vocab-sharded embedding table are looked up where they lie
    and summed (:func:`jaxpar.tensor_parallel.lookup`: one all-reduce of the ``[b, T, D]``
    rows in float32 a microbatch; :func:`_vocab_terms`). Under
    sequence parallelism (:func:`_sequence_parallel_terms`) ``norm_weights`` is a layer's
    norm weights (GPT's and BERT's two layer norms' scales and biases when None);
    overlapped by collective
    matmuls (:func:`_overlapped_terms`), ``columns`` is a layer's column-parallel
    projections (GPT's two: q, k, v stacked, and the MLP's first); in FP8, ``inputs`` is a
    layer's projections of the norms' outputs (GPT's two; the Llama's five), each of which
    quantizes and gathers its input apart."""
    t = layout.sizes[Axis.TENSOR]
    if t == 1:
        return []
    # a sequence split over the context axes: each device holds its part of every sequence
    split = math.prod(layout.sizes[a] for a in layout.rules.get(SEQ, ()))
    rows, seq, d = layout.rows, layout.seq_len // split, cfg.d_model
    activation = rows * seq * d * _itemsize(cfg, layout)
    # Without a pipeline: once per microbatch over all layers. In a pipeline every tick
    # counts as its costliest branch, the last stage's backward: its layers' recomputed
    # forward and backward plus the head, and the embedding of the first stage.
    k = layout.grad_accum
    norms = 4 * cfg.d_model if norm_weights is None else norm_weights
    rows_bytes = rows * seq * d * 4  # the rows looked up, float32 (the table's)
    if layout.sub_mesh:
        return _first_stage_terms(cfg, layout, (activation, rows_bytes), backward, norms)
    # a rematerialized block that keeps no attention output all-reduces it again (the MLP
    # output it recomputes feeds nothing in the backward pass: dead code)
    forward_again = 1 if cfg.remat in ("full", "save_qkv") else 0
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
        chains = (times * layers * c for c in _chains(layout, columns, cfg.remat == "full"))
        terms = _overlapped_terms(layout, activation / div, times, chains, 4 * norms * layers)
    elif Axis.TENSOR in layout.rules.get(ACT_SEQ, ()):
        counts = (times, layers, reductions, inputs)
        terms = _unoverlapped_terms(cfg, layout, activation, div, counts, 4 * norms * layers)
    else:
        terms = [Term("all-reduce", experts.MEGATRON, activation / div, t, reductions, axes=TP)]
    terms.append(
        Term("all-reduce", "cross-entropy statistics", rows * seq * 4 / div, t, 3 * times, axes=TP)
    )
    return terms + _vocab_terms(cfg, layout, rows_bytes / div, times)


def _vocab_terms(cfg: Any, layout: LabLayout, rows_bytes: float, times: int) -> list[Term]:
    """A vocab-sharded table's: where ``tensor`` alone splits the vocabulary, ``times`` sums
    of ``rows_bytes`` rows looked up where they lie (:func:`jaxpar.tensor_parallel.lookup`;
    in the one-program pipeline only the first stage's forward does: not the costliest
    branch, and none counted); split over more axes, the table gathered whole (once, in a
    pipeline once a tick)."""
    vocab = layout.rules.get("vocab", ())
    if Axis.TENSOR not in vocab:
        return []
    t = layout.sizes[Axis.TENSOR]
    if _rows_lie(layout):
        spmd_pipeline = layout.stages is not None and not layout.sub_mesh
        return [] if spmd_pipeline else [Term("all-reduce", LOOKUP, rows_bytes, t, times, axes=TP)]
    ticks = times if layout.stages is not None else 1
    table = cfg.vocab_size * cfg.d_model * 4
    return [Term("all-gather", "embedding table gather", table, t, ticks, axes=TP)]


def _rows_lie(layout: LabLayout) -> bool:
    """Whether the tokens are looked up where the table's rows lie: ``tensor`` alone
    splits the vocabulary (:func:`jaxpar.tensor_parallel.lookup`)."""
    return split_over(layout.rules, layout.sizes, "vocab") == (Axis.TENSOR,)


#: what the lab calls the vocabulary-parallel lookup's sum (:func:`transformer_tensor_terms`)
LOOKUP = "embedding rows looked up where they lie, summed"
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
    for the embeddings' gradient). ``counts``: the reductions and the gathers;
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
    outside = times * (2 if layout.stages is None else 1)
    gathers = times * 6 * layers
    terms = []
    if cfg.precision == "fp8":
        fp8 = activation / _itemsize(cfg, layout) * fp8_itemsize(layout.cpu) / div
        terms.append(
            Term("all-gather", SP_FP8_GATHERS, fp8, t, times * (2 * inputs + 2) * layers, axes=TP)
        )
        gathers = 0
    counts = (reductions, gathers + outside)
    return terms + _sequence_parallel_terms(layout, activation / div, counts, (norm_bytes, times))


def _itemsize(cfg: Any, layout: LabLayout) -> int:
    """The bytes of an activation element on the wire (float32 on XLA:CPU)."""
    return 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize


def _chains(layout: LabLayout, columns: int, remat: bool) -> tuple[int, int]:
    """A layer's chains of t−1 sends under collective matmuls, measured: forward one per
    input of the column-parallel projections (XLA merges the chains of projections that
    share it: attention's and the MLP's) and one per row-parallel projection (2 each);
    backward one per projection (``columns`` + 2); a rematerialized block's recomputed
    forward, one fewer than the forward (the MLP's output feeds nothing there)."""
    forward = 2 + 2
    return forward + columns + 2, (forward - 1) if remat else 0


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
    counts = (times, 2 * times)
    return [hidden, *_sequence_parallel_terms(layout, activation, counts, (norm_bytes, times))]


#: what the lab calls the collective matmuls' sends (:func:`_overlapped_terms`)
OVERLAP_SENDS = "tensor overlap: sequence chunks passed round the tensor group"


def _first_stage_terms(
    cfg: Any,
    layout: LabLayout,
    sizes: tuple[float, float],
    backward: int,
    norm_weights: int,
) -> list[Term]:
    """A device of the first stage under the sub-mesh pipeline, a program per action: each
    microbatch's forward all-reduces twice a layer, its backward (or weight-gradient half:
    the first chunk has no input gradient) four times — the recomputed forward's and both
    input gradients' — in each of the stage's ``v`` chunks (a one-layer chunk's backward
    three), and the first chunk's two programs each sum the rows looked up where a
    vocab-sharded table's rows lie (:func:`_vocab_terms`). ``sizes``: a step's activation
    and looked-up rows. Under sequence
    parallelism those reductions are reduce-scatters, and each microbatch gathers eight
    activations a layer (two forward, two recomputed, two output gradients, two inputs for
    the weight gradients) and one for the embeddings' gradient (measured)."""
    t = layout.sizes[Axis.TENSOR]
    k = layout.grad_accum
    _, p, v, m = layout.stages
    activation, rows_bytes = sizes
    layers = cfg.n_layers // p  # the stage's, over its v chunks
    # a one-layer chunk's recomputed MLP output feeds nothing in its backward: XLA drops
    # its all-reduce where no loop over layers is left to share it (measured)
    dropped = v if layers == v else 0
    # reading the forward's residuals, the backward recomputes nothing (no second forward)
    forwards = 1 if layout.residuals else 2
    reductions = m * k * ((2 * forwards + backward) * layers - dropped * (forwards - 1))
    if Axis.TENSOR in layout.rules.get(ACT_SEQ, ()):
        counts = (reductions, m * k * (8 * layers + 1))
        norms = (4 * norm_weights * layers, m * k)
        terms = _sequence_parallel_terms(layout, activation / (m * k), counts, norms)
    else:
        terms = [Term("all-reduce", experts.MEGATRON, activation / (m * k), t, reductions, axes=TP)]
    return terms + _vocab_terms(cfg, layout, rows_bytes / (m * k), forwards * m * k)


class TransformerLab(LabModel):
    """What the lab knows of jaxpar's transformers (GPT and BERT)."""

    #: tokens are looked up in the whole table, but where ``tensor`` splits its
    #: vocabulary (:meth:`table_reads`)
    whole_params = frozenset({"embed"})
    sequence_parallel = True
    fp8_weights = frozenset({"wq", "wk", "wv", "wo", "w_in", "w_out"})
    #: activation all-reduces per layer in the backward pass under tensor parallelism: the
    #: input gradients of the attention's projection (q, k, v stacked: one sum) and of the
    #: MLP's first matmul
    backward_all_reduces = 2

    #: what a layer keeps for its backward pass (:mod:`jaxpar.lab.activations`), counted
    #: from XLA's programs for GPT and BERT (per token, in widths): the norms' and the
    #: residual's whole (10 D), q, k, v (3 of their width), the MLP's (6 F), attention's
    #: scores and probabilities (2); the block's input under remat; float32 logits and
    #: their gradient (2 V); under remat, 0.88 of a layer's kept bytes while its backward
    #: recomputes it: what XLA holds then varies with the rows a device computes (gpt_tiny:
    #: 38 of its 51 widths at 8 rows, at 4 and 8 layers; 39-45 at 4 rows; 52 at 2), and
    #: 0.88 × 51 sits between; a stack of one layer (no loop) 0.69 of a layer's: gpt_tiny
    #: with one layer at 4 rows a device 0.66, its one-layer pipeline chunks at 2 rows 0.72
    kept = Kept(
        replicated=10, attention=3, mlp=6, scores=2, remat=1, head=2, recompute=0.88, alone=0.69
    )

    #: the MLP's first matmul makes two widths (SwiGLU's and GeGLU's gate and up)
    gated = False

    def _kept(self, cfg: Any) -> Kept:
        """The family's counts; q and k norms (Qwen3, Gemma 3) keep their inputs and outputs
        too."""
        qk = 2 * bool(getattr(cfg, "qk_norm", False))
        return dataclasses.replace(self.kept, attention=self.kept.attention + qk)

    def activation_bytes(self, cfg: Any, layout: LabLayout) -> float | None:
        if getattr(cfg, "n_experts", 0):  # routed tokens: not counted yet
            return None
        return activation_bytes(cfg, layout, self._kept(cfg), _flash(cfg, layout))

    def matmuls(self, cfg: Any, layout: LabLayout) -> list[Matmul]:
        if getattr(cfg, "n_experts", 0):
            return []
        return transformer_matmuls(cfg, layout, self.gated)

    def recomputed_share(self, cfg: Any, layout: LabLayout) -> float:
        if getattr(cfg, "n_experts", 0):
            return 1.0
        return recomputed_share(cfg, layout, self.gated)

    def unsplit_flops(self, cfg: Any, layout: LabLayout) -> float:
        return unsplit_kv_flops(cfg, layout)

    def elementwise_bytes(self, cfg: Any, layout: LabLayout) -> float:
        if getattr(cfg, "n_experts", 0):
            return 0.0
        return elementwise_bytes(cfg, layout, self._kept(cfg), _flash(cfg, layout))

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_tensor_terms(cfg, layout, self.backward_all_reduces)

    def table_reads(self, cfg: Any, layout: LabLayout) -> TableReads:
        """The token table read where its rows lie where ``tensor`` alone splits the
        vocabulary (:func:`jaxpar.tensor_parallel.lookup`; in the one-program pipeline
        the executor reduces every gradient itself), else read whole."""
        vocab = _rows_lie(layout)
        spmd_pipeline = layout.stages is not None and not layout.sub_mesh
        if not vocab:
            return TableReads(whole=self.whole_params)
        if spmd_pipeline:
            return TableReads(whole=self.whole_params - {"embed"})
        table = frozenset({"embed"})
        apart = table if self.tied_apart(cfg) else frozenset()
        copies = table if getattr(cfg, "tie_embeddings", False) and not apart else frozenset()
        return TableReads(self.whole_params - table, table, apart, copies)

    def tied_apart(self, cfg: Any) -> bool:
        """Whether a tied output layer reads the table apart from the lookup (GPT's: no,
        both read one copy per batch shard: ``TableReads.copies``)."""
        return False

    def context_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_context_terms(cfg, layout)


#: the weights of the Llama's and Gemma's FP8 projections (a shared expert's too)
LLAMA_FP8 = frozenset(
    {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"}
)


class GemmaLab(TransformerLab):
    """The lab's Gemma: the Llama's projections (q, k, v, gate and up each give the
    backward an input gradient that XLA all-reduces apart under tensor parallelism; 4
    where the key/value heads are not split as the query heads are)."""

    fp8_weights = LLAMA_FP8
    gated = True

    def tied_apart(self, cfg: Any) -> bool:
        return cfg.tie_embeddings  # the tied head reads the table itself

    #: Gemma's four norms a layer and GeGLU (counted as GPT's are); under remat its scan of
    #: groups of the local/global pattern holds a group being recomputed (gemma_tiny: 85.5
    #: widths, 1.25 layers' kept bytes, at 4 and 8 layers)
    kept = Kept(replicated=19, attention=4, mlp=11, scores=2, remat=1, head=2, recompute=1.25)
    #: and keeps a copy of the stacked layers' weights beside their gradients (one layer's
    #: parameter bytes more per layer, at every batch size: measured)
    remat_layer_copies = 1

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_tensor_terms(
            cfg,
            layout,
            _projection_all_reduces(layout),
            _norm_weights(cfg, 4),
            _columns(layout),
            inputs=5,
        )


class LlamaLab(TransformerLab):
    """The lab's Llama: q, k, v and SwiGLU's gate and up each give the backward an input
    gradient that XLA all-reduces apart under tensor parallelism: 5 a layer (measured); 4
    unsplit key/value heads (XLA gathers some: 0.96×); experts:
    :func:`jaxpar.lab.experts.tensor_terms`."""

    fp8_weights = LLAMA_FP8
    gated = True

    def tied_apart(self, cfg: Any) -> bool:
        return cfg.tie_embeddings  # the tied head reads the table itself

    #: SwiGLU keeps its gate, up, activation and product: 8 F where GPT's MLP keeps 6;
    #: under remat, 0.88 of a layer's kept bytes while recomputing (llama_tiny: 38 of its
    #: 45.5 widths at 8 rows a device, 39-40 at 4, 46 at 2; as GPT's); a stack of one layer
    #: 0.82 (llama_tiny: 0.78 with one layer at 4 rows, 0.86 in one-layer pipeline chunks
    #: at 2; qwen3_tiny's chunks 0.80)
    kept = Kept(
        replicated=10, attention=3, mlp=8, scores=2, remat=1, head=2, recompute=0.88, alone=0.82
    )

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        dense = transformer_tensor_terms(
            cfg,
            layout,
            _projection_all_reduces(layout),
            _norm_weights(cfg, 2),
            _columns(layout),
            inputs=5,
        )
        return experts.tensor_terms(cfg, layout, dense)

    def expert_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return experts.dispatch_terms(cfg, layout)


def _flash(cfg: Any, layout: LabLayout) -> bool:
    """Whether attention runs as cuDNN's fused kernel, which keeps no [T, T] scores: on a
    GPU, where ``model.attention`` means ``cudnn``."""
    if layout.cpu or not hasattr(cfg, "attention"):
        return False
    try:
        return attention_implementation(cfg, "gpu") == "cudnn"
    except ConfigError:  # a setting cuDNN cannot run: XLA's attention
        return False


def _norm_weights(cfg: Any, norms: int) -> int:
    """A layer's norm weights: ``norms`` RMS norms of ``d_model`` (and per-head q and k
    norms with ``qk_norm``)."""
    return norms * cfg.d_model + 2 * cfg.head_dim * bool(getattr(cfg, "qk_norm", False))


def _columns(layout: LabLayout) -> int:
    """Column-parallel projections a layer of separate q, k, v, gate and up projections
    has: 5, or 3 where the key/value heads are not split over ``tensor``."""
    return 5 if layout.rules.get("kv_heads", ()) == layout.rules.get("heads", ()) else 3


def _projection_all_reduces(layout: LabLayout) -> int:
    """Input-gradient all-reduces a layer of separate q, k, v, gate and up projections
    gives the backward: 5, or 4 where the key/value heads are not split as the query heads
    are."""
    return 5 if layout.rules.get("kv_heads", ()) == layout.rules.get("heads", ()) else 4


class BertLab(TransformerLab):
    """The lab's BERT: GPT's counts, but a stack of one layer holds 0.83 of a layer's kept
    bytes (bert_tiny: 0.88 with one layer at 4 rows a device, 0.78 in one-layer pipeline
    chunks at 2)."""

    kept = dataclasses.replace(TransformerLab.kept, alone=0.83)

    def tied_apart(self, cfg: Any) -> bool:
        return True  # the masked-LM head reads the table itself


#: What the lab knows of each transformer family, by family name.
LABS: dict[str, LabModel] = {
    GPT_FAMILY.name: TransformerLab(),
    BERT_FAMILY.name: BertLab(),
    LLAMA_FAMILY.name: LlamaLab(),
    GEMMA_FAMILY.name: GemmaLab(),
}
