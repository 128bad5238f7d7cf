"""What the one-program pipeline executor (:mod:`jaxpar.pipeline.executor`) holds beside a
chunk's activations: the step's temporaries (:mod:`jaxpar.lab.analytic`) count them.

Read from the peak of the compiled step (XLA's live-range dump,
``--xla_dump_to``: its "stack trace breakdown for peak usage") for GPT pipelines of 2
and 4 stages, 1F1B, GPipe, zero-bubble and interleaved, with and without ``fsdp``. At the
peak a backward tick recomputes its chunk (the family's activations of one chunk,
:func:`~jaxpar.lab.activations.activation_bytes`), and beside it, per device:

* the **message slots** of the tick table — every activation and gradient slot and their
  trash slots (``act_slots + grad_slots + 2`` messages) in the scan's carry, and the two
  the tick reads out of them;
* the **tick's gradient** of its chunk's layers (the switch's output buffer, ``1/v`` of
  the stage's layers), before it is added to
* the **gradient sums**: the stage's layers and every other parameter (embedding, head:
  each stage sums its own), reduced over the batch axes only after the scan, so held
  whole over ``fsdp``;
* under ``fsdp``, the **gathered weights**: the stage's parameters enter the pipeline
  gathered, once a step;
* with virtual stages, the **stage's layers in chunk order** (a transposed copy of its
  slab, as stored; under ``fsdp`` the gathered weights are that copy) and the tick's
  chunk of them (a dynamic slice).

Left out: the few messages a tick's kernels copy, and the allocator's packing (the
compiled temporaries are the buffer the heap simulator packs them into: 3–6% above the
live bytes at the peak in these programs).
"""

from __future__ import annotations

import math
from typing import Any

import jax

from jaxpar.axes import Axis
from jaxpar.lab.staged import first_stage_message
from jaxpar.run import Run
from jaxpar.sharding import bytes_per_device, itemsize


def one_program_buffers(run: Run, cpu: bool, in_flight: int) -> float | None:
    """Bytes one device of the one-program executor holds beside its chunk's activations
    and the ``in_flight`` inputs they count (the module docstring); None where the plan
    runs no such pipeline (none, the sub-mesh executor, a model not given as a stack)."""
    plan = run.plan
    table = plan.pipeline
    split = plan.task.stages
    if table is None or plan.executor != "spmd" or split is None:
        return None
    params = plan.abstract_state.params
    shardings = plan.state_shardings.params
    key = split.layers_key
    rest = [k for k in params if k != key]
    sizes = dict(plan.mesh.shape)
    stored = bytes_per_device(params[key], shardings[key])
    layers = _bytes(params[key], shardings[key], sizes, gathered=Axis.FSDP)
    others = _bytes([params[k] for k in rest], [shardings[k] for k in rest], sizes, Axis.FSDP)
    message = first_stage_message(run, cpu)[1]
    slots = (table.act_slots + table.grad_slots + 2 + 2 - in_flight) * message
    held = slots + layers / table.v + layers + others
    gathered = sizes.get(Axis.FSDP, 1) > 1
    if gathered:
        held += layers + others
    if table.v > 1:  # under fsdp the gathered weights are the copy in chunk order
        held += (0 if gathered else stored) + layers / table.v
    return held


def _bytes(tree: Any, shardings: Any, sizes: dict[str, int], gathered: str) -> float:
    """Bytes of a device's share of ``tree`` placed by ``shardings``, but whole over the
    mesh axis ``gathered`` (:func:`~jaxpar.sharding.bytes_per_device` with it gathered)."""
    total = 0.0
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        ways = 1
        for entry in sharding.spec:
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                ways *= 1 if axis == gathered else sizes[axis]
        total += math.prod(leaf.shape) * itemsize(leaf.dtype) / ways
    return total
