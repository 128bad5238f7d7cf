"""What a pipeline's schedule costs one device, beside the work it does: the step's FLOPs
(:mod:`jaxpar.lab.analytic`) and its other kernels' time (:mod:`jaxpar.lab.kernels`) are
stretched by it.

One program for every stage runs the executor's tick table in step: each tick costs its
busiest device's action, and the last chunk's forward runs inside its backward, with the
head's FLOPs. The sub-mesh executor's stages run their own programs, each action as soon
as its input arrives: the step lasts the schedule's critical path. A backward first
recomputes its chunk's forward, all of it but the last matmul of the chunk's last layer
(the backward does not read its output): :meth:`~jaxpar.lab.terms.LabModel.
recomputed_share` of one layer, spread over the chunk's layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpar.axes import Axis
from jaxpar.errors import JaxparError
from jaxpar.lab.families import lab_for
from jaxpar.lab.predict import lab_layout
from jaxpar.logical import LAYERS
from jaxpar.pipeline.schedule import KINDS, action_times, simulate
from jaxpar.run import Run


def pipeline_stretch(run: Run, asynchronous: bool = False) -> float:
    """The step's work per device over what a device's own share would cost (1 without a
    pipeline); ``asynchronous``: the stages run as the sub-mesh executor runs them (as
    they do where the plan says ``mpmd``)."""
    plan = run.plan
    table = plan.pipeline
    if table is None:
        return 1.0
    residuals = plan.executor == "mpmd" and plan.gradients.residuals
    lab = lab_for(run.family)
    layer = lab.recomputed_share(run.config.model, lab_layout(run, cpu=False))
    chunk = max(1, scan_length(run) // table.v)
    again = 0.0 if residuals else 1 - (1 - layer) / chunk
    share = layer_share(run)
    head = table.p * table.v * (1 - share) / share if share else 0.0
    return pipeline_factor(table, again, asynchronous or plan.executor == "mpmd", head)


def pipeline_factor(
    table: Any, recompute: float, asynchronous: bool = False, head: float = 0.0
) -> float:
    """A pipeline step's FLOPs per device over the work it does (forward 1, backward 2 per
    microbatch and chunk, and 3·``head`` for the head's: its forward in units of a chunk's
    forward), with a backward action first running ``recompute`` of its chunk's forward
    again (the executors keep only each chunk's input, unless the sub-mesh one keeps its
    residuals; :func:`~jaxpar.pipeline.schedule.action_times`).

    One program for every stage (``asynchronous`` False) runs the table's ticks in step:
    each tick costs its busiest device's action (every device waits for the slowest at
    the next send; bubbles free), and the last chunk's forward runs inside its backward,
    with the head's (:func:`_tick_cost`). The sub-mesh executor's stages run their own
    programs, each as soon as its input arrives: the step lasts the schedule's critical
    path (:func:`~jaxpar.pipeline.schedule.simulate` with those costs, the last chunk's
    as the one-program executor's: its forward computes nothing, its backward runs the
    forward once with the head's — unless the sub-mesh executor keeps residuals
    (``recompute`` 0), whose last forward runs the head's forward and its backward the
    head's backward)."""
    times = action_times(recompute)
    if asynchronous:
        if recompute:
            extra = {k: (1 - recompute) * times["F"] + _HEAD[k] * head for k in _HEAD}
            extra["F"] = -times["F"]
        else:
            extra = {"F": head, "B": 2 * head, "I": head, "W": head}
        span = _critical_path(table, times, extra)
        return span / (3.0 * table.m * (table.v + head / table.p))
    last = table.chunk * table.p + np.arange(table.p)[None, :] == table.p * table.v - 1
    cost = np.vectorize(lambda k, end: _tick_cost(KINDS[k], end, times, recompute, head))
    span = cost(table.kind, last).max(axis=1).sum()
    return float(span) / (3.0 * table.m * (table.v + head / table.p))


#: :func:`_critical_path`'s answers, by table and costs (the table kept beside its answer,
#: so that its ``id`` is not another's)
_SPANS: dict[tuple, tuple[Any, float]] = {}


def _critical_path(table: Any, times: dict[str, float], extra: dict[str, float]) -> float:
    """The makespan of ``table``'s schedule with these costs, simulated once (an estimate
    asks for it for the FLOPs and again for the other kernels' bytes)."""
    key = (id(table), tuple(times.items()), tuple(extra.items()))
    hit = _SPANS.get(key)
    if hit is None or hit[0] is not table:
        if len(_SPANS) > 256:
            _SPANS.clear()
        hit = _SPANS[key] = (table, simulate(table.orders, table.v, times, extra).makespan)
    return hit[1]


#: the head's FLOPs a last-chunk action runs, in units of the head's forward
_HEAD = {"B": 3.0, "I": 2.0, "W": 3.0}


def _tick_cost(
    kind: str, last: bool, times: dict[str, float], recompute: float, head: float
) -> float:
    """One device's action in a tick of the one-program executor, in chunk forwards: its
    last chunk's forward is no action of its own (the backward runs it, so a recomputing
    one runs it once) and adds the head's (the branches ``jaxpar.pipeline.branches``
    compiles: on gpt_tiny over 4 stages, F 117 MFLOP, B 319, B_LAST 402)."""
    if kind == "idle":
        return 0.0
    if kind == "F":
        return 0.0 if last else times["F"]
    if not last:
        return times[kind]
    return times[kind] + (1 - recompute) * times["F"] + _HEAD[kind] * head


def layer_share(run: Run) -> float:
    """The share of a step's FLOPs in the stacked layers: from the family's counts with
    the layers doubled (a config with ``n_layers``); 1 where that cannot be read."""
    family, cfg = run.family, run.config.model
    if family is None or family.counts is None or not hasattr(cfg, "n_layers"):
        return 1.0
    one = family.counts(cfg, run.data).train_flops_per_example
    try:
        doubled = dataclasses.replace(cfg, n_layers=2 * cfg.n_layers)
        two = family.counts(doubled, run.data).train_flops_per_example
    except (JaxparError, ValueError, TypeError):  # a section that refuses twice the layers
        return 1.0
    return min(1.0, (two - one) / one) if one else 1.0


def scan_length(run: Run) -> int:
    """The layers a device's layer scan runs (1 for a model without stacked layers)."""
    plan = run.plan
    leaves = jax.tree.leaves(plan.model.params)
    names = jax.tree.leaves(plan.model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    for leaf, axes in zip(leaves, names):
        if LAYERS in axes:
            return leaf.shape[axes.index(LAYERS)] // plan.mesh.shape[Axis.STAGE]
    return 1
