"""One layout's train step, compiled and read: memory per device, FLOPs, collectives and the
roofline step time on a hardware profile (optionally the measured step time as well).

:func:`measure` is :func:`lower` (build the run, trace and lower the step: Python, holding
the GIL), :func:`compile_lowered` (XLA, which releases it) and :func:`read` (the
compiled program's figures) in a row; :mod:`jaxpar.lab.workers` runs the middle part of
many layouts at once.

A program that is only read, never run (``steps=0``), compiles with XLA's code generator
at its fastest settings (:func:`analysis_options`): LLVM optimization off, its code in one
piece (several layouts compile at once already) and, on jaxlibs that still have it, the
older elemental fusion emitter. None of them touches the HLO passes, so the program's
collectives and FLOPs are the same; its temporaries differ by a few hundred bytes in tens
of MiB (``python benchmarks/plan_time.py --check`` compares them).
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpar import hlo
from jaxpar.axes import MESH_AXES
from jaxpar.config import Config, apply_overrides
from jaxpar.errors import ConfigError, JaxparError, LayoutError
from jaxpar.lab.hardware import Hardware, StepTime, roofline
from jaxpar.lab.kernels import gpu_flops_factor, kernels, model_flops_per_device
from jaxpar.lab.network import hosts_of, step_time
from jaxpar.lab.predict import CommPrediction, predict_argument_bytes, predict_comm
from jaxpar.lab.terms import Term
from jaxpar.pipeline.branches import branch_table
from jaxpar.plan import global_batch_shapes
from jaxpar.run import Run, build
from jaxpar.task import Task


@dataclass
class Row:
    """One layout's measurements (None where it could not be measured)."""

    layout: str
    mem_args_bytes: int | None = None
    mem_temp_bytes: int | None = None
    mem_total_bytes: int | None = None
    flops: float | None = None
    all_reduce_bytes: float | None = None
    all_gather_bytes: float | None = None
    reduce_scatter_bytes: float | None = None
    collective_permute_bytes: float | None = None
    all_to_all_bytes: float | None = None
    predicted_comm_bytes: float | None = None
    step_time_s: float | None = None
    predicted_step_time_s: float | None = None
    fits: bool | None = None
    #: an estimate's verdict were its temporaries 1/``TEMPS_LOW`` of it (its margin,
    #: :data:`jaxpar.lab.analytic.TEMPS_LOW`); None for a compiled row
    fits_margin: bool | None = None
    comm_bytes: float | None = None
    comm_ratio: float | None = None
    predicted_mem_args_bytes: int | None = None
    mem_output_bytes: int | None = None
    mem_traffic_bytes: float | None = None
    tokens_per_s: float | None = None
    examples_per_s: float | None = None
    compile_s: float | None = None
    transfer_bytes: float | None = None
    collective_ops: int | None = None
    collective_arrays: int | None = None
    #: the devices those collectives wait for (each one's group size, a send's 2)
    collective_participants: int | None = None
    predicted_latency_s: float | None = None
    #: the roofline's other terms (:class:`~jaxpar.lab.hardware.StepTime`) and its largest
    predicted_compute_s: float | None = None
    predicted_memory_s: float | None = None
    predicted_comm_s: float | None = None
    #: communication that runs while the step computes (counted only where it outlasts it)
    predicted_hidden_s: float | None = None
    #: the kernels other than matmuls (:mod:`jaxpar.lab.kernels`), after the matmuls
    predicted_elementwise_s: float | None = None
    predicted_bound: str = ""
    #: tokens (examples for a model without a sequence) per second per device, predicted
    predicted_tokens_per_s_per_device: float | None = None
    #: the step's matmul FLOPs per device over the predicted time × the profile's peak
    #: (recomputation counts: under remat this is hardware-FLOPs utilisation)
    predicted_mfu: float | None = None
    #: bytes per device held in host memory (an offloaded optimizer state), outside mem_*
    mem_host_bytes: int | None = None
    hardware: str = ""
    #: the JAX platform the step was timed on (``gpu``, ``cpu``…; empty where nothing was
    #: timed): the machine a profile fitted to the sweep describes (``plan --fit``)
    timed_on: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def state_traffic_bytes(self) -> float:
        """The state's part of ``mem_traffic_bytes``: its arguments read and outputs
        written once a step."""
        return (self.mem_args_bytes or 0) + (self.mem_output_bytes or 0)

    def calls(self, per: str) -> int:
        """What pays a collective's latency (:attr:`~jaxpar.lab.hardware.Hardware.
        latency_per`): its collectives, their arrays or their participants."""
        value = {
            "collective": self.collective_ops,
            "array": self.collective_arrays,
            "participant": self.collective_participants,
        }[per]
        return value or 0


def layout_overrides(layout: str) -> list[str]:
    """``"fsdp=4,stage=2"`` → config overrides: every mesh axis set (unnamed ones to 1),
    ``rules.preset=auto`` unless named, then the layout's own dotted overrides.

    Raises:
      ConfigError: for an entry that is neither ``axis=N`` nor ``section.key=value``.
    """
    degrees = dict.fromkeys(MESH_AXES, "1")
    extra = []
    preset = "auto"
    for item in (x.strip() for x in layout.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"layout '{layout}': '{item}' must look like axis=N, e.g. fsdp=8")
        if "." in key:
            extra.append(item)
            preset = value if key == "rules.preset" else preset
        elif key in degrees:
            degrees[key] = value
        else:
            raise ConfigError(
                f"layout '{layout}': unknown mesh axis '{key}'; the axes are "
                f"{', '.join(MESH_AXES)} (or give a section.key=value override)"
            )
    return [*(f"mesh.{a}={v}" for a, v in degrees.items()), f"rules.preset={preset}", *extra]


@functools.cache
def analysis_options() -> tuple[tuple[str, Any], ...]:
    """XLA options for a program that is read, not run: those this jaxlib knows."""
    wanted = {
        "xla_backend_optimization_level": 0,
        "xla_cpu_use_fusion_emitters": False,
        # several layouts compile at once: one program's code in one piece
        "xla_cpu_parallel_codegen_split_count": 1,
    }
    lowered = jax.jit(lambda x: x + 1).lower(np.ones(2, np.float32))
    known = {}
    for key, value in wanted.items():
        try:
            lowered.compile({**known, key: value})
        except jax.errors.JaxRuntimeError:  # "No such compile option" (a newer jaxlib)
            continue
        known[key] = value
    return tuple(known.items())


@dataclass
class Lowered:
    """A layout's run and its train step lowered for one batch shape, waiting to compile."""

    row: Row
    run: Run
    batch: dict
    step: Any


def lower(
    config: Config, layout: str, hw: Hardware, task: Task | None = None, timed: bool = False
) -> Lowered | Row:
    """The layout's run and lowered step, or its row with the reason it cannot run;
    ``timed``: its steps will run here, so its state must fit this machine's memory (else
    ``auto`` settings mean what they would on ``hw``'s platform)."""
    row = Row(layout, hardware=hw.key)
    try:
        config = apply_overrides(config, layout_overrides(layout))
        platform = None if timed else hw.platform
        with warnings.catch_warnings():  # one process here: the program is the same, and
            # the prediction places it as mesh.hosts_* say
            warnings.filterwarnings("ignore", "mesh.hosts_. have no effect")
            run = build(config, task, fit_memory=timed, platform=platform)
        # its host degrees divide their axes; a plan's hosts hold shares of the rows, as a run's
        hosts_of(run, hw, processes=not timed)
        batch = global_batch_shapes(
            run.data.batch(0, run.config.train.batch_size), run.plan.row_share[1]
        )
        return Lowered(row, run, batch, run.trainer.lower_step(batch))
    except JaxparError as err:  # a layout that cannot run; anything else is a bug: raised
        row.error = str(err)
        return row


def compile_lowered(lowered: Lowered, steps: int = 0) -> tuple[Any, float]:
    """The compiled step (for reading only with ``steps=0``: :func:`analysis_options`)
    and the seconds compiling took."""
    start = time.perf_counter()
    try:
        if steps == 0 and isinstance(lowered.step, jax.stages.Lowered):
            compiled = lowered.step.compile(dict(analysis_options()))
        else:  # a sub-mesh pipeline's programs compile themselves
            compiled = lowered.step.compile()
    except jax.errors.JaxRuntimeError as err:  # XLA:CPU refused the program: the layout's row
        if jax.default_backend() != "cpu":
            raise
        devices = lowered.run.plan.mesh.size
        raise LayoutError(
            f"XLA:CPU could not compile this layout's step for {devices} simulated devices "
            f"({str(err).splitlines()[0][:200]}); estimate it from the model's shape "
            f"instead: jaxpar plan … --devices {devices} --analytic"
        ) from None
    return compiled, time.perf_counter() - start


def measure(
    config: Config,
    layout: str,
    hw: Hardware,
    steps: int = 0,
    memory_bytes: float | None = None,
    task: Task | None = None,
) -> Row:
    """Compile (and with ``steps`` > 0, time) the train step of ``config`` under ``layout``.

    ``memory_bytes`` is the device memory that ``fits`` is judged against (default:
    the hardware profile's); ``task`` is a user's task (default: the built-in model).
    """
    lowered = lower(config, layout, hw, task, timed=steps > 0)
    if isinstance(lowered, Row):
        return lowered
    try:
        compiled, seconds = compile_lowered(lowered, steps)
    except JaxparError as err:
        lowered.row.error = str(err)
        return lowered.row
    return read(lowered, compiled, seconds, hw, memory_bytes, steps)


def _memory(compiled: jax.stages.Compiled, host: int = 0) -> tuple[int, int, int, int]:
    """(arguments, temporaries, outputs, peak) bytes per device in device memory; donated
    outputs alias their arguments, so the peak counts them once. ``host``: the bytes of
    donated state the step takes and returns in host memory (an offloaded optimizer
    state), which XLA:CPU counts with the rest (one RAM), where a GPU's analysis reports
    them apart (``host_argument_size_in_bytes``)."""
    mem = compiled.memory_analysis()
    args, temp = int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes)
    out, alias = int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes)
    if host and not int(getattr(mem, "host_argument_size_in_bytes", 0) or 0):
        args, out, alias = args - host, out - host, alias - host
    return args, temp, out, args + out - alias + temp


def read(
    lowered: Lowered,
    compiled: Any,
    compile_s: float,
    hw: Hardware,
    memory_bytes: float | None = None,
    steps: int = 0,
) -> Row:
    """The row of a compiled layout: its memory, FLOPs, collectives and predicted step
    time on ``hw`` (and with ``steps`` > 0 its measured step time)."""
    row = lowered.row
    run = lowered.run
    row.compile_s = compile_s
    row.mem_host_bytes = run.plan.state_bytes().host
    row.mem_args_bytes, row.mem_temp_bytes, row.mem_output_bytes, row.mem_total_bytes = _memory(
        compiled, row.mem_host_bytes
    )
    row.predicted_mem_args_bytes = predict_argument_bytes(run, lowered.batch)
    row.fits = row.mem_total_bytes <= (memory_bytes or hw.memory_bytes)
    cost = hlo.step_cost(compiled)
    # the sub-mesh pipeline moves activations between stages with device_put
    row.transfer_bytes = getattr(compiled, "transfer_bytes", None)
    row.flops = _scheduled_flops(compiled, cost, run)
    # HBM traffic, roughly: the state is read and written once, activations written and
    # read back once (an unfused CPU program's op-by-op traffic would say far more)
    row.mem_traffic_bytes = row.state_traffic_bytes + 2 * row.mem_temp_bytes
    comm, gpu = _fill_comm(row, cost, run)
    row.collective_ops = cost.collective_ops
    row.collective_arrays = cost.collective_arrays
    row.collective_participants = cost.collective_participants
    calls = row.calls(hw.latency_per)
    dtype = run.family.compute_dtype(run.config.model) if run.family else "float32"
    # priced as the GPU's program: XLA:CPU writes attention out where a GPU runs cuDNN's
    # fused kernel, which computes more, and computes a mixture of experts' grouped
    # matmuls densely, which computes far more (the row keeps the compiled program's count)
    gpu_form = hw.platform == "gpu" and run.devices[0].platform != "gpu"
    flops = row.flops * gpu_flops_factor(run) if gpu_form and row.flops else row.flops
    time_s = _step_time(row, hw, run, (comm, gpu), calls, dtype, flops)
    fill_predicted(row, time_s, run, hw.peak_flops(dtype), flops)
    if steps > 0:
        row.step_time_s = _time_steps(run, compiled, steps)
        row.timed_on = run.plan.mesh.devices.flat[0].platform
        examples = run.config.train.batch_size
        row.examples_per_s = examples / row.step_time_s
        per_example = run.plan.task.tokens_per_example
        row.tokens_per_s = examples * per_example / row.step_time_s if per_example else None
    return row


#: what the lab calls the measured bytes of a step whose collectives it predicts none of
UNPREDICTED = "collectives the prediction does not know"


def _step_time(
    row: Row,
    hw: Hardware,
    run: Run,
    comm: tuple[float, CommPrediction],
    calls: int,
    dtype: str,
    flops: float | None,
) -> StepTime:
    """The predicted step time of ``row`` doing ``flops``. A fitted profile (a CPU's) prices
    the compiled bytes and count, nothing hidden, all in one domain: what the fit models. A
    GPU profile places the GPU prediction's collectives on its NVLink domains and network
    (:func:`jaxpar.lab.network.step_time`), their bytes scaled to the measured ones
    corrected to GPU form (``comm``: those bytes and the prediction), the compiled count
    less the hidden ones paying the latency."""
    measured, gpu = comm
    if hw.as_fitted:
        return roofline(
            hw,
            flops,
            row.mem_traffic_bytes,
            # a GPU's fitted links carry the GPU's bytes (an estimate's too), not XLA:CPU's
            row.comm_bytes if hw.platform == "cpu" else measured,
            dtype,
            calls,
            state_bytes=row.state_traffic_bytes,
        )
    if gpu.total_bytes:
        terms, scale = gpu.terms, measured / gpu.total_bytes
    else:  # e.g. a task without a family: the bytes as they are (a send's wire bytes are
        # its payload), inside a domain
        terms, scale = (Term("collective-permute", UNPREDICTED, measured, 1),), 1.0
    sizes = dict(run.plan.mesh.shape)
    return step_time(
        hw,
        flops,
        row.mem_traffic_bytes,
        terms,
        sizes,
        dtype,
        calls=max(0, calls - gpu.hidden_ops * _waits_per_send(hw, run)),
        scale=scale,
        kernels=kernels(run, hw, dtype),
        state_bytes=row.state_traffic_bytes,
        hosts=hosts_of(run, hw, processes=False),
    )


def _waits_per_send(hw: Hardware, run: Run) -> int:
    """What one send pays latency for under ``hw``: one collective or array, or every
    device of the program waiting (:attr:`~jaxpar.hlo.ProgramCost.collective_participants`)."""
    return run.plan.mesh.size if hw.latency_per == "participant" else 1


def fill_predicted(
    row: Row, time_s: StepTime, run: Run, peak_flops: float, flops: float | None = None
) -> None:
    """``row``'s predicted step time, its terms, throughput and model FLOPs utilisation:
    the family's count of the step's FLOPs per device (:func:`~jaxpar.lab.kernels.
    model_flops_per_device`), or for a model without one the FLOPs priced (``flops``, by
    default ``row.flops``: recomputation and a pipeline's idle ticks included)."""
    flops = model_flops_per_device(run) or (row.flops if flops is None else flops)
    row.predicted_step_time_s = time_s.total_s
    row.predicted_latency_s = time_s.latency_s
    row.predicted_compute_s, row.predicted_memory_s = time_s.compute_s, time_s.memory_s
    row.predicted_comm_s, row.predicted_bound = time_s.comm_s, time_s.bound
    row.predicted_hidden_s = time_s.hidden_s
    row.predicted_elementwise_s = time_s.elementwise_s
    per_example = run.plan.task.tokens_per_example or 1
    devices = run.plan.mesh.size
    tokens = run.config.train.batch_size * per_example
    row.predicted_tokens_per_s_per_device = tokens / time_s.total_s / devices
    row.predicted_mfu = flops / time_s.total_s / peak_flops if flops else None


def _time_steps(run: Run, compiled: jax.stages.Compiled, steps: int) -> float:
    """Median seconds of ``steps`` executions of the compiled step, after two warm-ups."""
    trainer = run.trainer
    state = trainer.init()
    batch = trainer.shard_batch(run.data.batch(0, run.config.train.batch_size))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _scheduled_flops(compiled: Any, cost: hlo.ProgramCost, run: Run) -> float:
    """FLOPs per device in the step-time view.

    :func:`hlo.program_cost` prices every tick of a pipeline at its costliest
    branch. With the schedule known, a tick costs what its busiest device runs
    (every device waits for the slowest at the next send): the sum over ticks of
    the largest branch among the devices, bubbles free.
    """
    table = run.plan.pipeline
    if table is None:
        return cost.flops
    if hasattr(compiled, "scheduled_flops"):  # a step of one program per stage
        return compiled.scheduled_flops
    text = compiled.as_text()
    full = branch_table(table)
    used = np.unique(full)
    found = hlo.loop_branch_costs(text, len(used))
    if found is None or found[0] != table.ticks:
        return cost.flops
    trips, branches = found
    per = np.array([b.get("flops", 0.0) for b in branches])
    return cost.flops - trips * per.max() + float(per[np.searchsorted(used, full)].max(1).sum())


def _fill_comm(row: Row, cost: hlo.ProgramCost, run: Run) -> tuple[float, CommPrediction]:
    """Collective columns; returns the wire bytes the roofline uses (for a GPU), and the
    GPU's prediction (whose hidden terms the roofline counts as hidden)."""
    stats = cost.collectives
    for kind in hlo.COLLECTIVES:
        setattr(row, f"{kind.replace('-', '_')}_bytes", stats[kind].wire_bytes)
    row.comm_bytes = sum(s.wire_bytes for s in stats.values())
    backend = run.devices[0].platform
    here = predict_comm(run, backend)
    gpu = predict_comm(run, "gpu")
    row.predicted_comm_bytes = here.total_bytes
    row.comm_ratio = row.comm_bytes / here.total_bytes if here.total_bytes else None
    # A program compiled for the CPU differs from the GPU one where the prediction knows
    # it (all-reduce + slice for reduce-scatter, float32 for bfloat16 reductions): correct
    # the measured bytes by that difference. On a GPU the measured bytes stand as they are.
    return row.comm_bytes + gpu.total_bytes - here.total_bytes, gpu
