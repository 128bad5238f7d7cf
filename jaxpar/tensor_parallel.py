"""How tensor parallelism runs (the ``tensor`` section): sequence parallelism, and the
collective matmuls that overlap its communication with compute.

**Sequence parallelism** (``tensor.sequence``, Megatron-SP) is a rule: the residual stream
between blocks, the logical ``act_seq`` axis, is split over ``tensor`` as well as
``context`` (:func:`jaxpar.rules.sequence_parallel`). XLA then gathers a block's input
before its column-parallel matmuls and reduce-scatters its output after the row-parallel
ones.

**Overlapped tensor parallelism** (``tensor.overlap``) hides that gather and that
reduce-scatter behind the matmuls they feed:

* ``collective_matmul`` — JAX's collective-matmul pattern, inside ``shard_map`` over the
  ``tensor`` axis (the others stay automatic). A column-parallel matmul ``x[B, T_t, D] ·
  W[D, F_t]`` runs in t steps: each multiplies the sequence chunk a device holds while it
  passes that chunk on to its neighbour (``ppermute``), so after t steps every device has
  all of ``[B, T, F_t]`` and no all-gather ran. A row-parallel matmul ``h[B, T, F_t] ·
  W[F_t, D]`` computes one chunk's partial sum per step and adds it to the running sum its
  neighbour passed it: after t steps each device holds its chunk ``[B, T_t, D]`` summed
  over the group, and no reduce-scatter ran. Autodiff gives the backward pass the mirrored
  pattern. Exact: the same products, summed in another order.
* ``xla`` — the same decomposition left to XLA's GPU compiler (its windowed einsum:
  ``xla_gpu_multi_streamed_windowed_einsum`` with a zero threshold); a GPU only.

A model's matmuls that may be tensor-parallel go through :func:`matmul` with their
weight's logical names; outside a step, or without ``tensor.overlap``, it is
``jnp.einsum``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
from pydantic import Field

from jaxpar.axes import Axis
from jaxpar.errors import ConfigError, LayoutError
from jaxpar.logical import (
    ACT_SEQ,
    BATCH,
    SEQ,
    active_layout,
    active_options,
    constrain,
    gathered,
    names_of,
    spec_for,
    split_over,
)
from jaxpar.schema import section

#: ``tensor.overlap`` values.
Overlap = Literal["none", "collective_matmul", "xla"]


@section("tensor")
class TensorConfig:
    """How tensor parallelism (``mesh.tensor`` > 1) runs."""

    sequence: bool = Field(
        False,
        description="sequence parallelism (Megatron-SP): the residual stream between the "
        "column- and row-parallel matmuls (norms, residual adds, dropout) split over the "
        "sequence on the tensor axis; an all-gather before each block and a reduce-scatter "
        "after it replace its all-reduce, and that activation memory is divided by "
        "mesh.tensor",
    )
    overlap: Overlap = Field(
        "none",
        description="overlap sequence parallelism's gathers and reduce-scatters with the "
        "matmuls: collective_matmul (ppermute steps interleaved with the matmul's pieces, "
        "inside shard_map; needs tensor.sequence=true) or xla (XLA's windowed einsum; a "
        "GPU only)",
    )


#: XLA options of ``tensor.overlap=xla`` (XLA's GPU compiler only)
XLA_OVERLAP_OPTIONS = {
    "xla_gpu_multi_streamed_windowed_einsum": True,
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
}


def check(tensor: TensorConfig, sizes: Mapping[str, int], platform: str, precision: str) -> None:
    """Refuses, in one line, an overlap the run cannot use: ``xla`` off a GPU,
    ``collective_matmul`` without sequence parallelism, with ``context`` > 1, or with FP8
    matmuls (whose per-tensor scales a piece of a matmul would not see);
    ``sizes``: the mesh degrees.

    Raises:
      ConfigError: naming the key and the fix.
    """
    if tensor.overlap == "xla" and platform != "gpu":
        raise ConfigError(
            f"tensor.overlap=xla sets XLA's GPU windowed-einsum options, which XLA:"
            f"{platform.upper()} does not have; use tensor.overlap=collective_matmul"
        )
    if tensor.overlap != "collective_matmul" or sizes.get(Axis.TENSOR, 1) == 1:
        return
    if not tensor.sequence:
        raise ConfigError(
            "tensor.overlap=collective_matmul overlaps sequence parallelism's gathers and "
            "reduce-scatters: set tensor.sequence=true too"
        )
    if sizes.get(Axis.CONTEXT, 1) > 1:
        raise ConfigError(
            "tensor.overlap=collective_matmul does not run with mesh.context > 1 yet; set "
            "tensor.overlap=none there"
        )
    if precision == "fp8":
        raise ConfigError(
            "tensor.overlap=collective_matmul with model.precision=fp8: each piece of the "
            "matmul would scale by its own amax, not the tensor's; use one of them"
        )


def check_executor(tensor: TensorConfig, executor: str | None) -> None:
    """The spmd pipeline runs each stage's layers in a branch of its own, where the
    collective matmul's sends (over every device) would wait for devices in another branch.

    Raises:
      ConfigError: for ``tensor.overlap=collective_matmul`` with ``pipeline.executor=spmd``.
    """
    if tensor.overlap == "collective_matmul" and executor == "spmd":
        raise ConfigError(
            "tensor.overlap=collective_matmul does not run in the spmd pipeline's per-stage "
            "branches: set pipeline.executor=mpmd or tensor.overlap=none"
        )


def compiler_options(tensor: TensorConfig) -> dict[str, object] | None:
    """The XLA options a train step compiles with under ``tensor`` (``tensor.overlap=xla``:
    :data:`XLA_OVERLAP_OPTIONS`, which only XLA's GPU compiler knows; None otherwise)."""
    return dict(XLA_OVERLAP_OPTIONS) if tensor.overlap == "xla" else None


def matmul(
    subscripts: str,
    x: jax.Array,
    w: jax.Array,
    w_names: tuple[str | None, ...],
    dot: Callable[..., jax.Array] = jnp.einsum,
) -> jax.Array:
    """``dot(subscripts, x, w)`` of an activation ``x`` whose first two dims are batch and
    sequence (``"btd,df->btf"``) and a weight ``w`` whose dims are named ``w_names``.

    Under ``tensor.overlap=collective_matmul`` in a step whose rules split ``w`` over
    ``tensor``: a collective matmul (see the module docstring) — column-parallel when
    ``w``'s split dim is in the result, row-parallel when it is summed over. ``dot`` is
    the product of the pieces (a model's own, e.g. an FP8 one).
    """
    role = _role(subscripts, w, w_names)
    if role is None:
        return dot(subscripts, x, _read(w, w_names))
    mesh, t, w_spec, letter, batch = role
    inputs, out = subscripts.split("->")
    x_sub = inputs.split(",")[0]
    rows = batch[0] if len(batch) == 1 else (batch or None)
    if letter in out:  # column-parallel: x's sequence gathered piece by piece
        body = functools.partial(_gathered, subscripts=subscripts, t=t, dot=dot)
        x_spec = PartitionSpec(rows, Axis.TENSOR)
        out_spec = PartitionSpec(rows, *(Axis.TENSOR if c == letter else None for c in out[1:]))
    else:  # row-parallel: the result reduce-scattered over the sequence piece by piece
        body = functools.partial(_scattered, subscripts=subscripts, t=t, dot=dot)
        x_spec = PartitionSpec(rows, *(Axis.TENSOR if c == letter else None for c in x_sub[1:]))
        out_spec = PartitionSpec(rows, Axis.TENSOR)
    # the batch axes manual too: each piece's weight gradient is a partial sum over the
    # device's rows, summed over them once, as the shard_map's input, not once a piece;
    # in float32 (XLA:CPU aborts on that sum in bfloat16, and sums bfloat16 in float32
    # anyway): the weight enters as float32 and is cast back inside
    return jax.shard_map(
        lambda x, w32: body(x, w32.astype(w.dtype)),
        mesh=mesh,
        in_specs=(x_spec, w_spec),
        out_specs=out_spec,
        axis_names=frozenset({Axis.TENSOR, *batch}),
        check_vma=False,
    )(x, w.astype(jnp.promote_types(w.dtype, jnp.float32)))


def _read(w: jax.Array, w_names: tuple[str | None, ...]) -> jax.Array:
    """``w`` as a plain product reads it: gathered over the batch axes first
    (:func:`~jaxpar.logical.gathered`) where the sequence is split over both ``tensor``
    (sequence parallelism) and ``context``. There XLA 0.10's partitioner, left to gather
    an FSDP-sharded weight itself, gathers the activations over ``fsdp`` instead for the
    output projections and the input gradients of the input projections, each product
    then over twice a device's tokens (gpt_tiny ``fsdp=2,context=2,tensor=2,
    tensor.sequence=true``: 3.72 GFLOP a step against 2.92; docs/lab.md). Elsewhere ``w``
    as it is."""
    layout = active_layout()
    if layout is None:
        return w
    mesh, rules, _ = layout
    sizes = mesh.shape
    if Axis.TENSOR not in split_over(rules, sizes, ACT_SEQ) or not split_over(rules, sizes, SEQ):
        return w
    return gathered(w, w_names)


def _role(
    subscripts: str, w: jax.Array, w_names: tuple[str | None, ...]
) -> tuple[object, int, PartitionSpec, str, tuple[str, ...]] | None:
    """The mesh, the tensor degree, ``w``'s spec over ``tensor`` alone, the subscript
    letter of its split dim and the batch's mesh axes, when :func:`matmul` runs as a
    collective matmul; else None.

    Raises:
      LayoutError: for a layout collective matmuls cannot run (no sequence parallelism,
        a sequence split over ``context`` too).
    """
    layout = active_layout()
    tensor = active_options(TensorConfig)
    if layout is None or tensor is None or tensor.overlap != "collective_matmul":
        return None
    mesh, rules, _ = layout
    t = mesh.shape.get(Axis.TENSOR, 1)
    if t == 1:
        return None
    if Axis.TENSOR not in split_over(rules, mesh.shape, ACT_SEQ):
        raise LayoutError(
            "tensor.overlap=collective_matmul overlaps sequence parallelism's gathers and "
            "reduce-scatters: set tensor.sequence=true (or tensor.overlap=none)"
        )
    if split_over(rules, mesh.shape, SEQ):
        raise LayoutError(
            "tensor.overlap=collective_matmul does not run with mesh.context > 1 (the "
            "sequence's chunks would cross both axes); set tensor.overlap=none there"
        )
    spec = spec_for(w_names, rules, mesh, w.shape, f"weight {tuple(w_names)}")
    split = [i for i, entry in enumerate(spec) if Axis.TENSOR in names_of(entry)]
    if not split:
        return None
    letter = subscripts.split("->")[0].split(",")[1][split[0]]
    w_spec = PartitionSpec(*(Axis.TENSOR if i == split[0] else None for i in range(w.ndim)))
    return mesh, t, w_spec, letter, split_over(rules, mesh.shape, BATCH)


def _gathered(x, w, *, subscripts, t, dot):
    """Column-parallel, inside ``shard_map``: each of ``t`` steps multiplies the sequence
    chunk held now and passes it to the previous device, so that at step i device r holds
    chunk r + i; the result [B, T, …] is assembled chunk by chunk."""
    r = lax.axis_index(Axis.TENSOR)
    chunk = x.shape[1]
    to_previous = [(j, (j - 1) % t) for j in range(t)]
    out = None
    for i in range(t):
        following = lax.ppermute(x, Axis.TENSOR, to_previous) if i < t - 1 else None
        piece = dot(subscripts, x, w)
        if out is None:
            out = jnp.zeros((piece.shape[0], chunk * t, *piece.shape[2:]), piece.dtype)
        out = lax.dynamic_update_slice_in_dim(out, piece, ((r + i) % t) * chunk, axis=1)
        x = following
    return out


def _scattered(x, w, *, subscripts, t, dot):
    """Row-parallel, inside ``shard_map``: at step i device r computes its partial sum of
    chunk r − i − 1 and adds it to the running sum the previous device passed on; after
    ``t`` steps it holds its own chunk [B, T/t, …] summed over the group."""
    r = lax.axis_index(Axis.TENSOR)
    chunk = x.shape[1] // t
    to_next = [(j, (j + 1) % t) for j in range(t)]
    total = None
    for i in range(t):
        part = lax.dynamic_slice_in_dim(x, ((r - i - 1) % t) * chunk, chunk, axis=1)
        piece = dot(subscripts, part, w)
        total = piece if total is None else lax.ppermute(total, Axis.TENSOR, to_next) + piece
    return total


def lookup(table: jax.Array, ids: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Rows ``table[ids]`` of an embedding table, as Megatron's vocabulary-parallel
    embedding looks them up.

    In a step whose rules split the vocabulary over ``tensor`` (alone, and neither the
    batch nor the sequence over it), each device looks up the ids in its own rows (the
    others give zeros) and the group sums the results: one all-reduce of the ``[…, D]``
    rows, where a lookup in the whole table would gather the table first. Exact: each
    row is one device's, the others add zeros. The table enters replicated over the
    tokens' axes, so its gradient leaves summed over them (one all-reduce of the
    ``[V/t, D]`` shard, then sliced into the table's layout); a copy per batch shard
    leaves it summed over the sequence only, for XLA to add up with the copy's other
    reads (a tied output layer's) and reduce once. Under sequence parallelism (the rules
    split ``act_seq`` over ``tensor`` after the sequence's own axes) the group
    reduce-scatters the rows along the sequence instead, as Megatron-SP does: each device
    keeps its tokens' rows, as the residual stream holds them, and the backward gathers
    their gradient (which the whole rows' sum needed from the split stream anyway), so a
    step moves a third less for them (a fifth where the stream is bfloat16: the
    rows and their gradient are float32). The rows are summed in float32 at least (XLA:CPU
    aborts on a bfloat16 sum). Elsewhere — no tensor split, no active
    layout, a batch the batch axes do not divide — a lookup in the whole table (FSDP
    gathers weights before use anyway; from a sharded table the partitioner cannot move
    the rows to the batch layout and falls back to replicating the gathered rows).

    Args:
      table: ``[V, D]``, or a copy per batch shard ``[G, V, D]`` (batch shard g's rows
        from copy g).
      ids: ``[B, …]`` token ids in ``[0, V)``: an id outside it gives zeros where the
        vocabulary is split and ``jnp.take``'s fill (NaN) elsewhere.
      names: the table's logical dim names, ``("vocab", "embed")`` (``("batch", "vocab",
        "embed")`` for copies per batch shard).

    Returns:
      ``[B, …, D]`` rows in the table's dtype (the same values however they are laid out:
      split over the sequence under sequence parallelism).
    """
    shards = names[0] == BATCH
    specs = _split_lookup(table, ids, names[shards:], shards)
    if specs is None:
        whole = constrain(table, (None, None)) if not shards else table
        rows = _whole_rows(whole, ids) if shards else jnp.take(whole, ids, axis=0)
        return _as_the_tokens(rows, ids)
    mesh, copies, ids_spec, axes = specs
    scatter = ids.ndim >= 2 and scatters_rows(active_layout()[1], mesh.shape, ids.shape[1])
    rows_spec = list(ids_spec) + [None]
    if scatter:
        rows_spec[1] = (*names_of(ids_spec[1]), Axis.TENSOR)
    rows = jax.shard_map(
        functools.partial(
            _local_rows, vocab=table.shape[-2] // mesh.shape[Axis.TENSOR], scatter=scatter
        ),
        mesh=mesh,
        in_specs=(copies, ids_spec),
        out_specs=PartitionSpec(*rows_spec),
        axis_names=axes,
    )(table.astype(jnp.promote_types(table.dtype, jnp.float32)), ids)
    return rows.astype(table.dtype)


def _as_the_tokens(rows: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of a lookup in the whole table laid out as the tokens (where their axes
    divide them): under sequence parallelism the split stream's gradient is then gathered
    (one activation) before the table's scatter-add, not the table's gradient all-reduced
    there (Megatron's order)."""
    layout = active_layout()
    if layout is None:
        return rows
    mesh, rules, _ = layout
    tokens = (BATCH, SEQ, *[None] * (ids.ndim - 2))[: ids.ndim]
    for n, name in zip(ids.shape, tokens):
        if name is not None and n % math.prod(
            mesh.shape[a] for a in split_over(rules, mesh.shape, name)
        ):
            return rows
    return constrain(rows, (*tokens, None))


def scatters_rows(
    rules: Mapping[str, tuple[str, ...]], sizes: Mapping[str, int], tokens: int
) -> bool:
    """Whether :func:`lookup`, where the rows lie, reduce-scatters them along the sequence:
    the ``rules`` split the residual stream's tokens (``act_seq``) over the sequence's axes
    and then ``tensor`` (sequence parallelism), and a device's part of a sequence of
    ``tokens`` divides among the group (``sizes``: the mesh degrees by axis; the layout lab
    asks the same of a layout it estimates)."""
    seq = split_over(rules, sizes, SEQ)
    if split_over(rules, sizes, ACT_SEQ) != (*seq, Axis.TENSOR):
        return False
    return tokens // math.prod(sizes[a] for a in seq) % sizes[Axis.TENSOR] == 0


def _split_lookup(
    table: jax.Array, ids: jax.Array, names: tuple[str | None, ...], shards: bool
) -> tuple[Any, PartitionSpec, PartitionSpec, frozenset] | None:
    """The mesh, the table's and the ids' specs and the manual axes of a lookup where
    the rows lie (:func:`lookup`), or None where the step does not split the vocabulary
    over ``tensor`` alone or the tokens do not divide among their axes."""
    layout = active_layout()
    if layout is None:
        return None
    mesh, rules, _ = layout
    spec = spec_for(names, rules, mesh, table.shape[-2:], f"embedding table {tuple(names)}")
    if mesh.shape.get(Axis.TENSOR, 1) == 1 or tuple(names_of(spec[0])) != (Axis.TENSOR,):
        return None
    # the batch's and the sequence's axes manual too: left automatic, the partitioner
    # gathers the ids and the rows
    batch, seq = split_over(rules, mesh.shape, BATCH), split_over(rules, mesh.shape, SEQ)
    dims = (batch, seq)[: ids.ndim]
    if Axis.TENSOR in (*batch, *seq) or any(
        n % math.prod(mesh.shape[a] for a in axes) for n, axes in zip(ids.shape, dims)
    ):
        return None
    if shards and table.shape[0] != math.prod(mesh.shape[a] for a in batch):
        return None
    entry = lambda axes: axes[0] if len(axes) == 1 else (axes or None)
    ids_spec = PartitionSpec(*(entry(axes) for axes in dims))
    copies = PartitionSpec(*([entry(batch)] if shards else []), Axis.TENSOR, None)
    return mesh, copies, ids_spec, frozenset({Axis.TENSOR, *batch, *seq})


def _whole_rows(tables_GVD: jax.Array, ids_BT: jax.Array) -> jax.Array:
    """The rows of batch shard g's ids from copy g of a whole table."""
    B, G = ids_BT.shape[0], tables_GVD.shape[0]
    take = jax.vmap(lambda table_VD, ids: jnp.take(table_VD, ids, axis=0))
    return take(tables_GVD, ids_BT.reshape(G, B // G, *ids_BT.shape[1:])).reshape(
        B, *ids_BT.shape[1:], -1
    )


def _local_rows(table: jax.Array, ids: jax.Array, *, vocab: int, scatter: bool) -> jax.Array:
    """Inside ``shard_map``: the rows of ``ids`` this device's ``vocab`` rows (of its
    copy, ``[1, V, D]``) hold (zeros for the others), summed over the ``tensor`` group
    (with ``scatter``, each device keeping its part of the sequence, dim 1)."""
    table_VD = table.reshape(table.shape[-2:])
    local = ids - lax.axis_index(Axis.TENSOR) * vocab
    here = (local >= 0) & (local < vocab)
    rows = jnp.where(here[..., None], jnp.take(table_VD, jnp.where(here, local, 0), axis=0), 0)
    if scatter:
        return lax.psum_scatter(rows, Axis.TENSOR, scatter_dimension=1, tiled=True)
    return lax.psum(rows, Axis.TENSOR)
