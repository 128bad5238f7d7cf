"""Each pipeline stage's share of a tree: the leaves it holds, and the whole-mesh leaves
read in place on its devices (views of the same buffers: nothing is copied)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: the home of a state leaf that lives on the whole mesh, replicated (read in place by
#: every stage); any other home is a stage index
WHOLE = -1


def view_of(x: jax.Array, mesh: Mesh) -> jax.Array:
    """A whole-mesh array replicated over ``stage`` as an array on the sub-mesh ``mesh``:
    the same device buffers (nothing is copied)."""
    devices = set(mesh.devices.flat)
    shards = [s.data for s in x.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, x.sharding.spec),
                                                    shards)


def whole_of(views: list[jax.Array], mesh: Mesh) -> jax.Array:
    """The whole-mesh array of equal per-stage replicas (their buffers, not copies)."""
    shards = [s.data for v in views for s in v.addressable_shards]
    return jax.make_array_from_single_device_arrays(views[0].shape,
                                                    NamedSharding(mesh, views[0].sharding.spec),
                                                    shards)


def stacked_of(views: list[jax.Array], mesh: Mesh) -> jax.Array:
    """Per-stage arrays of shape [1, …] as one whole-mesh array [p, …] split over
    ``stage`` (their buffers): what a whole-mesh program reduces over the stages."""
    shards = [s.data for v in views for s in v.addressable_shards]
    shape = (len(views), *views[0].shape[1:])
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, P("stage", *[None] * (len(shape) - 1))), shards)


def get_path(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    return tree


def put_path(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
