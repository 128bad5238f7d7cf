"""Context parallelism: attention across the ``context`` mesh axis, and the load-balancing
order of a causal sequence.

With ``mesh.context=c`` the rules map the logical ``seq`` axis of activations to the
``context`` mesh axis: every per-token operation (embeddings, norms, MLPs, the loss) runs
on a device's own slice of each sequence, unchanged. Attention is the one operation that
reads across the sequence; a model calls :func:`attend` for it, with each token's position,
and it runs inside ``shard_map`` over the mesh (the query's sequence dim manual) with the
layout's strategy (``context.attention``):

* ``all_gather`` (default, as MaxText's and torchtitan's): the queries stay local; keys,
  values and their positions are all-gathered over ``context``; the mask is built from the
  positions. Autodiff turns the gather into a reduce-scatter of dK and dV.
* ``ring``: key/value blocks travel round the ring with ``ppermute``; each block's partial
  result is merged by its log-sum-exp; a block wholly in a query's future is skipped; a
  query row with no visible key in a block contributes nothing. Memory O(local block): the
  backward pass sends the blocks round again, their dK and dV travelling with them (a
  ``custom_vjp``), instead of keeping every block's probabilities.
* ``ulysses`` (DeepSpeed-Ulysses): an ``all_to_all`` over ``context`` turns q, k, v from
  sequence shards ``[B, T_context, N, H]`` into head shards ``[B, T, N_context, H]``; each
  device attends over the whole sequence for its c-th of the heads, the mask built from
  the gathered positions (so a balanced order is exact), and a second ``all_to_all`` gives
  the output back as sequence shards. Autodiff turns each ``all_to_all`` into its reverse.
  A device sends 4 arrays of ``(c−1)/c`` of its local size per layer, whatever ``c`` (the
  all-gather's K/V grow with it); the heads each device holds (after ``tensor``) must
  divide by ``c``. Grouped-query key/value heads that ``c`` does not divide are repeated to
  the query heads first.

Causal attention gives the device with the last chunk of a sequence the most work. With
``context.balance`` (default) a causal model reorders each sequence once, before its first
layer (:func:`order`): cut into 2c chunks, device r holds chunks r and 2c−1−r (the
"dual-chunk swap"), so every device has the same number of visible query–key pairs.
Tokens, targets and positions move together; the loss, a mean over tokens, does not see
the order; a per-token output that leaves the step is put back with :func:`restore`.

Documents packed into one sequence (``data.pack=documents``) pass their segment ids to
:func:`attend` (``segments=``, in the tokens' order): a query then sees only the keys of
its own segment, on every strategy (the ids travel with their keys), and
:func:`document_positions` gives each token's position within its document.

Outside a jaxpar step, or when ``seq`` is not sharded, :func:`attend` is
``jax.nn.dot_product_attention`` with ``is_causal`` (with an explicit mask for segments or
a reordered sequence) and :func:`order` is the identity.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from pydantic import Field

from jaxpar.errors import LayoutError
from jaxpar.logical import BATCH, SEQ, active_layout, active_options, names_of, spec_for, split_over
from jaxpar.ring_attention import ring_attention, visible
from jaxpar.schema import section

#: ``context.attention`` values.
Strategy = Literal["all_gather", "ring", "ulysses"]


@section("context")
class ContextConfig:
    """How attention runs when ``mesh.context`` > 1 splits each sequence over devices."""

    attention: Strategy = Field(
        "all_gather",
        description="all_gather: keys and values "
        "gathered over the context axis for each layer; ring: their "
        "blocks passed round the devices (memory of one block); ulysses: "
        "q, k, v exchanged all-to-all from sequence to head shards (the "
        "heads per device must divide by mesh.context)",
    )
    balance: bool = Field(
        True,
        description="causal models reorder each sequence so that "
        "every context device does the same attention "
        "work (dual-chunk swap)",
    )


def _options() -> ContextConfig:
    return active_options(ContextConfig) or ContextConfig()


def sequence_axes() -> tuple[str, ...]:
    """The mesh axes (of size > 1) the active rules split the logical ``seq`` axis over;
    empty outside a jaxpar step."""
    layout = active_layout()
    if layout is None:
        return ()
    mesh, rules, _ = layout
    return split_over(rules, mesh.shape, SEQ)


def degree() -> int:
    """How many devices share each sequence (1 without context parallelism)."""
    layout = active_layout()
    return math.prod(layout[0].shape[a] for a in sequence_axes()) if layout else 1


# ---- the load-balancing order ---------------------------------------------------------------
def balanced_order(length: int, ways: int) -> np.ndarray:
    """Positions in dual-chunk-swap order: ``length`` cut into 2·``ways`` chunks, device r
    holding chunks r and 2·ways−1−r (so that the causal work is equal on every device).

    Raises:
      LayoutError: when ``length`` does not split into 2·``ways`` chunks.
    """
    if length % (2 * ways):
        raise LayoutError(
            f"sequence length {length} does not split into 2 × mesh.context = {2 * ways} "
            "equal chunks (context.balance reorders them); change data.seq_len or "
            "mesh.context, or set context.balance=false"
        )
    chunks = np.arange(length).reshape(2 * ways, -1)
    return np.concatenate(
        [np.concatenate([chunks[r], chunks[2 * ways - 1 - r]]) for r in range(ways)]
    )


def positions(length: int, causal: bool = True) -> np.ndarray:
    """The positions of a sequence of ``length`` tokens in the order the active layout
    runs it: balanced for a causal model under context parallelism with
    ``context.balance``, else ``0 … length−1``."""
    ways = degree()
    if causal and ways > 1 and _options().balance:
        return balanced_order(length, ways)
    if length % ways:
        raise LayoutError(
            f"sequence length {length} is not divisible by the {ways} devices of mesh axes "
            f"{sequence_axes()} that split it; change data.seq_len or mesh.context"
        )
    return np.arange(length)


def is_natural(positions_T: np.ndarray) -> bool:
    """Whether positions are ``0 … T-1`` in order."""
    return bool(np.array_equal(positions_T, np.arange(len(positions_T))))


def order(x: jax.Array, order_T: np.ndarray, axis: int = 1) -> jax.Array:
    """``x`` with its sequence ``axis`` in ``order_T`` (from :func:`positions`); a no-op for
    the natural order."""
    if is_natural(order_T):
        return x
    return jnp.take(x, jnp.asarray(order_T), axis=axis)


def restore(x: jax.Array, order_T: np.ndarray, axis: int = 1) -> jax.Array:
    """The inverse of :func:`order`: a per-token output back in sequence order."""
    return order(x, np.argsort(order_T), axis)


def document_positions(segments_BT: jax.Array) -> jax.Array:
    """Each token's position within its document [B, T] (0 at every document's first
    token), from segment ids [B, T] in sequence order (a document's tokens are
    contiguous and share an id); order the result with :func:`order` as the tokens."""
    T = segments_BT.shape[1]
    index = jnp.arange(T, dtype=jnp.int32)
    new = jnp.concatenate(
        [jnp.ones_like(segments_BT[:, :1], bool), segments_BT[:, 1:] != segments_BT[:, :-1]], axis=1
    )
    first = jax.lax.cummax(jnp.where(new, index, 0), axis=1)
    return index - first


# ---- attention ------------------------------------------------------------------------------
#: how many times :func:`attend` has run across a split sequence (traced), in this process
_SPLIT_CALLS = [0]


def split_attention_calls() -> int:
    """How many times :func:`attend` (or :func:`masks_by_position`) has been traced across
    a split sequence so far: a
    step compares it before and after tracing a loss whose sequences the layout splits,
    and refuses a model that never called it (its own attention would be wrong there)."""
    return _SPLIT_CALLS[0]


def masks_by_position() -> None:
    """Declares, from inside a model's attention, that it masks by each token's position
    and lets XLA gather the split keys (as Gemma 2's soft-capped attention does), so it is
    right on a split sequence without :func:`attend` (slower: no ring, no per-device
    blocks); the check that refuses a context-parallel model whose attention never called
    :func:`attend` then lets it through."""
    if sequence_axes():
        _SPLIT_CALLS[0] += 1


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions_T: np.ndarray | None = None,
    *,
    causal: bool = True,
    implementation: str = "xla",
    window: int = 0,
    segments: jax.Array | None = None,
) -> jax.Array:
    """Multi-head attention of q, k, v [B, T, N, H] whose tokens sit at ``positions_T``
    (their natural order when None): ``jax.nn.dot_product_attention``, across the context
    axis when the active rules split ``seq`` (see the module docstring). With ``window``
    > 0 (causal only: sliding-window attention) a query sees the ``window`` positions
    ending at its own — also across the context axis, where the mask comes from the
    positions. With ``segments`` [B, T] (int, in the tokens' order: documents packed
    into one sequence) a query sees only the keys of its own segment; the segment ids
    travel with their keys across the context axis."""
    if window and not causal:
        raise ValueError("sliding-window attention is causal here")
    axes = sequence_axes()
    if not axes:
        if segments is not None or (positions_T is not None and not is_natural(positions_T)):
            pos = jnp.asarray(positions_T if positions_T is not None else np.arange(q.shape[1]))
            mask = visible(pos, pos, causal, window, segments, segments)
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
        local = (window - 1, 0) if window else None
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=local, implementation=implementation
        )
    _SPLIT_CALLS[0] += 1
    mesh = active_layout()[0]
    strategy = _options().attention
    spec, k, v, kv_spec = _specs(q, k, v, strategy, axes)
    pos = jnp.asarray(positions_T if positions_T is not None else np.arange(q.shape[1]))
    run = {"ring": _ring, "ulysses": _ulysses}.get(strategy, _all_gather)
    body = functools.partial(
        run, axes=axes, causal=causal, implementation=implementation, window=window
    )
    seq_spec = PartitionSpec(spec[1])
    if segments is None:
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, kv_spec, kv_spec, seq_spec),
            out_specs=spec,
            check_vma=False,
        )(q, k, v, pos)
    seg_spec = PartitionSpec(spec[0], spec[1])  # [B, T]: batch and seq as the tokens'
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec, kv_spec, kv_spec, seq_spec, seg_spec),
        out_specs=spec,
        check_vma=False,
    )(q, k, v, pos, segments)


def _specs(q, k, v, strategy, axes):
    """The ``PartitionSpec`` of q, and k, v with theirs: grouped-query key/value heads are
    repeated to the query heads where a device would not hold its query heads' own.

    Raises:
      LayoutError: ``ulysses`` with query heads per device that ``axes`` do not divide.
    """
    mesh, rules, _ = active_layout()
    spec = spec_for((BATCH, SEQ, "heads", "kv"), rules, mesh, q.shape, "attention q [B, T, N, H]")
    ways = math.prod(mesh.shape[a] for a in axes)
    split = math.prod(mesh.shape[a] for a in names_of(spec[2]))  # query heads' devices
    if strategy == "ulysses" and q.shape[2] // split % ways:
        over = "".join(
            f" over mesh.{a}={mesh.shape[a]}" for a in names_of(spec[2]) if mesh.shape[a] > 1
        )
        raise LayoutError(
            f"context.attention=ulysses splits each device's {q.shape[2] // split} query "
            f"heads (model.n_heads={q.shape[2]}{over}) over "
            f"{'×'.join(f'mesh.{a}' for a in axes)}={ways}, which does not divide them; "
            "change model.n_heads, mesh.context or mesh.tensor, or use "
            "context.attention=all_gather"
        )
    kv_heads = rules.get("kv_heads", ())
    kv_split = math.prod(mesh.shape[a] for a in kv_heads)
    grouped = k.shape[2] != q.shape[2]  # grouped-query attention: K key/value heads
    if grouped and (
        strategy == "ring"
        or kv_heads != rules.get("heads", ())
        or (strategy == "ulysses" and k.shape[2] // kv_split % ways)
    ):
        # each device needs the key/value heads of its query heads: give every query head
        # its own (the ring's blocks then match the queries head for head; ulysses's
        # all-to-all then splits them as it splits the queries)
        k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
        grouped = False
    if not grouped:
        return spec, k, v, spec
    kv_spec = spec_for(
        (BATCH, SEQ, "kv_heads", "kv"), rules, mesh, k.shape, "attention k, v [B, T, K, H]"
    )
    return spec, k, v, kv_spec


def _all_gather(q, k, v, pos, seg=None, *, axes, causal, implementation, window):
    gather = functools.partial(jax.lax.all_gather, axis_name=axes, tiled=True)
    k_all = gather(k, axis=1)
    v_all = gather(v, axis=1)
    pos_k = gather(pos, axis=0)
    seg_k = None if seg is None else gather(seg, axis=1)
    mask = visible(pos, pos_k, causal, window, seg, seg_k)
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask, implementation=implementation)


def _ulysses(q, k, v, pos, seg=None, *, axes, causal, implementation, window):
    """Sequence shards [B, T/c, N, H] to head shards [B, T, N/c, H] and back: the
    sequence after the all-to-all is the devices' chunks in device order, the order of
    the gathered positions (and segment ids), from which the mask comes."""
    to_heads = functools.partial(
        jax.lax.all_to_all, axis_name=axes, split_axis=2, concat_axis=1, tiled=True
    )
    gather = functools.partial(jax.lax.all_gather, axis_name=axes, tiled=True)
    pos_all = gather(pos, axis=0)
    seg_all = None if seg is None else gather(seg, axis=1)
    mask = visible(pos_all, pos_all, causal, window, seg_all, seg_all)
    out = jax.nn.dot_product_attention(
        to_heads(q), to_heads(k), to_heads(v), mask=mask, implementation=implementation
    )
    return jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)


def _ring(q, k, v, pos, seg=None, *, axes, causal, implementation, window):
    return ring_attention(q, k, v, pos, seg, axes, degree(), (causal, window), implementation)
