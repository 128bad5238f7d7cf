"""A BERT-style encoder (Devlin et al., 2019) with a masked-LM loss — the family
``model.name=bert``.

Token, learned position and token-type embeddings; pre-norm transformer blocks with
bidirectional attention (the GPT's blocks, ``jaxpar/models/gpt.py``, without the causal
mask), stacked on a ``layers`` dim and scanned, so the model pipelines like the GPT; dropout
after the embeddings and after each attention and MLP output; a masked-LM head tied to the
token embedding. Shape suffixes as in the GPT: B batch, T sequence, D embed, V vocab.

**Masked LM.** Each example is a window of ``data.seq_len`` tokens of text prepared by
``jaxpar prepare-data``; its first half has token type 0, its second half type 1. In every
example ``round(mask_rate · T)`` positions (at least one) are chosen; of those 80 % become
the mask token (the last id of the vocabulary, ``model.vocab_size − 1``), 10 % a random token
of the data's vocabulary and 10 % stay; the loss is the cross entropy at the chosen positions
(a fixed count per example, so the mean over microbatches is the mean over the batch).

**Packing** (``data.pack=documents``). Each token attends only to the tokens of its own
document (both directions), and positions and the type halves are the document's own (of
the piece of it the window holds): a document reads as it would alone in a window of its
length. The masking stays the window's (the same positions as with ``concat``).

**Randomness.** Masking and dropout draw from keys derived from (the model's RNG key, the
RNG count, the example's id, the layer): the count is the microbatch's — the loss advances
it by one per microbatch, and the pipeline executor gives microbatch ``j`` of a step the
count ``c + j`` — and the example id is the window's position in the corpus. So no call
order enters: every layout and every pipeline schedule draws the same masks as one device
with the same microbatches, and a resumed run draws those of the uninterrupted one.
Evaluation masks with a fixed key (the same held-out positions every time) and no dropout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pydantic import Field, model_validator

from jaxpar import tensor_parallel
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain
from jaxpar.models import dropout, fp8
from jaxpar.models.family import Counts, Family, register
from jaxpar.models.lm import Documents, lm_batch_axes, lm_documents, packs_documents
from jaxpar.models.transformer import (
    REMAT_POLICIES,
    RESIDUAL,
    Attention,
    Blocks,
    Remat,
    attention,
    attention_implementation,
    check_heads,
    const,
    enter_stream,
    layer_norm,
    mlp,
    param,
    transformer_counts,
)
from jaxpar.models.transformer_config import TransformerConfig
from jaxpar.schema import Float, section
from jaxpar.task import DataNeeds, StageSplit, Task

#: fold-in tags of the draws that are not per layer
_MASKING, _EMBEDDING = 0, 1


@section("model")
class BERTConfig(TransformerConfig):
    """``model.*`` keys of ``model.name=bert``."""

    vocab_size: int = Field(
        264,
        ge=2,
        description="vocabulary: the data's, plus the mask "
        "token (the last id); 264 = 256 bytes + 1, "
        "rounded up to a multiple of 8 for tensor "
        "splits",
    )
    n_layers: int = Field(4, ge=1, description="encoder blocks L")
    max_seq_len: int = Field(128, ge=1, description="longest sequence (learned positions)")
    dropout: Float = Field(
        0.1, ge=0, lt=1, description="dropout rate (embeddings, attention and MLP outputs)"
    )
    mask_rate: Float = Field(
        0.15,
        gt=0,
        lt=1,
        description="share of each sequence's positions the masked-LM loss predicts",
    )
    remat: Remat = Field("none", description="recompute each block in the backward pass")
    attention: Attention = Field(
        "auto",
        description="jax.nn.dot_product_attention's "
        "implementation (auto: cuDNN on a GPU where it runs)",
    )

    @model_validator(mode="after")
    def _heads(self) -> BERTConfig:
        check_heads(self)
        return self

    @property
    def mask_token(self) -> int:
        return self.vocab_size - 1


class BERT(nnx.Module):
    """Encoder: tokens [B, T] (+ types) → masked-LM logits [B, T, V] (float32)."""

    def __init__(self, cfg: BERTConfig, data_vocab: int | None = None, *, rngs: nnx.Rngs):
        self.cfg = cfg
        #: the data's vocabulary: the random replacements of masking are drawn from it
        self.data_vocab = data_vocab or cfg.vocab_size - 1
        if self.data_vocab >= cfg.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.vocab_size} leaves no id for the mask "
                f"token after the data's {self.data_vocab}; set model.vocab_size "
                f"≥ {self.data_vocab + 1}"
            )
        self.attention_impl = attention_implementation(cfg)
        V, D, T = cfg.vocab_size, cfg.d_model, cfg.max_seq_len
        self.embed = param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        self.pos = param(rngs.params(), (T, D), (None, "embed"), 0.02)
        self.types = param(rngs.params(), (2, D), (None, "embed"), 0.02)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.ln_f_scale = const(1.0, (D,), ("embed",))
        self.ln_f_bias = const(0.0, (D,), ("embed",))
        self.mlm_w = param(rngs.params(), (D, D), ("embed", None), 0.02)
        self.mlm_b = const(0.0, (D,), (None,))
        self.mlm_ln_scale = const(1.0, (D,), (None,))
        self.mlm_ln_bias = const(0.0, (D,), (None,))
        self.out_bias = const(0.0, (V,), ("vocab",))
        self.noise = nnx.Rngs(dropout=rngs.params())  # RNG key and count: model state
        self.deterministic = False  # NNX's train()/eval() switch it

    # ---- randomness ----------------------------------------------------------------------
    def example_keys(self, index_B: jax.Array) -> jax.Array:
        """One key per example (:func:`jaxpar.models.dropout.example_keys`)."""
        return dropout.example_keys(self.noise, self.deterministic, index_B)

    def advance(self) -> None:
        """One microbatch done: the next draws from the next count."""
        dropout.advance(self.noise, self.deterministic)

    # ---- the network -----------------------------------------------------------------------
    def mask(
        self, tokens_BT: jax.Array, keys_B: jax.Array, data_vocab: int
    ) -> tuple[jax.Array, jax.Array]:
        """Masked inputs and the chosen positions (float weights [B, T]) of each example."""
        cfg = self.cfg
        T = tokens_BT.shape[1]
        n = max(1, round(cfg.mask_rate * T))

        def one(key, tokens):
            pick, kind, rand = jax.random.split(jax.random.fold_in(key, _MASKING), 3)
            chosen = jnp.zeros(T, bool).at[jax.random.permutation(pick, T)[:n]].set(True)
            u = jax.random.uniform(kind, (T,))
            random = jax.random.randint(rand, (T,), 0, data_vocab)
            masked = jnp.where(u < 0.8, cfg.mask_token, jnp.where(u < 0.9, random, tokens))
            return jnp.where(chosen, masked, tokens), chosen.astype(jnp.float32)

        return jax.vmap(one)(keys_B, tokens_BT)

    def embed_tokens(
        self, inputs_BT: jax.Array, keys_B: jax.Array, documents: Documents | None = None
    ) -> jax.Array:
        """Token + position + type embeddings [B, T, D] (type 1 for the second half); with
        packed ``documents``, positions and halves are each document's own (as it would
        have them alone)."""
        cfg = self.cfg
        T = inputs_BT.shape[1]
        if T > cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {T} exceeds model.max_seq_len={cfg.max_seq_len}; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        x = tensor_parallel.lookup(self.embed[...], inputs_BT, ("vocab", "embed"))
        if documents is None:
            types_T = (jnp.arange(T) >= T // 2).astype(jnp.int32)
            # split as the sequence, not as the stream (GPT's learned positions say why):
            # their gradient, one [T, D], gathered once
            rows_TD = constrain(self.pos[:T] + self.types[...][types_T], ("seq", None))
            x = x + rows_TD[None]
        else:
            x = (
                x
                + jnp.take(self.pos[...], documents.positions, axis=0)
                + jnp.take(self.types[...], _document_halves(documents), axis=0)
            )
        x = dropout.dropout(x, dropout.fold(keys_B, _EMBEDDING), self._rate())
        return enter_stream(x.astype(jnp.dtype(cfg.dtype)))

    def _rate(self) -> float:
        return 0.0 if self.deterministic else self.cfg.dropout

    def run_blocks(
        self,
        x_BTD: jax.Array,
        keys_B: jax.Array,
        first_layer: Any = 0,
        documents: Documents | None = None,
    ) -> jax.Array:
        """The stacked blocks of ``self.blocks``; block ``i`` is layer ``first_layer + i``
        of the whole model (its dropout keys), however the layers are cut into stages;
        packed ``documents``: each token attends within its own."""
        dtype = x_BTD.dtype
        rate = self._rate()
        impl, precision = self.attention_impl, self.cfg.precision
        stacked = self.blocks.stacked()
        layers = jnp.asarray(first_layer) + jnp.arange(jax.tree.leaves(stacked)[0].shape[0])

        def body(x, inputs):
            p, layer = inputs
            p = fp8.in_dtype(p, dtype)
            keys = dropout.fold(keys_B, 2 + 2 * layer)
            h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
            a = attention(h, p, False, impl, causal=False, documents=documents, precision=precision)
            x = constrain(x + dropout.dropout(a, keys, rate), RESIDUAL)
            h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
            x = constrain(
                x
                + dropout.dropout(mlp(h, p, precision), dropout.fold(keys_B, 3 + 2 * layer), rate),
                RESIDUAL,
            )
            return x, None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        return jax.lax.scan(body, x_BTD, (stacked, layers))[0]

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final norm, the MLM transform and the tied output: [B, T, D] → [B, T, V]."""
        h = layer_norm(x_BTD, self.ln_f_scale[...], self.ln_f_bias[...])
        h = jax.nn.gelu(
            jnp.einsum("btd,de->bte", h, self.mlm_w[...].astype(h.dtype))
            + self.mlm_b[...].astype(h.dtype)
        )
        h = layer_norm(h, self.mlm_ln_scale[...], self.mlm_ln_bias[...])
        logits = jnp.einsum("btd,vd->btv", h, self.embed[...].astype(h.dtype))
        logits = logits.astype(jnp.float32) + self.out_bias[...]
        return constrain(logits, ("batch", "seq", "vocab"))


# ---- the loss, cut into pipeline stages -------------------------------------------------------
def _inputs(model: BERT, batch: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(example keys, masked inputs, original tokens, chosen-position weights)."""
    tokens = batch["tokens"][:, :-1]  # windows carry T + 1 tokens; the encoder reads T
    keys = model.example_keys(batch["index"])
    inputs, weights = model.mask(tokens, keys, model.data_vocab)
    return keys, inputs, tokens, weights


def _document_halves(documents: Documents) -> jax.Array:
    """Each token's type [B, T]: 1 in the second half of its document (of the piece of it
    the window holds), as the window's halves are without packing."""
    segments = documents.segments
    lengths = jax.vmap(lambda s: jnp.bincount(s, length=s.shape[0])[s])(segments)
    return (documents.positions >= lengths // 2).astype(jnp.int32)


def _documents(batch: Any) -> Documents | None:
    """The packed documents of the encoder's T tokens (``segments`` beside ``tokens``),
    in sequence order (bidirectional attention is not reordered); None without them."""
    return lm_documents(batch, np.arange(batch["tokens"].shape[1] - 1))


def _embed(model: BERT, batch: Any) -> jax.Array:
    keys, inputs, _, _ = _inputs(model, batch)
    return model.embed_tokens(inputs, keys, _documents(batch))


def _stage(model: BERT, x: jax.Array, batch: Any, first_layer: Any = 0) -> jax.Array:
    return model.run_blocks(x, model.example_keys(batch["index"]), first_layer, _documents(batch))


def _head(model: BERT, x: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    _, _, tokens, weights = _inputs(model, batch)
    logits = model.logits(x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    count = weights.sum()
    correct = (jnp.argmax(logits, -1) == tokens).astype(jnp.float32)
    return (losses * weights).sum() / count, {"masked_accuracy": (correct * weights).sum() / count}


def mlm_loss(model: BERT, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked-LM cross entropy and accuracy at the chosen positions; advances the RNG count."""
    out = _head(model, _stage(model, _embed(model, batch), batch), batch)
    model.advance()
    return out


# ---- the family ------------------------------------------------------------------------------
#: BERT cut into pipeline stages: masking and embedding first, the stacked blocks split, the
#: MLM head and loss last.
STAGES = StageSplit("blocks", _embed, _stage, _head)


def task(
    cfg: BERTConfig, seq_len: int, data_vocab: int | None = None, documents: bool = False
) -> Task:
    """BERT's task: masked-LM on windows of ``seq_len`` tokens (each example carries its
    ``index``, which keys its masking); ``data_vocab``: the ids the data holds (default:
    all but the mask token, ``vocab_size - 1``); with ``documents``, the windows' packed
    documents (``segments`` beside ``tokens``) attend each within itself, positions and
    token-type halves each document's own (the masking is the window's, unchanged)."""
    return Task(
        lambda rngs: BERT(cfg, data_vocab, rngs=rngs),
        mlm_loss,
        lm_batch_axes(documents) | {"index": ("batch",)},
        tokens_per_example=seq_len,
        stages=STAGES,
        name="bert",
        context_parallel=True,
        draws_by_example=True,
    )


def _needs(cfg: BERTConfig) -> DataNeeds:
    return DataNeeds("text", vocab_size=cfg.vocab_size - 1, example_ids=True, documents=True)


def _counts(cfg: BERTConfig, data: Any) -> Counts:
    D = cfg.d_model
    params, flops = transformer_counts(cfg, data.seq_len, head=False)
    params += cfg.max_seq_len * D + 2 * D + D * D + 3 * D + cfg.vocab_size  # pos, types, MLM
    T = data.seq_len
    flops += 2 * 3 * T * D * D  # the MLM transform
    return Counts(params, flops)


BERT_FAMILY = register(
    Family(
        "bert",
        BERTConfig,
        lambda cfg, data: task(cfg, data.seq_len, data.vocab_size, packs_documents(data)),
        _needs,
        counts=_counts,
        memory_fixes=lambda cfg: [] if cfg.remat == "full" else ["model.remat=full"],
        compute_dtype=lambda cfg: cfg.dtype,
        unread=("context.balance",),  # bidirectional: no causal work to balance
        doc="BERT-style encoder with a masked-LM loss (dropout, token types); pipelines",
    )
)
