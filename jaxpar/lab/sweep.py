"""``jaxpar sweep``: the same model and global batch under many layouts, side by side.

For each layout the real train step is compiled (``Trainer.compile_step``) and
read: memory per device from ``memory_analysis()``, collective bytes by kind
and FLOPs from the optimized HLO (:mod:`jaxpar.hlo`), the
textbook's collective bytes (:mod:`jaxpar.lab.predict`), and a roofline step
time on a hardware profile (:mod:`jaxpar.lab.hardware`). With ``steps > 0`` the
compiled step also runs and its median time is measured.

A layout is a string such as ``"data=2,fsdp=2,tensor=2"``: mesh degrees (the
axes it leaves out are 1) plus, optionally, any ``section.key=value`` override
(``"fsdp=8,model.remat=full"``). Its rules are the ``auto`` preset (every
logical axis has a rule, so every mesh works) unless the layout names
``rules.preset``. A layout that cannot run (heads not divisible by ``tensor``,
layers not by ``stage``…) becomes a row with the reason, not a crash.
"""

from __future__ import annotations

import csv
import re
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar import hlo
from jaxpar.config import Config, apply_overrides
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.lab.chart import Panel, write_chart
from jaxpar.lab.hardware import Hardware, roofline
from jaxpar.lab.predict import predict_argument_bytes, predict_comm
from jaxpar.mesh import MESH_AXES
from jaxpar.pipeline.executor import branch_table
from jaxpar.plan import abstract_model, global_batch_shapes
from jaxpar.run import Run, build, task_for
from jaxpar.task import Task

#: The documented columns of ``sweep.csv``, in order; more follow them.
COLUMNS = ("layout", "mem_args_bytes", "mem_temp_bytes", "mem_total_bytes", "flops",
           "all_reduce_bytes", "all_gather_bytes", "reduce_scatter_bytes",
           "collective_permute_bytes", "all_to_all_bytes", "predicted_comm_bytes",
           "step_time_s", "predicted_step_time_s", "fits")


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
    comm_bytes: float | None = None
    comm_ratio: float | None = None
    predicted_mem_args_bytes: int | None = None
    mem_output_bytes: int | None = None
    mem_traffic_bytes: float | None = None
    tokens_per_s: float | None = None
    examples_per_s: float | None = None
    compile_s: float | None = None
    transfer_bytes: float | None = None
    hardware: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


# ---- layouts ---------------------------------------------------------------------------------
def layout_overrides(layout: str) -> list[str]:
    """``"fsdp=4,stage=2"`` → config overrides: every mesh axis set (unnamed ones to 1),
    ``rules.preset=auto`` unless named, then the layout's own dotted overrides.

    Raises:
      ConfigError: for an entry that is neither ``axis=N`` nor ``section.key=value``.
    """
    degrees = dict.fromkeys(MESH_AXES, "1")
    extra, preset = [], "auto"
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
            raise ConfigError(f"layout '{layout}': unknown mesh axis '{key}'; the axes are "
                              f"{', '.join(MESH_AXES)} (or give a section.key=value override)")
    return [*(f"mesh.{a}={v}" for a, v in degrees.items()), f"rules.preset={preset}", *extra]


def all_layouts(devices: int) -> list[str]:
    """Every assignment of mesh degrees whose product is ``devices`` (data-major order)."""
    def split(n: int, axes: tuple[str, ...]) -> list[list[tuple[str, int]]]:
        if len(axes) == 1:
            return [[(axes[0], n)]]
        return [[(axes[0], d), *rest] for d in range(n, 0, -1) if n % d == 0
                for rest in split(n // d, axes[1:])]

    return [",".join(f"{a}={d}" for a, d in combo if d > 1) or "data=1"
            for combo in split(devices, ("data", "fsdp", "context", "tensor", "stage"))]


def default_layouts(config: Config, devices: int, task: Task | None = None
                    ) -> tuple[list[str], str | None]:
    """:func:`all_layouts` of ``devices``, less those the model cannot run, and a note
    saying what was left out and why (None when nothing was): layouts with pipeline stages
    when the task declares neither ``Task.layers`` nor a ``StageSplit``, and layouts with
    context parallelism when its model's attention does not run across a split sequence
    (``Task.context_parallel``) or its sequence does not divide."""
    layouts = all_layouts(devices)
    task = task if task is not None else task_for(config)
    notes = []
    if task.layers is None and task.stages is None:
        notes.append(("stage", f"{task.name} cannot be split into pipeline stages (its task "
                               "declares neither Task.layers nor a StageSplit; README → "
                               "Pipeline parallelism)"))
    tokens = task.tokens_per_example
    if not task.context_parallel or not tokens:
        notes.append(("context", f"{task.name} does not run with its sequences split (Task."
                                 "context_parallel; README → Context parallelism)"))
    kept, lines = layouts, []
    for axis, why in notes:
        before = kept
        kept = [x for x in kept if f"{axis}=" not in x]
        if len(kept) < len(before):
            lines.append(f"note: {len(before) - len(kept)} layouts with mesh.{axis} > 1 left "
                         f"out: {why}")
    if task.context_parallel and tokens:
        before = kept
        kept = [x for x in kept if tokens % _degree(x, "context") == 0]
        if len(kept) < len(before):
            lines.append(f"note: {len(before) - len(kept)} layouts left out whose mesh.context "
                         f"does not divide the {tokens}-token sequences")
    return kept + _expert_variants(task, kept), "\n".join(lines) or None


def _expert_variants(task: Task, layouts: list[str]) -> list[str]:
    """For a model with experts (a parameter dim named ``experts``): each layout whose
    ``data`` degree (above 1) divides the experts again with them split over ``data``
    (expert parallelism, ``rules.experts=data``)."""
    model = abstract_model(task)
    sizes = {leaf.shape[names.index("experts")] for leaf, names in zip(
        jax.tree.leaves(model.params), jax.tree.leaves(
            model.param_axes, is_leaf=lambda x: isinstance(x, tuple))) if "experts" in names}
    if not sizes:
        return []
    return [f"{x},rules.experts=data" for x in layouts
            if _degree(x, "data") > 1 and all(n % _degree(x, "data") == 0 for n in sizes)]


def _degree(layout: str, axis: str) -> int:
    """The degree ``layout`` gives mesh ``axis`` (1 when it names none)."""
    found = re.search(rf"\b{axis}=(\d+)", layout)
    return int(found.group(1)) if found else 1


# ---- measuring one layout --------------------------------------------------------------------
def _memory(compiled: jax.stages.Compiled) -> tuple[int, int, int, int]:
    """(arguments, temporaries, outputs, peak) bytes per device; donated outputs alias
    their arguments, so the peak counts them once."""
    mem = compiled.memory_analysis()
    args, temp = int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes)
    out, alias = int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes)
    return args, temp, out, args + out - alias + temp


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


def _fill_comm(row: Row, cost: hlo.ProgramCost, run: Run) -> float:
    """Collective columns; returns the wire bytes the roofline uses (for a GPU)."""
    stats = cost.collectives
    for kind in hlo.COLLECTIVES:
        setattr(row, f"{kind.replace('-', '_')}_bytes", stats[kind].wire_bytes)
    row.comm_bytes = sum(s.wire_bytes for s in stats.values())
    backend = run.devices[0].platform
    here, gpu = predict_comm(run, backend), predict_comm(run, "gpu")
    row.predicted_comm_bytes = here.total_bytes
    row.comm_ratio = row.comm_bytes / here.total_bytes if here.total_bytes else None
    # A program compiled for the CPU differs from the GPU one where the prediction knows
    # it (all-reduce + slice for reduce-scatter, float32 for bfloat16 reductions): correct
    # the measured bytes by that difference. On a GPU the measured bytes stand as they are.
    return row.comm_bytes + gpu.total_bytes - here.total_bytes


def measure(config: Config, layout: str, hw: Hardware, steps: int = 0,
            memory_bytes: float | None = None, task: Task | None = None) -> Row:
    """Compile (and with ``steps`` > 0, time) the train step of ``config`` under ``layout``.

    ``memory_bytes`` is the device memory that ``fits`` is judged against (default:
    the hardware profile's); ``task`` is a user's task (default: the built-in model).
    """
    row = Row(layout, hardware=hw.key)
    try:
        run = build(apply_overrides(config, layout_overrides(layout)), task)
        batch = global_batch_shapes(run.data.batch(0, run.config.train.batch_size))
        start = time.perf_counter()
        compiled = run.trainer.compile_step(batch)
        row.compile_s = time.perf_counter() - start
    except JaxparError as err:  # a layout that cannot run; anything else is a bug: raised
        row.error = str(err)
        return row
    row.mem_args_bytes, row.mem_temp_bytes, row.mem_output_bytes, row.mem_total_bytes = \
        _memory(compiled)
    row.predicted_mem_args_bytes = predict_argument_bytes(run, batch)
    row.fits = row.mem_total_bytes <= (memory_bytes or hw.memory_bytes)
    cost = hlo.step_cost(compiled)
    # the sub-mesh pipeline moves activations between stages with device_put
    row.transfer_bytes = getattr(compiled, "transfer_bytes", None)
    row.flops = _scheduled_flops(compiled, cost, run)
    # HBM traffic, roughly: the state is read and written once, activations written and
    # read back once (an unfused CPU program's op-by-op traffic would say far more)
    row.mem_traffic_bytes = row.mem_args_bytes + row.mem_output_bytes + 2 * row.mem_temp_bytes
    comm_gpu = _fill_comm(row, cost, run)
    dtype = run.family.compute_dtype(run.config.model) if run.family else "float32"
    row.predicted_step_time_s = roofline(hw, row.flops, row.mem_traffic_bytes, comm_gpu,
                                         dtype).total_s
    if steps > 0:
        row.step_time_s = _time_steps(run, compiled, steps)
        examples = run.config.train.batch_size
        row.examples_per_s = examples / row.step_time_s
        per_example = run.plan.task.tokens_per_example
        row.tokens_per_s = examples * per_example / row.step_time_s if per_example else None
    return row


def sweep(config: Config, layouts: list[str], hw: Hardware, steps: int = 0,
          memory_bytes: float | None = None, echo: bool = False,
          task: Task | None = None) -> list[Row]:
    """:func:`measure` of every layout, in order."""
    rows = []
    for layout in layouts:
        rows.append(measure(config, layout, hw, steps, memory_bytes, task))
        if echo:
            print(f"  {layout}: {'ok' if rows[-1].ok else 'invalid'}", flush=True)
    return rows


# ---- output ----------------------------------------------------------------------------------
def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def csv_columns() -> list[str]:
    """The CSV header: the documented columns, then the extra ones."""
    return [*COLUMNS, *(f.name for f in fields(Row) if f.name not in COLUMNS)]


def write_csv(rows: list[Row], path: str | Path) -> Path:
    """``sweep.csv``: one row per layout, empty cells where a layout was invalid."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(csv_columns())
        for row in rows:
            values = asdict(row)
            writer.writerow([_cell(values[c]) for c in csv_columns()])
    return path


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _table_rows(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        if not r.ok:
            out.append([r.layout, "invalid: " + r.error.split(";")[0]])
            continue
        ratio = "" if r.comm_ratio is None else f"{r.comm_ratio:.3f}"
        out.append([
            r.layout, _mib(r.mem_args_bytes), _mib(r.mem_temp_bytes), _mib(r.mem_total_bytes),
            "yes" if r.fits else "NO", f"{r.flops / 1e9:.3f}", _mib(r.comm_bytes),
            _mib(r.predicted_comm_bytes), ratio,
            "" if r.step_time_s is None else f"{r.step_time_s:.4f}",
            "" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            f"{r.predicted_step_time_s * 1e3:.3f}"])
    return out


_HEAD = ["layout", "args MiB", "temp MiB", "total MiB", "fits", "GFLOP", "comm MiB",
         "predicted MiB", "measured/pred", "step s", "tokens/s", "pred. ms"]


def format_table(rows: list[Row], hw: Hardware) -> str:
    """The terminal table (per device; predicted step time on ``hw``)."""
    body = _table_rows(rows)
    widths = [max([len(_HEAD[i])] + [len(b[i]) for b in body if len(b) > 2])
              for i in range(len(_HEAD))]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in
                       enumerate(zip(_HEAD, widths))).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(b, widths))).rstrip())
    lines.append(f"per device; comm = collective wire bytes per step; predicted step time on "
                 f"{hw.name} (roofline)")
    return "\n".join(lines)


def format_markdown(rows: list[Row], hw: Hardware) -> str:
    """``sweep.md``: the same table in Markdown, invalid layouts with their full reason."""
    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for r, b in zip(rows, _table_rows(rows)):
        cells = b if r.ok else [r.layout, f"invalid: {r.error}", *[""] * (len(_HEAD) - 2)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines.append("")
    lines.append(f"Per device. comm: collective wire bytes per step read from the compiled HLO; "
                 f"predicted: the textbook formulas; pred. ms: roofline step time on {hw.name}.")
    return "\n".join(lines) + "\n"


def write_outputs(rows: list[Row], hw: Hardware, out_dir: str | Path,
                  chart: str = "sweep.png") -> list[Path]:
    """``sweep.csv``, ``sweep.md`` and the chart (``sweep.png``; a ``chart`` name ending in
    ``.svg`` writes SVG) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "sweep.md"
    md.write_text(format_markdown(rows, hw))
    labels = [r.layout for r in rows]
    panels = [
        Panel("peak memory per device", [r.mem_total_bytes for r in rows], "B",
              "bytes per device"),
        Panel("collective bytes per step: measured vs predicted",
              [(r.comm_bytes, r.predicted_comm_bytes) if r.ok else None for r in rows], "B",
              "bytes sent per device per step"),
        Panel("measured step time (this machine)", [r.step_time_s for r in rows], "s",
              "time per step"),
        Panel(f"predicted step time ({hw.key}, roofline)",
              [r.predicted_step_time_s for r in rows], "s", "time per step"),
    ]
    if all(r.step_time_s is None for r in rows):
        panels.pop(2)
    return [write_csv(rows, out / "sweep.csv"), md, write_chart(labels, panels, out / chart)]
