"""The mesh axes: the one place their names are written.

A mesh axis is a dimension of the device grid (``jax.sharding.Mesh``); a logical axis is a
dimension a model names (``"embed"``, ``"heads"``), mapped onto mesh axes by a rules table.
Code refers to mesh axes through :class:`Axis`, never by a string literal (a test scans the
package for one). ``Axis`` members are strings, so they stand wherever JAX takes an axis
name (``PartitionSpec``, ``psum``, ``Mesh``).
"""

from __future__ import annotations

from enum import StrEnum


class Axis(StrEnum):
    """A mesh axis of jaxpar's device mesh."""

    DATA = "data"
    STAGE = "stage"
    FSDP = "fsdp"
    CONTEXT = "context"
    TENSOR = "tensor"

    def __repr__(self) -> str:
        # as the plain name, so a PartitionSpec or an error reads P('data',), not the enum
        return repr(self.value)


#: The mesh's axes in mesh order, outermost (the slowest links) first.
MESH_AXES: tuple[Axis, ...] = tuple(Axis)

#: The axes a batch may be split over (data parallelism and FSDP).
BATCH_AXES: tuple[Axis, ...] = (Axis.DATA, Axis.FSDP)

#: The axes the pipeline executors run by hand inside ``shard_map``; the rest stay
#: automatic (XLA's partitioner).
MANUAL_AXES: tuple[Axis, ...] = (Axis.STAGE, Axis.DATA, Axis.FSDP)
