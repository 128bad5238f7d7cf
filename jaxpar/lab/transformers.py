"""What the layout lab knows of jaxpar's transformer families (GPT, BERT, the Llama family
and Gemma; their layers: :mod:`jaxpar.models.transformer`): the collectives tensor and
context parallelism add to a step, and, for a Llama with experts, the experts' own
(:mod:`jaxpar.lab.experts`). Registered by family name in :data:`LABS`."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.lab import experts
from jaxpar.lab.terms import LabLayout, LabModel, Term
from jaxpar.logical import SEQ
from jaxpar.models.bert import BERT_FAMILY
from jaxpar.models.gemma import GEMMA_FAMILY
from jaxpar.models.gpt import GPT_FAMILY
from jaxpar.models.llama import LLAMA_FAMILY


def transformer_tensor_terms(cfg: Any, layout: LabLayout, backward: int = 2) -> list[Term]:
    """Megatron's activation all-reduces: per layer two of ``[b, T, D]`` forward (attention
    and MLP outputs) and two backward (their inputs), one more for the head's input
    gradient; the cross-entropy over vocab-sharded logits all-reduces three ``[b, T]``
    statistics; a vocab-sharded embedding table is gathered."""
    t = layout.sizes[Axis.TENSOR]
    if t == 1:
        return []
    # a sequence split over the context axes: each device holds its part of every sequence
    split = math.prod(layout.sizes[a] for a in layout.rules.get(SEQ, ()))
    rows, seq, d = layout.rows, layout.seq_len // split, cfg.d_model
    activation = rows * seq * d * (4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize)
    # Without a pipeline: once per microbatch over all layers. In a pipeline every tick
    # counts as its costliest branch, the last stage's backward: its layers' recomputed
    # forward and backward plus the head, and the embedding of the first stage.
    k = layout.grad_accum
    if layout.sub_mesh:
        return _first_stage_terms(cfg, layout, activation, backward)
    # a rematerialized block all-reduces its attention output again (the MLP output it
    # recomputes feeds nothing in the backward pass: dead code)
    forward_again = 1 if cfg.remat == "full" else 0
    if layout.stages is not None:
        ticks, p, v, m = layout.stages
        times = ticks * k
        layers = cfg.n_layers // (p * v)
        div = m * k
    else:
        times = k
        layers = cfg.n_layers
        div = k
    terms = [
        Term(
            "all-reduce",
            experts.MEGATRON,
            activation / div,
            t,
            times * ((2 + backward + forward_again) * layers + 1),
        ),
        Term("all-reduce", "cross-entropy statistics", rows * seq * 4 / div, t, 3 * times),
    ]
    if Axis.TENSOR in layout.rules.get("vocab", ()):
        # loop-invariant: XLA gathers the table once for all microbatches
        terms.append(
            Term(
                "all-gather",
                "embedding table gather",
                cfg.vocab_size * d * 4,
                t,
                times if layout.stages is not None else 1,
            )
        )
    return terms


def _first_stage_terms(cfg: Any, layout: LabLayout, activation: float, backward: int) -> list[Term]:
    """A device of the first stage under the sub-mesh pipeline, a program per action: each
    microbatch's forward all-reduces twice a layer, its backward (or weight-gradient half:
    the first chunk has no input gradient) four times — the recomputed forward's and both
    input gradients' — and each of the two gathers a vocab-sharded table."""
    t = layout.sizes[Axis.TENSOR]
    k = layout.grad_accum
    _, p, v, m = layout.stages
    layers = cfg.n_layers // (p * v)
    terms = [
        Term(
            "all-reduce",
            experts.MEGATRON,
            activation / (m * k),
            t,
            m * k * (4 + backward) * layers,
        )
    ]
    if Axis.TENSOR in layout.rules.get("vocab", ()):
        terms.append(
            Term(
                "all-gather",
                "embedding table gather",
                cfg.vocab_size * cfg.d_model * 4,
                t,
                2 * m * k,
            )
        )
    return terms


def transformer_context_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """Attention across ``c`` devices of a split sequence, per layer. ``all_gather``: K and
    V gathered in the forward (again in a rematerialized backward), dK and dV
    reduce-scattered in the backward, the positions gathered once. ``ring``: K and V pass
    c−1 blocks on in the forward and again in the backward, where dK and dV travel with
    them and home (c sends); the positions' c−1 sends are the same for every layer.
    Without a pipeline (inside one, the lab predicts no context terms yet)."""
    c = math.prod(layout.sizes[a] for a in layout.rules.get(SEQ, ()))
    if c == 1 or layout.stages is not None:
        return []
    k, L, T = layout.grad_accum, cfg.n_layers, layout.seq_len
    # grouped-query attention gathers its K key/value heads, unless they are repeated to
    # the query heads first (ring, or key/value heads not split as the query heads are)
    rules = layout.rules
    n_kv = getattr(cfg, "n_kv_heads", cfg.n_heads)
    grouped = (
        n_kv != cfg.n_heads
        and layout.context != "ring"
        and rules.get("kv_heads", ()) == rules.get("heads", ())
    )
    width = (n_kv if grouped else cfg.n_heads) * cfg.head_dim
    heads = math.prod(layout.sizes[a] for a in rules.get("kv_heads" if grouped else "heads", ()))
    itemsize = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
    kv = layout.rows * T * width // heads * itemsize / k  # one of K, V: whole sequence
    # measured: a tied table's two gradients (the lookup's, the head's) reduced apart
    tied = (
        [
            Term(
                "all-reduce",
                "context: tied table gradient reduced over context",
                cfg.vocab_size * cfg.d_model * 4,
                c,
            )
        ]
        if getattr(cfg, "tie_embeddings", False)
        else []
    )
    if layout.context == "ring":  # a custom VJP: a rematerialized block keeps its result
        block = kv / c
        return [
            *tied,
            Term(
                "collective-permute",
                "context: K and V blocks round the ring",
                block,
                c,
                k * L * 2 * (c - 1) * 2,
            ),
            Term(
                "collective-permute",
                "context: dK and dV blocks home",  # float32
                block * 4 / itemsize,
                c,
                k * L * 2 * c,
            ),
            Term("collective-permute", "context: positions round the ring", T // c * 4, c, c - 1),
        ]
    forward = 2 if cfg.remat != "none" else 1
    return [
        *tied,
        Term("all-gather", "context: K and V gathered", kv, c, k * L * 2 * forward),
        Term("reduce-scatter", "context: dK and dV reduce-scattered", kv, c, k * L * 2),
        Term("all-gather", "context: positions gathered", T * 4, c, 1),
    ]


class TransformerLab(LabModel):
    """What the lab knows of jaxpar's transformers (GPT and BERT)."""

    whole_params = frozenset({"embed"})  # tokens are looked up in the whole table
    #: activation all-reduces per layer in the backward pass under tensor parallelism: the
    #: input gradients of the attention's projection (q, k, v stacked: one sum) and of the
    #: MLP's first matmul
    backward_all_reduces = 2

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_tensor_terms(cfg, layout, self.backward_all_reduces)

    def context_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_context_terms(cfg, layout)


class GemmaLab(TransformerLab):
    """The lab's Gemma: the Llama's projections (q, k, v, gate and up each give the
    backward an input gradient that XLA all-reduces apart under tensor parallelism; 4
    where the key/value heads are not split as the query heads are)."""

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return transformer_tensor_terms(cfg, layout, _projection_all_reduces(layout))


class LlamaLab(TransformerLab):
    """The lab's Llama: q, k, v and SwiGLU's gate and up each give the backward an input
    gradient that XLA all-reduces apart under tensor parallelism: 5 a layer (measured); 4
    unsplit key/value heads (XLA gathers some: 0.96×); experts:
    :func:`jaxpar.lab.experts.tensor_terms`."""

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        dense = transformer_tensor_terms(cfg, layout, _projection_all_reduces(layout))
        return experts.tensor_terms(cfg, layout, dense)

    def expert_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        return experts.dispatch_terms(cfg, layout)


def _projection_all_reduces(layout: LabLayout) -> int:
    """Input-gradient all-reduces a layer of separate q, k, v, gate and up projections
    gives the backward: 5, or 4 where the key/value heads are not split as the query heads
    are."""
    return 5 if layout.rules.get("kv_heads", ()) == layout.rules.get("heads", ()) else 4


#: What the lab knows of each transformer family, by family name.
LABS: dict[str, LabModel] = {
    GPT_FAMILY.name: TransformerLab(),
    BERT_FAMILY.name: TransformerLab(),
    LLAMA_FAMILY.name: LlamaLab(),
    GEMMA_FAMILY.name: GemmaLab(),
}
