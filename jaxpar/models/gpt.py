"""GPT-style decoder LM in Flax NNX, annotated with logical axes only (its layers:
:mod:`jaxpar.models.transformer`).

Shape suffixes: B batch, T sequence, D embed (d_model), N heads, H head dim,
F mlp (d_ff), V vocab, L layers. Layers are stacked along a leading ``layers``
dim and run with ``jax.lax.scan``, so compile time does not grow with depth.

Parameters (logical axes):
  embed W[V, D] (vocab, embed); pos W[T, D] (seq, embed) when learned;
  per layer: ln scales/biases [L, D], wq/wk/wv [L, D, N, H] (layers, embed,
  heads, kv), wo [L, N, H, D], w_in [L, D, F] (layers, embed, mlp), b_in [L, F],
  w_out [L, F, D], b_out [L, D]; final norm [D]; head [D, V] unless tied; with
  ``attn_bias`` also bq/bk/bv [L, N·H] (layers, heads; head-major, kept vectors so they
  are not decayed) and bo [L, D] (layers, embed), as GPT-2 has them (see ``jaxpar/hf/gpt2.py``).

State: with ``model.dropout`` or ``model.attention_dropout`` above 0, the RNG stream its
draws come from (``noise``: a key and a count; :mod:`jaxpar.models.dropout`); none without.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, model_validator

from jaxpar import tensor_parallel
from jaxpar.context import is_natural
from jaxpar.errors import ConfigError
from jaxpar.logical import constrain, gathered, shards
from jaxpar.models import dropout, fp8, lm
from jaxpar.models.family import Counts, Family, register
from jaxpar.models.gpt_decode import decode_block
from jaxpar.models.transformer import (
    REMAT_POLICIES,
    RESIDUAL,
    Blocks,
    attention_implementation,
    block,
    check_heads,
    const,
    enter_stream,
    layer_norm,
    param,
    transformer_counts,
)
from jaxpar.models.transformer_config import TransformerConfig
from jaxpar.schema import Float, section
from jaxpar.task import DataNeeds, StageSplit, Task


@section("model")
class GPTConfig(TransformerConfig):
    """``model.*`` keys of ``model.name=gpt``: shape and numerics."""

    positions: Literal["learned", "rotary"] = Field("learned", description="position encoding")
    tie_embeddings: bool = Field(
        False, description="the output layer is the embedding table's transpose"
    )
    attn_bias: bool = Field(
        False, description="biases on the q/k/v and output projections (GPT-2 has them)"
    )
    dropout: Float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout of the embeddings and of each attention and MLP output "
        "(GPT-2's embd_pdrop and resid_pdrop, Megatron's hidden dropout); its draws are "
        "the same on every layout (jaxpar/models/dropout.py)",
    )
    attention_dropout: Float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout of the attention probabilities (GPT-2's attn_pdrop): the "
        "scores are then written out in memory whatever model.attention says; not with "
        "mesh.context > 1",
    )
    init_from: str = Field(
        "",
        description="a Hugging Face GPT-2 directory (config.json + "
        "model.safetensors) whose weights a fresh run "
        "starts from (jaxpar/hf/gpt2.py)",
    )

    @model_validator(mode="after")
    def _heads(self) -> GPTConfig:
        check_heads(self, rotary=self.positions == "rotary")
        return self


class GPT(nnx.Module):
    """Decoder-only transformer LM: tokens [B, T] → logits [B, T, V] (float32)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attention_impl = attention_implementation(cfg)
        V, D = cfg.vocab_size, cfg.d_model
        self.embed = param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        if cfg.positions == "learned":
            # positions are read by index (a load-balanced layout reorders them), so the
            # table's rows are not split with the sequence
            self.pos = param(rngs.params(), (cfg.max_seq_len, D), (None, "embed"), 0.01)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.ln_f_scale = const(1.0, (D,), ("embed",))
        self.ln_f_bias = const(0.0, (D,), ("embed",))
        if not cfg.tie_embeddings:
            self.head = param(rngs.params(), (D, V), ("embed", "vocab"), 0.02)
        if drops(cfg):  # drawn after the parameters: their values do not depend on it
            self.noise = nnx.Rngs(dropout=rngs.params())  # RNG key and count: model state
        self.deterministic = False  # NNX's train()/eval() switch it

    # ---- dropout ---------------------------------------------------------------------------
    def example_keys(self, batch: Any) -> jax.Array | None:
        """One dropout key per example of ``batch`` (its ``index``); None without dropout
        (:mod:`jaxpar.models.dropout`)."""
        if not drops(self.cfg):
            return None
        return dropout.example_keys(self.noise, self.deterministic, batch["index"])

    def advance(self) -> None:
        """One microbatch done: the next draws from the next RNG count."""
        if drops(self.cfg):
            dropout.advance(self.noise, self.deterministic)

    def _checked(self, keys_B: jax.Array | None) -> jax.Array | None:
        """``keys_B``, which a GPT that drops out needs in training.

        Raises:
          ConfigError: for a training-mode call without them.
        """
        if keys_B is None and drops(self.cfg) and not self.deterministic:
            raise ConfigError(
                f"model.dropout={self.cfg.dropout}, model.attention_dropout="
                f"{self.cfg.attention_dropout}: the GPT keys each example's draws by its id; "
                "pass keys_B=model.example_keys(batch) (a batch with 'index'), or call it "
                "after model.eval()"
            )
        return keys_B

    def _rates(self) -> tuple[float, float]:
        """(hidden, attention) dropout: none in evaluation."""
        cfg = self.cfg
        return (0.0, 0.0) if self.deterministic else (cfg.dropout, cfg.attention_dropout)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_T: np.ndarray | None = None,
        documents: lm.Documents | None = None,
        keys_B: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, T, V] (float32) of tokens [B, T] at ``positions_T`` (0 … T-1 when
        None; a context-parallel layout runs them in its balanced order); ``documents``:
        packed documents (:func:`~jaxpar.models.lm.lm_documents`), each token
        attending within its own, at its position within it.

        A tied table is read once for the lookup and the head, as one copy per batch
        shard, W[G, V_vocab, D] with G over the ``batch`` axes, its ``embed`` dim gathered
        (FSDP) and its vocabulary split as the rules split it (each device holds one copy
        of its rows; the lookup reads them where they lie, :func:`tensor_parallel.lookup`):
        its two gradient contributions then add up on each device and are reduced once.
        Read twice, the partitioner would reduce each where it is computed: one
        table-sized all-reduce more per step.

        ``keys_B``: the examples' dropout keys (:meth:`example_keys`; None: no dropout).
        """
        tables_GVD = self._tables_per_batch_shard() if self.cfg.tie_embeddings else None
        x_BTD = self.embed_tokens(tokens_BT, tables_GVD, positions_T, documents, keys_B)
        return self.logits(self.run_blocks(x_BTD, positions_T, documents, keys_B), tables_GVD)

    def _tables_per_batch_shard(self) -> jax.Array:
        table_VD = self._tied_head_table()
        tables_GVD = jnp.broadcast_to(table_VD[None], (shards("batch"), *table_VD.shape))
        return constrain(tables_GVD, ("batch", "vocab", None))

    def embed_tokens(
        self,
        tokens_BT: jax.Array,
        tables_GVD: jax.Array | None = None,
        positions_T: np.ndarray | None = None,
        documents: lm.Documents | None = None,
        keys_B: jax.Array | None = None,
    ) -> jax.Array:
        """Token (+ learned position) embeddings [B, T, D] in the compute dtype; rows of
        ``tables_GVD`` (one table per batch shard, see ``__call__``) when given; the
        tokens sit at ``positions_T`` (0 … T-1 when None), or at their positions within
        their ``documents``; dropped out with ``keys_B`` (the examples' keys) when given."""
        cfg = self.cfg
        keys_B = self._checked(keys_B)
        T = tokens_BT.shape[1]
        if T > cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {T} exceeds model.max_seq_len={cfg.max_seq_len}; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        if tables_GVD is not None:
            x_BTD = tensor_parallel.lookup(tables_GVD, tokens_BT, ("batch", "vocab", "embed"))
        else:  # a tied table through the head's layout: one gather of its embed dim
            table_VD = self._tied_head_table() if cfg.tie_embeddings else self.embed[...]
            x_BTD = tensor_parallel.lookup(table_VD, tokens_BT, ("vocab", "embed"))
        if cfg.positions == "learned" and documents is not None:
            x_BTD = x_BTD + jnp.take(self.pos[...], documents.positions, axis=0)
        elif cfg.positions == "learned":
            natural = positions_T is None or is_natural(positions_T)
            rows = self.pos[:T] if natural else self.pos[jnp.asarray(positions_T)]
            # split as the sequence, not as the stream: under sequence parallelism each
            # device adds its tokens' positions to the rows it keeps (:func:`tensor_parallel.
            # lookup`), and their gradient, summed over its part of the batch, is gathered
            # once ([T, D]); left to the partitioner, the table and its optimizer state are
            # updated split and gathered
            x_BTD = x_BTD + constrain(rows, ("seq", None))[None]
        if keys_B is not None:
            keys_B = dropout.fold(keys_B, dropout.EMBEDDING_TAG)
            x_BTD = dropout.dropout(x_BTD, keys_B, self._rates()[0], _reordered(positions_T))
        return enter_stream(x_BTD.astype(jnp.dtype(cfg.dtype)))

    def table(self) -> jax.Array:
        """The whole embedding table W[V, D], gathered over every mesh axis (decoding
        looks tokens up in it). A tied table is gathered in two steps, through the head's
        layout (:meth:`_tied_head_table`), so that the lookup and the head share one
        gather of its ``embed`` dim.
        """
        table_VD = self._tied_head_table() if self.cfg.tie_embeddings else self.embed[...]
        return constrain(table_VD, (None, None))

    def _tied_head_table(self) -> jax.Array:
        """A tied table in the head's layout, W[V_vocab, D]: its ``embed`` dim gathered
        (FSDP), ``vocab`` as the rules shard it (tensor parallelism: the logits' vocab
        dim). The lookup and the head read it so, which XLA's CSE folds into one
        all-gather instead of one for each.
        """
        return constrain(self.embed[...], ("vocab", None))

    def logits(self, x_BTD: jax.Array, tables_GVD: jax.Array | None = None) -> jax.Array:
        """Final norm and output projection: [B, T, D] → float32 logits [B, T, V]; through
        ``tables_GVD`` (a tied table per batch shard, see ``__call__``) when given."""
        h = layer_norm(x_BTD, self.ln_f_scale[...], self.ln_f_bias[...])
        if tables_GVD is not None:
            (B, T, D), G = h.shape, tables_GVD.shape[0]
            logits = jnp.einsum(
                "gbtd,gvd->gbtv", h.reshape(G, B // G, T, D), tables_GVD.astype(h.dtype)
            ).reshape(B, T, -1)
        else:
            head_DV = (
                self._tied_head_table().T
                if self.cfg.tie_embeddings
                else gathered(self.head[...], ("embed", "vocab"))
            )
            logits = jnp.einsum("btd,dv->btv", h, head_DV.astype(x_BTD.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def run_blocks(
        self,
        x_BTD: jax.Array,
        positions_T: np.ndarray | None = None,
        documents: lm.Documents | None = None,
        keys_B: jax.Array | None = None,
        first_layer: Any = 0,
    ) -> jax.Array:
        """All blocks of ``self.blocks`` (however many are stacked there), in order, over
        tokens at ``positions_T`` (0 … T-1 when None), packed as ``documents``; dropped out
        with ``keys_B`` (the examples' keys) when given, block ``i`` as layer
        ``first_layer + i`` of the whole model (however the layers are cut into stages)."""
        dtype = x_BTD.dtype
        use_rotary = self.cfg.positions == "rotary"
        keys_B = self._checked(keys_B)
        hidden, attention = self._rates()
        stacked = self.blocks.stacked()
        layers = jnp.asarray(first_layer) + jnp.arange(jax.tree.leaves(stacked)[0].shape[0])

        def body(x, inputs):
            p, layer = inputs
            p = fp8.in_dtype(p, dtype)
            noise = None
            if keys_B is not None:
                noise = dropout.LayerNoise(
                    keys_B, layer, hidden, attention, _reordered(positions_T)
                )
            out = block(
                x,
                p,
                use_rotary,
                self.attention_impl,
                positions_T,
                documents,
                precision=self.cfg.precision,
                noise=noise,
            )
            return out, None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        x_BTD, _ = jax.lax.scan(body, x_BTD, (stacked, layers))
        return x_BTD

    # ---- generation with a KV cache (jaxpar sample) ---------------------------------------
    def init_cache(self, batch: int) -> dict[str, jax.Array]:
        """An empty KV cache for ``batch`` sequences: K and V [L, B, S, N, H]."""
        return lm.kv_cache(self.cfg, batch, self.cfg.n_heads)

    def decode(
        self, tokens_BT: jax.Array, cache: dict[str, jax.Array], start: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits [B, T, V] (float32) of T tokens at positions ``start`` … ``start+T-1``,
        given a cache that holds positions ``< start``; returns them and the cache with
        the new positions written. One call with the prompt (``start`` 0) fills the cache,
        then one call per generated token (T = 1). The logits equal the last T rows of
        ``self(all tokens so far)``.
        """
        cfg = self.cfg
        T = tokens_BT.shape[1]
        x_BTD = jnp.take(self.table(), tokens_BT, axis=0)
        if cfg.positions == "learned":
            x_BTD = x_BTD + jax.lax.dynamic_slice_in_dim(self.pos[...], start, T)[None]
        x_BTD = constrain(x_BTD.astype(jnp.dtype(cfg.dtype)), RESIDUAL)
        use_rotary = cfg.positions == "rotary"

        def body(x, layer):
            p, k, v = layer
            p = fp8.in_dtype(p, x.dtype)
            x, k, v = decode_block(x, p, k, v, start, use_rotary, cfg.precision)
            return x, (k, v)

        x_BTD, (k, v) = jax.lax.scan(body, x_BTD, (self.blocks.stacked(), cache["k"], cache["v"]))
        return self.logits(x_BTD), {"k": k, "v": v}


# ---- the loss, cut into pipeline stages -----------------------------------------------------
def drops(cfg: GPTConfig) -> bool:
    """Whether the model drops anything out in training (it then keys its draws by the
    examples' ids: ``index`` beside ``tokens``)."""
    return cfg.dropout > 0 or cfg.attention_dropout > 0


def _reordered(positions_T: np.ndarray | None) -> np.ndarray | None:
    """The tokens' positions where a layout reorders them; None in their natural order."""
    return None if positions_T is None or is_natural(positions_T) else np.asarray(positions_T)


def _lm_embed(model: GPT, batch: Any) -> jax.Array:
    inputs, _, pos_T = lm.lm_sequence(batch)
    documents = lm.lm_documents(batch, pos_T)
    return model.embed_tokens(inputs, None, pos_T, documents, model.example_keys(batch))


def _lm_stage(model: GPT, x: jax.Array, batch: Any, first: Any) -> jax.Array:
    pos_T = lm.lm_sequence(batch)[2]
    documents = lm.lm_documents(batch, pos_T)
    return model.run_blocks(x, pos_T, documents, model.example_keys(batch), first)


def _lm_head(model: GPT, x: jax.Array, batch: Any) -> tuple[jax.Array, dict]:
    _, targets, pos_T = lm.lm_sequence(batch)
    return lm.next_token_loss(model.logits(x), targets, lm.lm_weights(batch, pos_T))


def lm_loss(model: GPT, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy over ``batch['tokens']`` [B, T+1] (a mean over tokens:
    the same in any order the layout runs them).

    The whole model in one call (not embed, blocks, head one by one as a pipeline stage
    runs them): a tied table is then read once by the lookup and the head, and its
    gradient reduced once (see ``GPT.__call__``).
    """
    inputs, targets, pos_T = lm.lm_sequence(batch)
    logits = model(inputs, pos_T, lm.lm_documents(batch, pos_T), model.example_keys(batch))
    out = lm.next_token_loss(logits, targets, lm.lm_weights(batch, pos_T))
    model.advance()
    return out


#: The GPT cut into pipeline stages: embedding first, the stacked blocks split, head and loss
#: last.
STAGES = StageSplit("blocks", _lm_embed, _lm_stage, _lm_head)


# ---- the family ------------------------------------------------------------------------------
def task(cfg: GPTConfig, seq_len: int, documents: bool = False, loss_mask: bool = False) -> Task:
    """The GPT's task: next-token prediction on windows of ``seq_len + 1`` tokens, the
    parameters from the model's initializers; with ``documents``, the windows' packed
    documents (``segments`` beside ``tokens``) attend each within itself; with
    ``loss_mask``, only the targets it marks count (fine-tuning records).

    Raises:
      ConfigError: for ``cfg.init_from``: Hugging Face files are read where the config is
        (:func:`jaxpar.task_for`, :func:`jaxpar.build`), not by the model's own module.
    """
    lm.refuse_init_from(cfg)
    ids = {"index": ("batch",)} if drops(cfg) else {}
    return Task(
        lambda rngs: GPT(cfg, rngs=rngs),
        lm_loss,
        lm.lm_batch_axes(documents, loss_mask) | ids,
        tokens_per_example=seq_len,
        stages=STAGES,
        name="gpt",
        # the probabilities' dropout needs the whole sequence (dropped_attention)
        context_parallel=not cfg.attention_dropout,
        draws_by_example=drops(cfg),
    )


def _without_init_from(cfg: GPTConfig) -> GPTConfig:
    """The family's task starts from initializers; ``jaxpar.run`` wires ``init_from`` in."""
    return dataclasses.replace(cfg, init_from="")


def _needs(cfg: GPTConfig) -> DataNeeds:
    return DataNeeds(
        "text", vocab_size=cfg.vocab_size, documents=True, loss_mask=True, example_ids=drops(cfg)
    )


def _counts(cfg: GPTConfig, data: Any) -> Counts:
    params, flops = transformer_counts(cfg, data.seq_len)
    if cfg.positions == "learned":
        params += cfg.max_seq_len * cfg.d_model
    if cfg.attn_bias:
        params += cfg.n_layers * 4 * cfg.d_model
    return Counts(params, flops)


GPT_FAMILY = register(
    Family(
        "gpt",
        GPTConfig,
        lambda cfg, data: task(
            _without_init_from(cfg), data.seq_len, lm.packs_documents(data), lm.masks_loss(data)
        ),
        _needs,
        counts=_counts,
        memory_fixes=lambda cfg: [] if cfg.remat == "full" else ["model.remat=full"],
        compute_dtype=lambda cfg: cfg.dtype,
        doc="decoder-only transformer LM; pipelines (stacked layers)",
    )
)
