"""What the layout lab knows of jaxpar's transformer families (GPT, BERT, the Llama family
and Gemma; their layers: :mod:`jaxpar.models.transformer`): the collectives tensor
(:mod:`jaxpar.lab.tensor_terms`) and context parallelism (:mod:`jaxpar.lab.context_terms`)
add to a step, and, for a Llama with experts, the experts' own (:mod:`jaxpar.lab.experts`).
Registered by family name in :data:`LABS`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.lab import experts
from jaxpar.lab.activations import (
    Kept,
    activation_bytes,
    activation_itemsize,
    elementwise_bytes,
    fused_backward_share,
    recomputed_share,
    transformer_matmuls,
    unsplit_kv_flops,
)
from jaxpar.lab.context_terms import transformer_context_terms
from jaxpar.lab.tensor_terms import rows_lie, transformer_tensor_terms
from jaxpar.lab.terms import LabLayout, LabModel, Matmul, TableReads, Term
from jaxpar.logical import SEQ, split_over
from jaxpar.models.bert import BERT_FAMILY
from jaxpar.models.gemma import GEMMA_FAMILY
from jaxpar.models.gpt import GPT_FAMILY
from jaxpar.models.llama import LLAMA_FAMILY
from jaxpar.models.transformer import attention_implementation


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

    def _kept(self, cfg: Any, layout: LabLayout) -> Kept:
        """The family's counts; q and k norms (Qwen3, Gemma 3) keep their inputs and outputs
        too; dropout its masks, a byte an element (a bool): the attention's and the MLP's
        outputs' (2 of ``D``) under ``model.dropout``, the probabilities' (1 of the scores)
        under ``model.attention_dropout`` (gpt_tiny's compiled temporaries at 4 and 8
        layers grow by these bytes a layer: 0.12 and 0.25 MiB at 4 rows a device)."""
        kept, byte = self.kept, 1 / activation_itemsize(cfg, layout)
        qk = 2 * bool(getattr(cfg, "qk_norm", False))
        hidden = 2 * byte * bool(getattr(cfg, "dropout", 0))
        probabilities = byte * bool(getattr(cfg, "attention_dropout", 0))
        return dataclasses.replace(
            kept,
            attention=kept.attention + qk,
            replicated=kept.replicated + hidden,
            scores=kept.scores + probabilities,
        )

    def activation_bytes(self, cfg: Any, layout: LabLayout) -> float | None:
        kept = self._kept(cfg, layout)
        routed = experts.routed(cfg, layout)
        return activation_bytes(cfg, layout, kept, _flash(cfg, layout), self.gated, routed)

    def matmuls(self, cfg: Any, layout: LabLayout) -> list[Matmul]:
        return transformer_matmuls(cfg, layout, self.gated) + experts.expert_matmuls(cfg, layout)

    def recomputed_share(self, cfg: Any, layout: LabLayout, policy: str = "full") -> float:
        reads, flash = bool(self.kept.mlp_out), _flash(cfg, layout)
        routed = experts.expert_matmuls(cfg, layout)
        return recomputed_share(cfg, layout, self.gated, policy, reads, flash, routed)

    def fused_backward_share(self, cfg: Any, layout: LabLayout) -> float:
        if not _flash(cfg, layout):
            return 0.0
        return fused_backward_share(cfg, layout, self.gated, experts.expert_matmuls(cfg, layout))

    def unsplit_flops(self, cfg: Any, layout: LabLayout) -> float:
        return unsplit_kv_flops(cfg, layout) + experts.expanded_flops(cfg, layout)

    def elementwise_bytes(self, cfg: Any, layout: LabLayout) -> float:
        kept, routed = self._kept(cfg, layout), experts.routed(cfg, layout)
        return elementwise_bytes(cfg, layout, kept, _flash(cfg, layout), routed)

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        positions = self.learned_positions(cfg)
        return transformer_tensor_terms(cfg, layout, self.backward_all_reduces, positions=positions)

    def learned_positions(self, cfg: Any) -> bool:
        """Whether learned position rows ``[T, D]`` are added to the looked-up rows
        (GPT's ``model.positions=learned``)."""
        return getattr(cfg, "positions", None) == "learned"

    def table_reads(self, cfg: Any, layout: LabLayout) -> TableReads:
        """The token table read where its rows lie where ``tensor`` alone splits the
        vocabulary (:func:`jaxpar.tensor_parallel.lookup`; in the one-program pipeline
        the executor reduces every gradient itself), else read whole."""
        vocab = rows_lie(layout)
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
    kept = Kept(
        replicated=19,
        attention=4,
        mlp=11,
        scores=2,
        remat=1,
        head=2,
        recompute=1.25,
        saved=3,
        mlp_out=1,
    )
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
        return experts.dispatch_terms(cfg, layout) + experts.router_terms(cfg, layout)

    def scan_group(self, cfg: Any) -> int:
        return cfg.group  # a MoE layer's group of moe_every layers


def _flash(cfg: Any, layout: LabLayout) -> bool:
    """Whether attention runs as cuDNN's fused kernel, which keeps no [T, T] scores: on a
    GPU, where ``model.attention`` means ``cudnn``, no attention dropout writes the scores
    out (:func:`jaxpar.models.transformer.dropped_attention`) and ring attention does not
    compute its blocks in float32 through XLA's (:mod:`jaxpar.ring_attention`)."""
    if layout.cpu or not hasattr(cfg, "attention") or getattr(cfg, "attention_dropout", 0):
        return False
    if layout.context == "ring" and split_over(layout.rules, layout.sizes, SEQ):
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

    def learned_positions(self, cfg: Any) -> bool:
        return True  # and its token types


#: What the lab knows of each transformer family, by family name.
LABS: dict[str, LabModel] = {
    GPT_FAMILY.name: TransformerLab(),
    BERT_FAMILY.name: BertLab(),
    LLAMA_FAMILY.name: LlamaLab(),
    GEMMA_FAMILY.name: GemmaLab(),
}
