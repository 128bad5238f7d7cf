"""What a language-model family's task reads and returns beside its layers: its batch's
entries and their logical axes, the inputs, targets and positions of a sequence in the
order the layout runs it, packed documents and loss weights, the next-token loss, an empty
KV cache for generation, and the refusal of Hugging Face weights where the config is not
read (shared by jaxpar's GPT, Llama, Gemma and BERT; the layers are
:mod:`jaxpar.models.transformer`'s).

Shape suffixes: B batch, T sequence, S cache length, L layers, H head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.context import document_positions, order, positions
from jaxpar.errors import ConfigError


def refuse_init_from(cfg: Any) -> None:
    """A family's task builder starts from initializers: Hugging Face weights
    (``model.init_from``) are read where the config is.

    Raises:
      ConfigError: for a config with ``init_from`` set.
    """
    if cfg.init_from:
        raise ConfigError(
            f"model.init_from={cfg.init_from}: the weights of a Hugging Face "
            "directory are read by jaxpar.task_for(config) (and jaxpar.build); "
            "call that, or build this task without init_from"
        )


def kv_cache(cfg: Any, batch: int, heads: int) -> dict[str, jax.Array]:
    """An empty KV cache for generation: K and V [L, B, S, heads, H] in the compute dtype,
    S = ``max_seq_len``."""
    shape = (cfg.n_layers, batch, cfg.max_seq_len, heads, cfg.head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return {"k": zeros, "v": zeros}


def lm_sequence(batch: Any) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """Inputs and targets [B, T] of ``batch['tokens']`` [B, T+1] and their positions, in
    the order the layout runs a sequence (balanced under context parallelism:
    :func:`jaxpar.context.positions`)."""
    tokens = batch["tokens"]
    pos_T = positions(tokens.shape[1] - 1)
    return order(tokens[:, :-1], pos_T), order(tokens[:, 1:], pos_T), pos_T


class Documents(NamedTuple):
    """Documents packed into each sequence (``data.pack=documents``), in the order the
    layout runs the tokens: segment ids [B, T] (attention stays within a segment) and
    each token's position within its document [B, T] (for position encodings)."""

    segments: jax.Array
    positions: jax.Array


def lm_documents(batch: Any, pos_T: np.ndarray) -> Documents | None:
    """The packed documents of the inputs of ``batch`` (its ``segments`` [B, T+1], beside
    ``tokens``) in the order ``pos_T`` (:func:`lm_sequence`'s); None without them."""
    if "segments" not in batch:
        return None
    segments = batch["segments"][:, :-1]
    return Documents(order(segments, pos_T), order(document_positions(segments), pos_T))


def lm_weights(batch: Any, pos_T: np.ndarray) -> jax.Array | None:
    """The weights [B, T] of the targets of ``batch`` (its ``loss_weights`` [B, T+1]:
    :func:`jaxpar.task.loss_weights`) in the order ``pos_T``; None without them."""
    if "loss_weights" not in batch:
        return None
    return order(batch["loss_weights"][:, 1:], pos_T)


def lm_batch_axes(
    documents: bool = False, loss_mask: bool = False
) -> dict[str, tuple[str | None, ...]]:
    """A language model's batch entries: ``tokens`` [B, T+1], with ``documents`` their
    ``segments`` [B, T+1] (``data.pack=documents``), with ``loss_mask`` its [B, T+1]
    (fine-tuning records)."""
    axes = {"tokens": ("batch", None)}
    axes |= {"segments": ("batch", None)} if documents else {}
    return axes | {"loss_mask": ("batch", None)} if loss_mask else axes


def packs_documents(data: Any) -> bool:
    """Whether the data a family's task is built for packs documents (``data.pack``)."""
    return getattr(data, "pack", "concat") == "documents"


def masks_loss(data: Any) -> bool:
    """Whether the data a family's task is built for carries a loss mask."""
    return bool(getattr(data, "loss_mask", False))


def next_token_loss(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> tuple[jax.Array, dict]:
    """Mean next-token cross entropy (the same in any order the layout runs the tokens),
    each target's weighed by ``weights`` [B, T] when given (:func:`lm_weights`)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (ce if weights is None else ce * weights).mean(), {}
