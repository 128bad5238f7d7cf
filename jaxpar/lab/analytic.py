"""A layout's step estimated without compiling: for device counts no machine here can
simulate (``jaxpar plan --devices 1024``).

The run is planned on an abstract mesh (:func:`jaxpar.run.build` with ``target``), so its
shardings, state bytes and the lab's collectives (:func:`jaxpar.lab.predict.predict_comm`)
are the ones a compiled program has (``tests/test_abstract_plan.py``). What compiling
adds is estimated from the model's shape:

* **FLOPs per device**: the family's count of one example's training FLOPs
  (:class:`jaxpar.models.family.Counts`) × the examples a device computes (the global
  batch over the axes that split the batch and the sequence, and over ``tensor``), over
  ``stage`` in a pipeline, plus what the device computes beyond that share (weights held
  whole: :meth:`~jaxpar.lab.terms.LabModel.unsplit_flops`), times
  - the schedule's cost: a tick costs its busiest device's action (forward 1, fused
    backward 2, its input half 1, its weight half 2; the recomputed forward and the head
    on top), bubbles free, as the compiled step is read; the sub-mesh executor's critical
    path (:func:`pipeline_factor`);
  - recomputation: ``model.remat=full`` runs the stacked layers' forward again, but for
    what the backward does not read (:meth:`~jaxpar.lab.terms.LabModel.recomputed_share`
    of a third of their share of the FLOPs: :func:`layer_share`).
* **Memory**: the step's arguments (state shards and batch shards, from the shardings:
  exact), its outputs (the donated state), and the activations the family's lab module
  estimates (:meth:`jaxpar.lab.terms.LabModel.activation_bytes`; none for a model
  without one, and the row says so).
* **Collectives**: the lab's terms; each distinct collective of a step counted once per
  execution (a stacked layer's once per layer) for the latency term. A CPU profile (one
  fitted here) prices XLA:CPU's bytes with nothing hidden, as the compiled path does.

A family without FLOP counts gets no compute term. The estimate is checked against the
compiled program at 8 simulated devices (``tests/test_analytic.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpar.axes import Axis
from jaxpar.config import Config, apply_overrides
from jaxpar.data import Data, load_data
from jaxpar.errors import JaxparError
from jaxpar.lab.families import lab_for
from jaxpar.lab.hardware import Hardware, roofline
from jaxpar.lab.kernels import kernels
from jaxpar.lab.measure import Row, fill_predicted, layout_overrides
from jaxpar.lab.network import step_time
from jaxpar.lab.predict import lab_layout, predict_argument_bytes, predict_comm
from jaxpar.logical import LAYERS
from jaxpar.pipeline.schedule import KINDS, action_times, simulate
from jaxpar.plan.abstract import global_batch_shapes
from jaxpar.run import Run, build, data_needs
from jaxpar.task import Task


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
    path (:func:`~jaxpar.pipeline.schedule.simulate` with those costs, the head spread
    over the chunks)."""
    times = action_times(recompute)
    if asynchronous:
        span = simulate(table.orders, table.v, times).makespan
        return span / (3.0 * table.m * table.v)
    last = table.chunk * table.p + np.arange(table.p)[None, :] == table.p * table.v - 1
    cost = np.vectorize(lambda k, end: _tick_cost(KINDS[k], end, times, recompute, head))
    span = cost(table.kind, last).max(axis=1).sum()
    return float(span) / (3.0 * table.m * (table.v + head / table.p))


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


def flops_per_device(run: Run, asynchronous: bool = False) -> float | None:
    """The step's FLOPs on one device (None: the family does not count them);
    ``asynchronous``: its pipeline's stages run as the sub-mesh executor runs them
    (:func:`pipeline_factor`)."""
    family = run.family
    if family is None or family.counts is None:
        return None
    plan = run.plan
    sizes = plan.mesh.shape
    per_example = family.counts(run.config.model, run.data).train_flops_per_example
    split = plan.batch_ways() * sizes[Axis.CONTEXT] * sizes[Axis.TENSOR] * sizes[Axis.STAGE]
    flops = per_example * run.config.train.batch_size / split
    lab, layout = lab_for(family), lab_layout(run, cpu=False)
    # and what a device computes beyond its share (weights held whole)
    flops += lab.unsplit_flops(run.config.model, layout)
    again = lab.recomputed_share(run.config.model, layout)
    if plan.pipeline is not None:
        residuals = plan.executor == "mpmd" and plan.gradients.residuals
        asynchronous = asynchronous or plan.executor == "mpmd"
        table = plan.pipeline
        share = layer_share(run)
        head = table.p * table.v * (1 - share) / share if share else 0.0
        flops *= pipeline_factor(table, 0.0 if residuals else again, asynchronous, head)
    if getattr(run.config.model, "remat", "none") == "full":
        flops *= 1 + layer_share(run) * again / 3
    return flops


def collective_calls(terms: Any, layers: int) -> int:
    """The collectives a step executes, estimated: each distinct collective (kind, what,
    group) once per execution, as XLA combines a layer's arrays into one instruction; a
    stacked layer's gather or reduction (overlapped: :attr:`Term.hidden`) once per layer
    of the scan. A collective matmul's sends hide their latency too and are left out."""
    seen: dict[tuple[str, str, int, bool], int] = {}
    for t in terms:
        if t.hidden and t.kind == "collective-permute":
            continue
        key = (t.kind, t.what, t.group, t.hidden)
        seen[key] = max(seen.get(key, 0), t.times * (layers if t.hidden else 1))
    return sum(seen.values())


def scan_length(run: Run) -> int:
    """The layers a device's layer scan runs (1 for a model without stacked layers)."""
    plan = run.plan
    leaves = jax.tree.leaves(plan.model.params)
    names = jax.tree.leaves(plan.model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    for leaf, axes in zip(leaves, names):
        if LAYERS in axes:
            return leaf.shape[axes.index(LAYERS)] // plan.mesh.shape[Axis.STAGE]
    return 1


class _FirstBatch:
    """A config's data with its batches drawn once (a plan reads only their shapes)."""

    def __init__(self, data: Data):
        self._data = data
        self._batches: dict[tuple[int, int], dict] = {}

    def batch(self, step: int, size: int) -> dict:
        if (step, size) not in self._batches:
            self._batches[step, size] = self._data.batch(step, size)
        return self._batches[step, size]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)


#: the data of the config last estimated, by its data section and what its model reads
_READ: dict[str, _FirstBatch] = {}


def _read_once(config: Config) -> Data:
    """The config's data, read once for every layout of a plan (the last config's kept)."""
    needs = data_needs(config)
    key = repr((config.data, needs, config.run.seed))
    if key not in _READ:
        _READ.clear()
        _READ[key] = _FirstBatch(load_data(config.data, needs, config.run.seed))
    return _READ[key]


def estimate(
    config: Config,
    layout: str,
    hw: Hardware,
    devices: int,
    memory_bytes: float | None = None,
    task: Task | None = None,
    cpu: bool = False,
) -> Row:
    """The row of ``layout`` on ``devices`` devices of ``hw``'s platform, nothing compiled
    (its ``error`` says why a layout cannot run); ``cpu``: the activations as XLA:CPU
    holds them (bfloat16 as float32: what the tests compare with)."""
    row = Row(layout, hardware=hw.key)
    try:
        config = apply_overrides(config, layout_overrides(layout))
        # the sub-mesh executor cuts devices that are here: its stages are planned as the
        # one-program executor holds them, and timed as it runs them
        sub_mesh = config.mesh.stage > 1 and config.pipeline.executor == "mpmd"
        if sub_mesh:
            config = apply_overrides(config, ["pipeline.executor=spmd"])
        data = None if task is not None else _read_once(config)
        run = build(config, task, target=(devices, hw.platform), data=data)
    except JaxparError as err:
        row.error = str(err)
        return row
    batch = global_batch_shapes(run.data.batch(0, run.config.train.batch_size))
    state = run.plan.state_bytes()
    row.mem_host_bytes = state.host
    row.mem_args_bytes = row.predicted_mem_args_bytes = predict_argument_bytes(run, batch)
    row.mem_output_bytes = state.total
    lab = lab_for(run.family)
    activations = lab.activation_bytes(run.config.model, lab_layout(run, cpu=cpu))
    # and the gradients: one per parameter shard (and the accumulator's beside it)
    grads = state.params * (2 if run.plan.grad_accum > 1 else 1)
    temps = None if activations is None else round(activations + grads)
    row.mem_temp_bytes = temps
    row.mem_total_bytes = row.mem_args_bytes + (temps or 0)
    row.fits = row.mem_total_bytes <= (memory_bytes or hw.memory_bytes)
    row.flops = flops_per_device(run, asynchronous=sub_mesh)
    row.mem_traffic_bytes = row.mem_args_bytes + row.mem_output_bytes + 2 * (temps or 0)
    comm = predict_comm(run, "gpu")
    row.collective_ops = collective_calls(comm.terms, scan_length(run))
    # the arrays they move are not estimated: a profile that pays α per array (a fitted
    # CPU's) is priced, and shown, per collective
    row.collective_arrays = row.collective_ops
    dtype = run.family.compute_dtype(run.config.model) if run.family else "float32"
    if hw.platform == "cpu":  # a profile of a CPU (fitted here): its bytes, nothing hidden
        comm = predict_comm(run, "cpu")
        time_s = roofline(
            hw,
            row.flops or 0.0,
            row.mem_traffic_bytes,
            comm.total_bytes,
            dtype,
            row.collective_ops,
        )
    else:
        time_s = step_time(
            hw,
            row.flops or 0.0,
            row.mem_traffic_bytes,
            comm.terms,
            dict(run.plan.mesh.shape),
            dtype,
            calls=row.collective_ops,
            kernels=kernels(run, hw, dtype),
        )
    row.predicted_comm_bytes = comm.total_bytes
    fill_predicted(row, time_s, run, hw.peak_flops(dtype))
    return row
