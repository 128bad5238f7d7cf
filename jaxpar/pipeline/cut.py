"""A model cut by layer into pipeline chunks of any shapes (``Task.layers``), and the
sub-meshes the chunks run on.

The layers (``Layers.of(model)``) are cut into ``C = p·v`` contiguous chunks; chunk ``c``
runs on stage ``c % p`` (for ``v > 1`` a stage holds chunks ``d, d+p, …``, as the
interleaved schedule wants). The cut balances the chunks' parameter bytes (the largest
chunk as small as it can be, a layer with no parameters counting one byte) unless
``pipeline.split`` gives the layers per chunk. Every variable of the model belongs to the
layer whose path it lies under; a variable under no layer, or a layer inside another,
cannot be cut and is refused.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpar import sharding as shd
from jaxpar.axes import Axis
from jaxpar.errors import LayoutError, TaskError
from jaxpar.task import Task

#: A parameter path in the pure dict (``('layers', 0)``).
Path = tuple[Any, ...]


@dataclass(frozen=True)
class Layer:
    """One layer of the sequence: its graph (None for a plain function, then ``fn``),
    its path in the model's pure dicts and its parameter bytes."""

    graphdef: nnx.GraphDef | None
    path: Path | None
    fn: Any
    nbytes: int


@dataclass(frozen=True)
class LayerCut:
    """The layers and the chunks they are cut into: ``chunks[c] = (start, stop)``."""

    layers: tuple[Layer, ...]
    chunks: tuple[tuple[int, int], ...]

    def paths(self, c: int) -> list[Path]:
        """The paths of chunk ``c``'s layers that hold variables."""
        start, stop = self.chunks[c]
        return [layer.path for layer in self.layers[start:stop] if layer.path is not None]

    def chunk_bytes(self) -> list[int]:
        return [sum(layer.nbytes for layer in self.layers[a:b]) for a, b in self.chunks]


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """``mesh`` cut along ``stage``: one sub-mesh per stage, over that stage's devices,
    with the same axes (``stage`` of size 1), so the rules apply inside every stage
    unchanged.

    Raises:
      LayoutError: for an abstract mesh (a plan for devices not here).
    """
    if not isinstance(mesh, Mesh):
        raise LayoutError(
            "the sub-mesh executor plans on devices that are here only: plan a cluster's "
            "pipeline with pipeline.executor=spmd (the same stages in one program)"
        )
    axis = mesh.axis_names.index(Axis.STAGE)
    return [
        Mesh(np.take(mesh.devices, [s], axis=axis), mesh.axis_names, axis_types=mesh.axis_types)
        for s in range(mesh.shape[Axis.STAGE])
    ]


def cut_by_layer(
    task: Task, params: Any, state: Any, chunks: int, split: tuple[int, ...] = ()
) -> LayerCut:
    """The layers of ``task``'s model (``params``/``state``: its abstract pure dicts) cut
    into ``chunks`` contiguous chunks.

    Raises:
      TaskError: for a model without ``Task.layers``, a variable under no layer, a layer
        inside another or used twice.
      LayoutError: for a ``split`` that does not fit, or fewer layers than chunks.
    """
    if task.layers is None:
        raise TaskError(
            "pipeline.executor=mpmd cuts a model by layer, but this task declares no layers; "
            "give the Task layers=jaxpar.Layers(inputs=…, loss=…) (its model a sequence of "
            "layers, e.g. an nnx.Sequential), or a StageSplit with the spmd executor"
        )
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: task.model_fn(nnx.Rngs(0)))
    paths = {id(module): tuple(path) for path, module in nnx.iter_modules(model)}
    layers = tuple(_layer(item, paths) for item in task.layers.of(model))
    _check_cover(layers, params, state)
    sizes = split or _balanced([layer.nbytes or 1 for layer in layers], chunks)
    if len(sizes) != chunks or sum(sizes) != len(layers) or min(sizes) < 1:
        raise LayoutError(
            f"pipeline.split={list(split)} must give {chunks} chunks (mesh.stage × "
            f"pipeline.virtual_stages), each of at least one layer, summing to the model's "
            f"{len(layers)} layers; e.g. pipeline.split={_example(len(layers), chunks)}"
            if len(layers) >= chunks
            else f"the model has {len(layers)} layers, fewer than the {chunks} chunks of "
            "mesh.stage × pipeline.virtual_stages; lower mesh.stage (each stage needs a "
            "layer)"
        )
    ends = np.cumsum([0, *sizes])
    return LayerCut(layers, tuple((int(a), int(b)) for a, b in itertools.pairwise(ends)))


def _layer(item: Any, paths: dict[int, Path]) -> Layer:
    """A layer of the list: a module of the model (found by identity), or a function."""
    if not isinstance(item, nnx.Module):
        if not callable(item):
            raise TaskError(
                f"Task.layers: {item!r} is neither an nnx.Module of the model "
                "nor a function; list the model's layers in order"
            )
        return Layer(None, None, item, 0)
    if id(item) not in paths:
        raise TaskError(
            f"Task.layers: a {type(item).__name__} in the list is not a "
            "submodule of the model; list the model's own layers"
        )
    graphdef, _variables = nnx.split(item)
    nbytes = sum(
        math.prod(x.shape) * shd.itemsize(x.dtype)
        for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(item, nnx.Param)))
    )
    return Layer(graphdef, paths[id(item)], None, nbytes)


def _check_cover(layers: tuple[Layer, ...], params: Any, state: Any) -> None:
    """Each variable of the model lies under exactly one layer's path."""
    owned = [layer.path for layer in layers if layer.path is not None]
    for i, a in enumerate(owned):
        for b in owned[i + 1 :]:
            if a[: len(b)] == b or b[: len(a)] == a:
                raise TaskError(
                    f"Task.layers: layer {_show(a)} and layer {_show(b)} overlap "
                    "(one is the other, or inside it); list each layer once"
                )
    for tree in (params, state):
        for path, _ in jax.tree_util.tree_leaves_with_path(tree):
            keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
            if not any(keys[: len(p)] == p for p in owned):
                raise TaskError(
                    f"Task.layers: variable {_show(keys)} belongs to none of the layers, so no "
                    "stage would hold it; make it part of a layer, or list the module that "
                    "holds it"
                )


def _balanced(costs: list[int], chunks: int) -> list[int]:
    """Layers per chunk of the contiguous cut whose largest chunk cost is smallest (ties:
    the earlier cut); every chunk gets a layer."""
    n = len(costs)
    if n < chunks:
        return []
    prefix = np.cumsum([0, *costs])
    best = {(0, 0): (0, ())}  # (layers used, chunks made) -> (max cost, sizes)
    for k in range(1, chunks + 1):
        for end in range(k, n - (chunks - k) + 1):
            options = [
                (
                    max(best[(start, k - 1)][0], int(prefix[end] - prefix[start])),
                    best[(start, k - 1)][1] + (end - start,),
                )
                for start in range(k - 1, end)
                if (start, k - 1) in best
            ]
            best[(end, k)] = min(options)
    return list(best[(n, chunks)][1])


def _example(layers: int, chunks: int) -> list[int]:
    base, extra = divmod(layers, chunks)
    return [base + (i < extra) for i in range(chunks)]


def _show(path: Path) -> str:
    return "/".join(map(str, path)) or "(the model)"
