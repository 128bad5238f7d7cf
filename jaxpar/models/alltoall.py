"""Expert parallelism by **all-to-all** dispatch (``model.moe_dispatch=all_to_all``): each
device sends only the assignments routed to another device's experts, with
``jax.lax.ragged_all_to_all``, and gets their outputs back the same way.

Inside :func:`jaxpar.models.moe.moe_mlp`'s ``shard_map`` over the ``e`` devices of the
expert axes, each holding ``E/e`` experts, a device with ``n`` tokens routed to ``k``
experts each:

1. sorts its ``n·k`` assignments by expert — so by destination device — and counts them
   (``send_sizes[d]``: its assignments to device ``d``'s experts);
2. exchanges the counts per expert with one small ``all_to_all``, from which every device
   knows where each sender's rows land in its buffer (the senders' blocks in device order,
   each sorted by expert);
3. ``ragged_all_to_all`` moves the rows, the experts run on the received rows grouped by
   expert (one ``ragged_dot`` per projection), and a second ``ragged_all_to_all`` returns
   the outputs to where their rows came from; the routing weights never travel.

The receive buffer is the dropless worst case, ``e·n·k`` rows (every assignment of the
group routed to one device): memory ``k`` times the all-gather dispatch's gathered tokens,
wire bytes the routed rows only (about ``2·n·k·D·(e−1)/e`` a device each way under
balanced routing, against all-gather's ``(e−1)·n·D`` gathered plus as much scattered).

Where it runs: XLA:GPU and TPU. XLA:CPU does not implement the collective (JAX 0.10 and
0.12: "HLO opcode `ragged-all-to-all` is not supported"), so on the CPU the option is
refused in one line; the suite checks the dispatch's numbers on the CPU through
:func:`emulated`, an all-gather implementation of the collective's documented semantics,
and that the real program lowers to ``ragged_all_to_all``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.errors import LayoutError

#: The collective the dispatch calls (the suite swaps in :func:`emulated` on the CPU).
RAGGED_ALL_TO_ALL: Callable[..., jax.Array] = jax.lax.ragged_all_to_all


def refuse_on_cpu() -> None:
    """One line when the real collective would be compiled for XLA:CPU."""
    if RAGGED_ALL_TO_ALL is jax.lax.ragged_all_to_all and jax.default_backend() == "cpu":
        raise LayoutError(
            "model.moe_dispatch=all_to_all needs jax.lax.ragged_all_to_all, "
            "which XLA:CPU does not implement; on the CPU set "
            "model.moe_dispatch=all_gather (the default; same numbers)"
        )


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def dispatch(
    x_nD: jax.Array,
    experts_nk: jax.Array,
    weights_nk: jax.Array,
    run_experts: Callable[[jax.Array, jax.Array], jax.Array],
    n_local: int,
    axes: tuple[str, ...],
) -> jax.Array:
    """The weighted sum over each token's ``k`` experts [n, D], the experts spread over the
    devices of ``axes`` (``n_local`` each, device ``d`` holding experts ``d·n_local`` …);
    ``run_experts(rows, sizes)`` runs this device's experts on ``rows`` sorted by local
    expert, ``sizes[j]`` of them for expert ``j`` (rows beyond the groups give 0)."""
    n, k = experts_nk.shape
    e = jax.lax.axis_size(axes)
    flat = experts_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x_nD[order // k]
    counts = jnp.zeros(e * n_local, jnp.int32).at[flat].add(1).reshape(e, n_local)
    send_sizes = counts.sum(1)
    input_offsets = _exclusive_cumsum(send_sizes)
    received = jax.lax.all_to_all(counts, axes, 0, 0, tiled=True)  # [source, local expert]
    recv_sizes = received.sum(1)
    recv_offsets = _exclusive_cumsum(recv_sizes)
    output_offsets = jax.lax.all_to_all(recv_offsets, axes, 0, 0, tiled=True)
    buffer = jnp.zeros((e * n * k, x_nD.shape[-1]), x_nD.dtype)
    got = RAGGED_ALL_TO_ALL(
        rows, buffer, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
    )
    # the buffer holds the senders' blocks in device order, each sorted by expert: group
    # its rows by local expert (the rows past the received ones sort last, into no group)
    ends = jnp.cumsum(received.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(buffer.shape[0]), side="right")
    key = jnp.where(segment < ends.shape[0], segment % n_local, n_local)
    by_expert = jnp.argsort(key, stable=True)
    out = run_experts(got[by_expert], received.sum(0))
    out = jnp.zeros_like(out).at[by_expert].set(out)
    back = RAGGED_ALL_TO_ALL(
        out,
        jnp.zeros_like(rows),
        recv_offsets,
        recv_sizes,
        jax.lax.all_to_all(input_offsets, axes, 0, 0, tiled=True),
        send_sizes,
        axis_name=axes,
    )
    y = jnp.zeros_like(back).at[order].set(back)
    return (y * weights_nk.reshape(-1, 1).astype(y.dtype)).reshape(n, k, -1).sum(1)


def emulated(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: Any,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s documented semantics through ``all_gather`` (every
    backend; it moves every row to every device): sender ``s``'s slice ``i`` —
    ``operand[input_offsets[i]:][:send_sizes[i]]`` — goes to device ``i // (K/e)`` and is
    written at ``output_offsets[i]`` there. ``recv_sizes`` is implied by the senders'."""
    del recv_sizes
    e, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name)  # noqa: E731
    operands, starts, sizes, targets = map(
        gather, (operand, input_offsets, send_sizes, output_offsets)
    )
    per_device = input_offsets.shape[0] // e
    j = jnp.arange(output.shape[0])
    result = output
    for s in range(e):
        for t in range(per_device):
            i = me * per_device + t
            at, size, start = targets[s, i], sizes[s, i], starts[s, i]
            inside = (j >= at) & (j < at + size)
            src = jnp.clip(start + j - at, 0, operand.shape[0] - 1)
            mask = inside.reshape(-1, *([1] * (output.ndim - 1)))
            result = jnp.where(mask, operands[s][src], result)
    return result
