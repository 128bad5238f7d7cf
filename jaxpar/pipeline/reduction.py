"""How the SPMD pipeline executor's results leave its ``shard_map``: once per step, after
the scan.

Loss and metrics are summed over ``stage`` and the batch axes. The gradients of the
parameters outside the stacked layers are summed over ``stage``; every gradient is then
all-reduced over the batch axes, or, for a parameter sharded over ``fsdp``,
reduce-scattered over ``fsdp`` and all-reduced over ``data``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.axes import Axis


@dataclass(frozen=True)
class Reduction:
    """How results leave the shard_map, once per step after the scan.

    ``dims``: per gradient leaf of (other params, stacked layers as [v, 1, Lc, …]),
    the dim to reduce-scatter over ``fsdp``, or −1 to all-reduce over the batch axes.
    """

    batch_axes: tuple[str, ...]
    dims: tuple[Any, Any]

    def grad(self, g: jax.Array, dim: int) -> jax.Array:
        if dim < 0:
            return jax.lax.psum(g, self.batch_axes) if self.batch_axes else g
        # Scatter first, then all-reduce the 1/fsdp shard over data: the textbook order,
        # which moves (n−1)/n·S + 2(d−1)/d·S/n instead of 2(d−1)/d·S + (n−1)/n·S.
        g = jax.lax.psum_scatter(g, Axis.FSDP, scatter_dimension=dim, tiled=True)
        data_axes = tuple(a for a in self.batch_axes if a != Axis.FSDP)
        return jax.lax.psum(g, data_axes) if data_axes else g

    def __call__(self, loss, metrics, g_layers, g_rest):
        loss, metrics = jax.lax.psum((loss, metrics), (Axis.STAGE, *self.batch_axes))
        g_rest = jax.tree.map(self.grad, jax.lax.psum(g_rest, Axis.STAGE), self.dims[0])
        g_layers = jax.tree.map(lambda g, dim: self.grad(g[:, None], dim), g_layers, self.dims[1])
        return loss, metrics, g_layers, g_rest

    def out_specs(self, layers: Any, rest: Any) -> tuple[Any, Any]:
        """Specs of the (stacked-layer, other) gradients: 'stage' on the chunk dim of the
        layers, 'fsdp' where reduce-scattered."""

        def spec(dim, rank, lead=()):
            entries = [*lead, *[None] * (rank - len(lead))]
            if dim >= 0:
                entries[dim] = Axis.FSDP
            return P(*entries)

        return (
            jax.tree.map(lambda w, d: spec(d, w.ndim, (None, Axis.STAGE)), layers, self.dims[1]),
            jax.tree.map(lambda w, d: spec(d, w.ndim), rest, self.dims[0]),
        )


def fsdp_dims(
    specs: Any, key: str, layers: Any, rest: Any, batch_axes: tuple[str, ...]
) -> tuple[Any, Any]:
    """Reduce-scatter dims for :class:`Reduction` from the parameters' specs.

    Without specs or without an ``fsdp`` axis every gradient is all-reduced (−1). A
    stored dim i of a stacked layer is dim i + 2 of its [v, 1, Lc, …] view.
    """
    if specs is None or Axis.FSDP not in batch_axes:
        return jax.tree.map(lambda _: -1, rest), jax.tree.map(lambda _: -1, layers)

    def dim_of(spec, shift):
        for i, entry in enumerate(spec):
            if entry == Axis.FSDP and (i > 0 or shift == 0):
                return i + shift
        return -1

    is_spec = lambda x: isinstance(x, P)
    rest_dims = {
        k: jax.tree.map(lambda s: dim_of(s, 0), v, is_leaf=is_spec)
        for k, v in specs.items()
        if k != key
    }
    return rest_dims, jax.tree.map(lambda s: dim_of(s, 2), specs[key], is_leaf=is_spec)
