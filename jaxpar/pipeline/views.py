"""Each pipeline stage's share of a tree: the leaves it holds, the whole-mesh leaves read
in place on its devices, and its chunk of a stack of layers split over ``stage`` — views
of the same buffers: nothing is copied."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import Axis

#: the home of a state leaf that lives on the whole mesh, replicated (read in place by
#: every stage); any other home is a stage index
WHOLE = -1
#: the home of a leaf stacked on its first dim and split over ``stage``: each stage holds
#: its chunk (a stack of layers, under the spmd executor's layout)
STACKED = -2


def _array(shape: tuple, sharding: NamedSharding, shards: list[jax.Array]) -> jax.Array:
    """One array of ``shards`` (single-device buffers), in the order of ``sharding``'s
    devices (which typed arrays, RNG keys, need)."""
    order = {d: i for i, d in enumerate(sharding.mesh.devices.flat)}
    shards = sorted(shards, key=lambda x: order[next(iter(x.devices()))])
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def view_of(x: jax.Array, mesh: Mesh) -> jax.Array:
    """A whole-mesh array replicated over ``stage`` as an array on the sub-mesh ``mesh``:
    the same device buffers (nothing is copied)."""
    devices = set(mesh.devices.flat)
    shards = [s.data for s in x.addressable_shards if s.device in devices]
    return _array(x.shape, NamedSharding(mesh, x.sharding.spec), shards)


def whole_of(views: list[jax.Array], mesh: Mesh) -> jax.Array:
    """The whole-mesh array of equal per-stage replicas (their buffers, not copies)."""
    shards = [s.data for v in views for s in v.addressable_shards]
    return _array(views[0].shape, NamedSharding(mesh, views[0].sharding.spec), shards)


def moved(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """``x`` (on another stage's sub-mesh, laid out by ``spec``) on the sub-mesh ``mesh``:
    each shard copied to the device at the same place of ``mesh`` — a device of the same
    process when the stages lie within hosts, so every process moves its own shards."""
    sharding = NamedSharding(mesh, spec)
    target = dict(zip(x.sharding.mesh.devices.flat, mesh.devices.flat))
    return _array(
        x.shape, sharding, [jax.device_put(s.data, target[s.device]) for s in x.addressable_shards]
    )


def chunk_spec(spec: P) -> P:
    """The spec of a stage's chunk of a leaf split over ``stage`` on its first dim."""
    entries = list(spec)
    return P(None, *entries[1:])


def chunk_view(x: jax.Array, mesh: Mesh) -> jax.Array:
    """The sub-mesh ``mesh``'s chunk of a whole-mesh array split over ``stage`` on its first
    dim (its devices' buffers)."""
    devices = set(mesh.devices.flat)
    shards = [s.data for s in x.addressable_shards if s.device in devices]
    shape = (x.shape[0] // x.sharding.mesh.shape[Axis.STAGE], *x.shape[1:])
    return _array(shape, NamedSharding(mesh, chunk_spec(x.sharding.spec)), shards)


def stack_of(chunks: list[jax.Array], mesh: Mesh) -> jax.Array:
    """The whole-mesh array of the stages' chunks (in stage order), split over ``stage`` on
    its first dim (their buffers)."""
    shards = [s.data for c in chunks for s in c.addressable_shards]
    shape = (chunks[0].shape[0] * len(chunks), *chunks[0].shape[1:])
    spec = P(Axis.STAGE, *tuple(chunks[0].sharding.spec)[1:])
    return _array(shape, NamedSharding(mesh, spec), shards)


@functools.cache
def sum_over_stages(sharding: NamedSharding) -> Callable:
    """Rows ``[p, …]`` split over ``stage`` summed over the stages, placed as ``sharding``
    (a whole-mesh program)."""
    return jax.jit(lambda rows: rows.sum(0), out_shardings=sharding)


def get_path(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    return tree


def put_path(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
