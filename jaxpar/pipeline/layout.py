"""The layout value: what engine code needs to know about where a run's arrays live (it
lives beside the pipeline's tick table, which it holds).

The :class:`~jaxpar.plan.Plan` decides a layout once and hands engine code (the gradient
strategies, the pipeline executors) one frozen :class:`Layout` instead of loose
arguments. It holds the device mesh, the logical-axis rules, how attention runs across a
split sequence, the parameters' and the batch's ``PartitionSpec`` trees (scaling-book
notation: ``W[D_fsdp, F_tensor]``), the pipeline's tick table and the accumulation
settings. A new layout option is a new field here, read where it is used.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from jaxpar.axes import BATCH_AXES, Axis
from jaxpar.context import ContextConfig
from jaxpar.logical import Rules, activation_rules
from jaxpar.pipeline.ticks import TickTable
from jaxpar.tensor_parallel import TensorConfig


@dataclass(frozen=True, kw_only=True, eq=False)
class Layout:
    """One run's layout, as engine code reads it.

    Attributes:
      mesh: the device mesh (an abstract one inside a ``shard_map``: :meth:`manual`).
      rules: logical axis name → mesh axes.
      context: how attention runs when ``mesh.context`` > 1 splits each sequence.
      tensor: how tensor parallelism runs (sequence parallelism, overlap).
      param_specs: the parameters' ``PartitionSpec`` tree (None: not decided yet).
      batch_specs: the spec of each batch entry.
      table: the pipeline schedule's tick table, None without pipeline stages.
      grad_accum: microbatches accumulated per step (``train.grad_accum``).
      fsdp_gather_once: FSDP-sharded weights are gathered once per step and kept through
        the accumulation loop (``train.fsdp_gather=once`` where it has an effect).
      grad_bucket_bytes: the gradients' bucket size over ``data`` as asked
        (``train.grad_bucket_mb``; None: the platform's, :func:`jaxpar.buckets.auto_bytes`).
      platform: the platform the run is planned for (``cpu``, ``gpu``, ``tpu``): its
        mesh's devices', or a cluster's that is not here (an abstract mesh).
    """

    mesh: Mesh | AbstractMesh
    rules: Rules
    context: ContextConfig = field(default_factory=ContextConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    param_specs: Any = None
    batch_specs: Mapping[str, PartitionSpec] = field(default_factory=dict)
    table: TickTable | None = None
    grad_accum: int = 1
    fsdp_gather_once: bool = False
    grad_bucket_bytes: int | None = 0
    platform: str = ""

    @property
    def stages(self) -> int:
        """Pipeline stages (the size of mesh axis ``stage``)."""
        return self.mesh.shape[Axis.STAGE]

    def batch_axes(self) -> tuple[Axis, ...]:
        """The batch axes (``data``, ``fsdp``) of size above 1."""
        return tuple(a for a in BATCH_AXES if self.mesh.shape[a] > 1)

    def batch_shards(self) -> int:
        """How many shards the batch axes of size above 1 cut the batch into."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes())

    def manual(self, axes: tuple[Axis, ...]) -> Layout:
        """The layout seen inside a ``shard_map`` that makes ``axes`` manual (call it while
        tracing there): the trace's abstract mesh, and rules that no longer name ``axes``."""
        rules = {name: tuple(a for a in on if a not in axes) for name, on in self.rules.items()}
        return replace(self, mesh=jax.sharding.get_abstract_mesh(), rules=rules)

    @contextlib.contextmanager
    def activation_rules(self) -> Iterator[None]:
        """Activates this layout's rules for the model's activation constraints (and its
        context and tensor settings for ``jaxpar.attend`` and the projections) while a step is
        traced."""
        with activation_rules(self.mesh, self.rules, self.context, self.tensor):
            yield
