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
    what the backward does not read, and a saving policy what it does not keep
    (:meth:`~jaxpar.lab.terms.LabModel.recomputed_share` of a third of their share of the
    FLOPs: :func:`layer_share`).
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

from typing import Any

from jaxpar.config import Config, apply_overrides
from jaxpar.data import Data, load_data
from jaxpar.errors import JaxparError, LayoutError
from jaxpar.lab.activations import remat_of
from jaxpar.lab.executor_memory import one_program_buffers
from jaxpar.lab.families import lab_for
from jaxpar.lab.hardware import Hardware, roofline
from jaxpar.lab.kernels import flops_per_device, kernels
from jaxpar.lab.measure import Row, fill_predicted, layout_overrides
from jaxpar.lab.network import hosts_of, step_time
from jaxpar.lab.pipeline_cost import scan_length
from jaxpar.lab.predict import lab_layout, predict_argument_bytes, predict_comm, stack_moves
from jaxpar.lab.residuals import gathered_bytes, residual_bytes
from jaxpar.lab.staged import check_chunk
from jaxpar.lab.terms import LabLayout
from jaxpar.plan.abstract import global_batch_shapes
from jaxpar.run import Run, build, data_needs
from jaxpar.sharding import bytes_per_device
from jaxpar.task import Task


def collective_calls(terms: Any, layers: int, devices: int) -> tuple[int, int]:
    """The collectives a step executes, estimated, and the devices they wait for (each
    one's group; a send, every one of the ``devices``: :attr:`~jaxpar.hlo.ProgramCost.
    collective_participants`): each distinct collective (kind, what, group) once per
    execution, as XLA combines a layer's arrays into one instruction; a stacked layer's
    gather or reduction (overlapped: :attr:`Term.hidden`) once per layer of the scan. A
    collective matmul's sends hide their latency too and are left out."""
    seen: dict[tuple[str, str, int, bool], int] = {}
    for t in terms:
        if t.hidden and t.kind == "collective-permute":
            continue
        key = (t.kind, t.what, t.group, t.hidden)
        seen[key] = max(seen.get(key, 0), t.times * (layers if t.hidden else 1))
    waits = sum(
        n * (devices if kind == "collective-permute" else g) for (kind, _, g, _), n in seen.items()
    )
    return sum(seen.values()), waits


def _scan_steps(run: Run) -> int:
    """The steps a device's layer scan runs: its layers, a group at a time where the family
    scans groups (:meth:`~jaxpar.lab.terms.LabModel.scan_group`)."""
    return scan_length(run) // lab_for(run.family).scan_group(run.config.model)


def _stacked_layer_bytes(run: Run) -> int:
    """Bytes of a device's share of the model's stacked layers' parameters (0 for a model
    not given as a stack)."""
    split = run.plan.task.stages
    if split is None:
        return 0
    key = split.layers_key
    params = run.plan.abstract_state.params
    return bytes_per_device(params[key], run.plan.state_shardings.params[key])


def _activations(run: Run, layout: LabLayout) -> tuple[float | None, float]:
    """A device's activations and the lowest ratio of estimated to compiled temporaries
    their count has shown (its margin): the family's lab module's count (:data:`TEMPS_LOW`),
    or for a model it has no count for the residuals JAX keeps and FSDP's gathered weights
    (:mod:`jaxpar.lab.residuals`, :data:`RESIDUALS_LOW`); None where neither says."""
    counted = lab_for(run.family).activation_bytes(run.config.model, layout)
    if counted is not None:
        return counted, TEMPS_LOW
    kept = residual_bytes(run)
    return (None if kept is None else kept + gathered_bytes(run)), RESIDUALS_LOW


def _temporaries(run: Run, cpu: bool, sub_mesh: bool, params: int) -> tuple[int | None, float]:
    """A device's temporaries (None: its activations are not estimated) and their margin
    (:func:`_activations`): the activations and the gradients, one per parameter shard
    (``params`` bytes; and the accumulator's beside it); the one-program pipeline's sums,
    messages and weights as its executor holds them; the sub-mesh executor's interleaved
    stack's rows where they run."""
    lab = lab_for(run.family)
    layout = lab_layout(run, cpu=cpu)
    activations, low = _activations(run, layout)
    if activations is None:
        return None, low
    accumulated = params if run.plan.grad_accum > 1 else 0
    held = None if sub_mesh else one_program_buffers(run, cpu, layout.in_flight)
    grads = (params if held is None else held) + accumulated
    if lab.remat_layer_copies and remat_of(run.config.model) == "full":
        grads += lab.remat_layer_copies * _stacked_layer_bytes(run)
    if sub_mesh:
        grads += stack_moves(run)[1]
    return round(activations + grads), low


class _FirstBatch:
    """A config's data with its batches drawn once (a plan reads only their shapes)."""

    def __init__(self, data: Data):
        self._data = data
        self._batches: dict[tuple[int, int], dict] = {}
        self._shares: dict[tuple[int, int], _FirstBatch] = {}

    def batch(self, step: int, size: int) -> dict:
        if (step, size) not in self._batches:
            self._batches[step, size] = self._data.batch(step, size)
        return self._batches[step, size]

    def with_share(self, share: tuple[int, int]) -> Any:
        """Itself where the share is its data's (a plan's: one process), else the data
        loading that share, drawn once too (kept for the plan's other layouts)."""
        inner = self._data.with_share(share)
        if inner is self._data:
            return self
        return self._shares.setdefault(tuple(share), _FirstBatch(inner))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not yet set (a copy being made): not the data's
            raise AttributeError(name)
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


def _as_one_program(config: Config) -> list[str]:
    """The overrides that plan a sub-mesh executor's layout as the one-program executor
    holds its stages (its sub-meshes cut devices that are here).

    Raises:
      LayoutError: for what the one-program executor's stages would misstate: residuals
        kept for the backward, or uneven chunks.
    """
    pipeline = config.pipeline
    unlike = [
        f"pipeline.{k}={v}"
        for k, v in (("backward", pipeline.backward), ("split", pipeline.split))
        if v and v != "recompute"
    ]
    if unlike:
        raise LayoutError(
            f"an estimate of the sub-mesh executor plans its stages as the one-program "
            f"executor holds them, which cannot say what {', '.join(unlike)} change; plan "
            "up to 64 devices (compiled), or leave them out"
        )
    return ["pipeline.executor=spmd"]


def estimate(
    config: Config,
    layout: str,
    hw: Hardware,
    devices: int,
    memory_bytes: float | None = None,
    task: Task | None = None,
    cpu: bool = False,
    processes: bool = True,
) -> Row:
    """The row of ``layout`` on ``devices`` devices of ``hw``'s platform, nothing compiled
    (its ``error`` says why a layout cannot run); ``cpu``: the step as XLA:CPU compiles it
    (activations in bfloat16 held as float32, a mixture of experts' grouped matmuls computed
    densely: what the tests compare with); ``processes``: refuse
    what a run of one process a host refuses (a process whose devices do not hold one
    share of the batch rows, sub-mesh stages across hosts:
    :func:`~jaxpar.lab.network.hosts_of`; False prices another framework's run)."""
    row = Row(layout, hardware=hw.key)
    try:
        config = apply_overrides(config, layout_overrides(layout))
        # the sub-mesh executor cuts devices that are here: its stages are planned as the
        # one-program executor holds them, and timed as it runs them
        sub_mesh = config.mesh.stage > 1 and config.pipeline.executor == "mpmd"
        if sub_mesh:
            config = apply_overrides(config, [*_as_one_program(config)])
        data = None if task is not None else _read_once(config)
        run = build(config, task, target=(devices, hw.platform), data=data)
        check_chunk(run)
        hosts = hosts_of(run, hw, processes, sub_mesh)
    except JaxparError as err:
        row.error = str(err)
        return row
    batch = global_batch_shapes(
        run.data.batch(0, run.config.train.batch_size), run.plan.row_share[1]
    )
    state = run.plan.state_bytes()
    row.mem_host_bytes = state.host
    row.mem_args_bytes = row.predicted_mem_args_bytes = predict_argument_bytes(run, batch)
    row.mem_output_bytes = state.total
    temps, low = _temporaries(run, cpu, sub_mesh, state.params)
    row.mem_temp_bytes = temps
    row.mem_total_bytes = row.mem_args_bytes + (temps or 0)
    _judge_memory(row, memory_bytes or hw.memory_bytes, low)
    row.flops = flops_per_device(run, asynchronous=sub_mesh, gpu=hw.platform == "gpu" and not cpu)
    row.mem_traffic_bytes = row.state_traffic_bytes + 2 * (temps or 0)
    # a profile of a CPU (fitted here): its bytes and collectives, nothing hidden
    comm = predict_comm(run, "cpu" if hw.platform == "cpu" else "gpu", asynchronous=sub_mesh)
    row.collective_ops, row.collective_participants = collective_calls(
        comm.terms, _scan_steps(run), run.plan.mesh.size
    )
    # the arrays they move are not estimated: a profile that pays α per array is priced,
    # and shown, per collective
    row.collective_arrays = row.collective_ops
    dtype = run.family.compute_dtype(run.config.model) if run.family else "float32"
    if hw.as_fitted:
        time_s = roofline(
            hw,
            row.flops or 0.0,
            row.mem_traffic_bytes,
            comm.total_bytes,
            dtype,
            row.calls(hw.latency_per),
            state_bytes=row.state_traffic_bytes,
        )
    else:
        time_s = step_time(
            hw,
            row.flops or 0.0,
            row.mem_traffic_bytes,
            comm.terms,
            dict(run.plan.mesh.shape),
            dtype,
            calls=row.calls(hw.latency_per),
            kernels=kernels(run, hw, dtype, asynchronous=sub_mesh),
            state_bytes=row.state_traffic_bytes,
            hosts=hosts,
        )
    row.predicted_comm_bytes = comm.total_bytes
    fill_predicted(row, time_s, run, hw.peak_flops(dtype))
    return row


#: the lowest ratio of estimated to compiled temporaries on the test grid
#: (``tests/test_analytic.py``: 8 and 32 simulated devices, every axis; JAX 0.10 and 0.12):
#: 0.80 where a pipeline chunk is a loop of layers, beside whose stacked activations XLA
#: holds the layer it runs, and whose heap it packs 3–8% above the live bytes
TEMPS_LOW = 0.79
#: the same for a model counted by the residuals JAX keeps (:mod:`jaxpar.lab.residuals`:
#: a ResNet, a user's task): 0.71 for a ResNet-10 at 8 examples a device, whose activations
#: are a fraction of its weights (0.91-1.06 for larger ones, a user's CNN 0.84-0.93)
RESIDUALS_LOW = 0.71


def _judge_memory(row: Row, memory_bytes: float, low: float = TEMPS_LOW) -> None:
    """Whether ``row`` fits ``memory_bytes``, and would were its temporaries 1/``low`` of
    the estimate (not known to: a row without an activation estimate, whose state alone
    fits, says yes?)."""
    row.fits = row.mem_total_bytes <= memory_bytes
    if row.mem_temp_bytes is None:  # no activation estimate (a pipelined user's task)
        row.fits_margin = False
        return
    margin = row.mem_temp_bytes * (1 / low - 1)
    row.fits_margin = row.mem_total_bytes + margin <= memory_bytes


def may_not_fit(row: Row) -> bool:
    """An estimated row (nothing compiled) that fits, but would not were its temporaries
    1/:data:`TEMPS_LOW` of the estimate."""
    return bool(row.ok and row.fits and row.fits_margin is False)
