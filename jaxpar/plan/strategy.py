"""The plan's choice of gradient strategy (:mod:`jaxpar.gradients`) for a layout.

The pipeline or a plain step, accumulated over ``train.grad_accum`` microbatches when it
is above 1: per data shard (one all-reduce over ``data`` per step) where that is
possible, else on the automatic path; FSDP-sharded weights gathered once per step or per
microbatch (``train.fsdp_gather``).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, get_args

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.axes import Axis
from jaxpar.buckets import auto_bytes, platform_of
from jaxpar.errors import ConfigError
from jaxpar.gradients import (
    Accumulated,
    AccumulatedPerDataShard,
    ModelLoss,
    Pipelined,
    Plain,
    Strategy,
)
from jaxpar.logical import spec_axes, spec_leaves, without_batch_axes
from jaxpar.pipeline.layout import Layout

#: When accumulation gathers FSDP-sharded weights (``train.fsdp_gather``).
FsdpGather = Literal["per_microbatch", "once"]


def gradient_strategy(
    loss: ModelLoss,
    layout: Layout,
    param_shardings: Any,
    pipelined: Pipelined | None,
    stateful: bool,
) -> Strategy:
    """The pipeline or a plain step, accumulated over ``layout.grad_accum`` microbatches
    when it is above 1 (locally per data shard when possible); with
    ``layout.fsdp_gather_once`` FSDP-sharded weights are gathered once per step for the
    accumulation. ``stateful``: the model has state besides RNG streams (BatchNorm
    statistics, FP8 histories), which a data shard would make its own."""
    inner: Strategy = pipelined or Plain(loss, layout)
    per_shard = pipelined is None and per_data_shard_possible(
        layout.mesh, layout.param_specs, stateful
    )
    buckets = bucket_bytes(layout) if per_shard else 0
    if layout.grad_bucket_bytes and not buckets:  # asked for (not auto): say it is not used
        warnings.warn(
            "config key 'train.grad_bucket_mb' has no effect with this layout: buckets need "
            "every parameter whole on each device, a data axis, no pipeline stages and a "
            "model without state but RNG streams keyed by example (Task.draws_by_example; "
            "docs/performance.md, Gradient buckets)",
            stacklevel=4,
        )
    if layout.grad_accum == 1:
        return (
            AccumulatedPerDataShard(loss, layout, None, buckets) if per_shard and buckets else inner
        )
    once = layout.fsdp_gather_once
    gathered = gathered_specs(layout.param_specs) if once else None
    if per_shard:
        return AccumulatedPerDataShard(loss, layout, gathered, buckets)
    return Accumulated(
        inner,
        layout.grad_accum,
        param_shardings,
        shd.named(layout.mesh, gathered) if once else None,
        per_call=layout.table.m if pipelined is not None else 1,
    )


def bucket_bytes(layout: Layout) -> int:
    """The bucket size the step sums gradients over ``data`` in (:mod:`jaxpar.buckets`):
    ``layout.grad_bucket_bytes`` where no parameter is split over any axis (the buckets
    lay whole arrays end to end; a split one would be gathered to be laid), else 0 (XLA's
    reduction). None (auto): the mesh's platform's default without ``context``; with it
    0, as the per-shard step under ``context`` holds the position embeddings' gradient
    whole over the sequence (tests/test_context.py)."""
    specs = spec_leaves(layout.param_specs)
    if any(spec_axes(s) for s in specs):
        return 0
    asked = layout.grad_bucket_bytes
    if asked is not None:
        return asked
    platform = layout.platform or platform_of(layout.mesh)
    return 0 if layout.mesh.shape[Axis.CONTEXT] > 1 else auto_bytes(platform)


def per_data_shard_possible(mesh: Mesh, param_specs: Any, stateful: bool) -> bool:
    """Whether :class:`~jaxpar.gradients.AccumulatedPerDataShard` applies: a data axis, no
    parameter sharded over it, a model without state but RNG streams (``stateful``: it has
    other state), and not ``fsdp`` × ``tensor``
    together (there XLA 0.10's SPMD partitioner aborts on the partly manual program: a
    failed check in spmd_partitioner_util.cc)."""
    if mesh.shape[Axis.DATA] == 1 or stateful:
        return False
    if mesh.shape[Axis.FSDP] > 1 and mesh.shape[Axis.TENSOR] > 1:
        return False
    return not any(Axis.DATA in spec_axes(s) for s in spec_leaves(param_specs))


def gathered_specs(param_specs: Any) -> Any:
    """The parameters' specs without the batch axes (``data``, ``fsdp``): FSDP-sharded
    parameters gathered, tensor and stage splits kept."""
    return jax.tree.map(
        without_batch_axes, param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def gathers_weights(param_specs: Any) -> bool:
    """Whether any parameter is sharded over a batch axis (and so gathered before use)."""
    return gathered_specs(param_specs) != param_specs


def gather_once(setting: str, grad_accum: int, param_specs: Any) -> bool:
    """Whether ``train.fsdp_gather=once`` has an effect (a warning, attributed to the
    caller of :func:`~jaxpar.plan.make_plan`, says when it has none).

    Raises:
      ConfigError: for an unknown setting.
    """
    if setting not in get_args(FsdpGather):
        raise ConfigError(
            f"train.fsdp_gather must be one of {', '.join(get_args(FsdpGather))}, got {setting!r}"
        )
    if setting != "once":
        return False
    if grad_accum == 1 or not gathers_weights(param_specs):
        why = "train.grad_accum=1" if grad_accum == 1 else "no parameter sharded over data or fsdp"
        warnings.warn(f"config key 'train.fsdp_gather' has no effect with {why}", stacklevel=4)
        return False
    return True
