"""Gradients summed over devices in a few large buffers, not one collective per array
(``train.grad_bucket_mb``; PyTorch DDP's buckets).

Where the step reduces gradients itself (:class:`jaxpar.gradients.AccumulatedPerDataShard`,
``data`` manual), the arrays are laid end to end in buckets of at most ``bucket_bytes``
(a larger array alone), in the tree's order and of one dtype each, and each bucket is one
``psum``; the sums are cut back into the arrays. A collective costs a fixed time per call
besides its bytes — measured here, ~4 ms per array for gloo between two processes of one
core each, XLA:CPU making one call per array of a combined all-reduce — so the step's
reduction costs its number of buckets rather than its number of arrays.

Each element is the same sum of the same ``n`` values in either layout, so the result is
the per-array reduction's, bit for bit (tested).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: ``train.grad_bucket_mb=auto`` by platform: buckets where each array of a combined
#: all-reduce is a call of its own (XLA:CPU's gloo; measured in docs/performance.md); XLA's
#: reduction elsewhere, one combined collective per layer inside the backward scan that a
#: GPU's scheduler can overlap with the rest of the backward pass.
AUTO_BYTES = {"cpu": 25 * 2**20}


def auto_bytes(platform: str) -> int:
    """The bucket size ``train.grad_bucket_mb=auto`` stands for on ``platform``."""
    return AUTO_BYTES.get(platform, 0)


def platform_of(mesh: Any) -> str:
    """The platform of ``mesh``'s devices (an abstract mesh: JAX's default backend)."""
    concrete = isinstance(mesh, jax.sharding.Mesh)
    return mesh.devices.flat[0].platform if concrete else jax.default_backend()


def groups(leaves: list[Any], bucket_bytes: int) -> list[list[int]]:
    """The buckets of ``leaves`` (arrays or shapes with a dtype) as lists of their
    indices: consecutive leaves of one dtype while they fit in ``bucket_bytes``; 0: one
    leaf a bucket (a collective per array)."""
    out: list[list[int]] = []
    size = 0
    for i, leaf in enumerate(leaves):
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        same = out and np.dtype(leaves[out[-1][0]].dtype) == np.dtype(leaf.dtype)
        if same and bucket_bytes and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def psum_in_buckets(tree: Any, axis: str, bucket_bytes: int) -> Any:
    """``jax.lax.psum(tree, axis)`` as one ``psum`` per bucket (:func:`groups`), inside a
    ``shard_map`` where ``axis`` is manual. An array alone in its bucket is summed as it
    lies: laid out flat, one split over the mesh's other (automatic) axes would be
    gathered whole first (so a layout that splits parameters has no buckets:
    :func:`jaxpar.plan.strategy.bucket_bytes`)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    for group in groups(leaves, bucket_bytes):
        if len(group) == 1:
            out[group[0]] = jax.lax.psum(leaves[group[0]], axis)
            continue
        flat = jax.lax.psum(jnp.concatenate([jnp.ravel(leaves[i]) for i in group]), axis)
        ends = np.cumsum([leaves[i].size for i in group])
        for i, piece in zip(group, jnp.split(flat, ends[:-1]), strict=True):
            out[i] = piece.reshape(jnp.shape(leaves[i]))
    return jax.tree.unflatten(treedef, out)
