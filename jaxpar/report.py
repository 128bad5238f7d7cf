"""``jaxpar inspect``: where every parameter lives and what a step costs per device.

Nothing is trained and no parameter is allocated: shapes come from
``nnx.eval_shape``, shardings from the rules, and the compiled step's memory
from ``jit(...).lower(...).compile().memory_analysis()`` on abstract inputs, its
collective bytes from the compiled HLO (:func:`jaxpar.hlo.program_cost`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, get_args

import jax

from jaxpar import hlo
from jaxpar import sharding as shd
from jaxpar.axes import Axis
from jaxpar.logical import SEQ, split_over
from jaxpar.plan import FsdpGather, Plan, global_batch_shapes
from jaxpar.plan.strategy import gathers_weights
from jaxpar.run import Run


@dataclass(frozen=True)
class GatherOption:
    """The compiled step under one ``train.fsdp_gather`` setting: temporaries and wire
    bytes per collective kind, per device."""

    setting: str
    step_temp_bytes: int
    collective_bytes: dict[str, float]


@dataclass(frozen=True)
class Totals:
    """Per-device byte totals of a layout. ``collective_bytes``: wire bytes per collective
    kind of one step; ``fsdp_gather``: the step under each ``train.fsdp_gather`` setting
    (the run's first), when the setting matters (accumulation over FSDP-sharded weights
    outside a pipeline), else empty."""

    params_bytes: int
    opt_state_bytes: int
    params_total_bytes: int
    opt_state_total_bytes: int
    step_argument_bytes: int
    step_output_bytes: int
    step_temp_bytes: int
    collective_bytes: dict[str, float] | None = None
    fsdp_gather: tuple[GatherOption, ...] = ()
    stages: tuple = ()


def _example_batch(run: Run) -> dict[str, jax.ShapeDtypeStruct]:
    """The run's global batch as shapes and dtypes (this process loads a share of it)."""
    host = run.data.batch(0, run.config.train.batch_size)
    return global_batch_shapes(host, run.plan.row_share[1])


def _collective_bytes(compiled) -> dict[str, float]:
    stats = hlo.step_cost(compiled).collectives
    return {kind: stat.wire_bytes for kind, stat in stats.items() if stat.count}


def _gather_trade(run: Run, compiled, batch) -> tuple[GatherOption, ...]:
    """The step under both ``train.fsdp_gather`` settings (the run's first) when it
    accumulates over weights that FSDP gathers, outside a pipeline (which gathers once)."""
    plan = run.plan
    if plan.grad_accum == 1 or plan.pipeline is not None or not gathers_weights(plan.param_specs):
        return ()
    mine = "once" if plan.fsdp_gather_once else "per_microbatch"
    other = next(s for s in get_args(FsdpGather) if s != mine)
    with warnings.catch_warnings():  # the run's own warnings were given when it was built
        warnings.simplefilter("ignore")
        alternative = run.trainer.with_plan(plan.replan(fsdp_gather=other)).compile_step(batch)
    return tuple(
        GatherOption(setting, int(c.memory_analysis().temp_size_in_bytes), _collective_bytes(c))
        for setting, c in ((mine, compiled), (other, alternative))
    )


def layout_totals(run: Run) -> Totals:
    """State bytes per device from the shardings; step bytes and collectives from the
    compiled program (and from the other ``train.fsdp_gather`` setting's, when it matters)."""
    batch = _example_batch(run)
    compiled = run.trainer.compile_step(batch)
    mem = compiled.memory_analysis()
    state = run.plan.state_bytes()
    return Totals(
        params_bytes=state.params,
        opt_state_bytes=state.opt_state,
        params_total_bytes=state.params_total,
        opt_state_total_bytes=state.opt_state_total,
        step_argument_bytes=int(mem.argument_size_in_bytes),
        step_output_bytes=int(mem.output_size_in_bytes),
        step_temp_bytes=int(mem.temp_size_in_bytes),
        collective_bytes=_collective_bytes(compiled),
        fsdp_gather=_gather_trade(run, compiled, batch),
        stages=tuple(getattr(compiled, "stages", ())),
    )


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_spec(spec) -> str:
    def entry(e):
        if e is None:
            return "None"
        return e if isinstance(e, str) else "(" + ",".join(e) + ")"

    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _fmt_axes(names: tuple) -> str:
    return "(" + ", ".join("-" if n is None else n for n in names) + ")"


def _table(rows: list[shd.ParamRow], unnamed: set[str], head: str) -> list[str]:
    table = [(head, "shape", "logical axes", "PartitionSpec", "bytes/device")]
    table += [
        (
            r.path,
            "×".join(map(str, r.shape)) or "scalar",
            "(none: replicated)" if r.path in unnamed else _fmt_axes(r.axes),
            _fmt_spec(r.spec),
            _fmt_bytes(r.bytes_per_device),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _context_lines(plan: Any, batch: int, seq_len: int) -> list[str]:
    """With the sequence split over devices: the share each holds and how attention runs."""
    axes = split_over(plan.rules, plan.mesh.shape, SEQ)
    if not axes:
        return []
    ways = math.prod(plan.mesh.shape[a] for a in axes)
    context = plan.context
    order = "a causal one reordered to balance the work" if context.balance else "in order"
    return [
        f"sequence split over {', '.join(axes)}: {seq_len // ways} of {seq_len} tokens "
        f"of each of {batch // plan.batch_ways()} sequences per device, {order}; "
        f"attention {context.attention}"
    ]


def _opt_note(plan: Plan) -> list[str]:
    """Which optimizer-state leaves are replicated because they are not parameter-shaped."""
    leaves = plan.opt_replicated
    if not leaves:
        return []
    shown = ", ".join(f"{path} {'×'.join(map(str, shape))}" for path, shape in leaves[:8])
    more = f" and {len(leaves) - 8} more" if len(leaves) > 8 else ""
    return [
        f"note: {len(leaves)} optimizer-state arrays are not parameter-shaped and are "
        f"replicated on every device: {shown}{more}"
    ]


def _gather_lines(plan: Plan, options: tuple[GatherOption, ...]) -> list[str]:
    """The memory/communication trade of ``train.fsdp_gather``, one row per setting."""
    if not options:
        return []
    kinds = [k for k in hlo.COLLECTIVES if any(k in o.collective_bytes for o in options)]
    rows = [("train.fsdp_gather", "temporaries", *kinds)]
    rows += [
        (
            o.setting + (" (this run)" if i == 0 else ""),
            _fmt_bytes(o.step_temp_bytes),
            *(_fmt_bytes(int(o.collective_bytes.get(k, 0))) for k in kinds),
        )
        for i, o in enumerate(options)
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "",
        f"FSDP weight gathers with train.grad_accum={plan.grad_accum} "
        "(per_microbatch: gathered in every microbatch, least memory; once: gathered "
        "once per step and kept):",
        *("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows),
    ]


def _stage_lines(stages: tuple) -> list[str]:
    """Per stage of the sub-mesh pipeline executor: what one of its devices holds and
    sends in a step (:mod:`jaxpar.pipeline.programs`)."""
    if not stages:
        return []
    rows = [
        (
            Axis.STAGE.value,
            "chunks",
            "state+batch",
            "program temp",
            "grad sums",
            "stash (peak)",
            "sent/step",
        )
    ]
    rows += [
        (
            str(s.stage),
            ",".join(map(str, s.chunks)),
            _fmt_bytes(s.memory.argument_size_in_bytes),
            _fmt_bytes(s.program_temp_bytes),
            _fmt_bytes(s.grad_sum_bytes),
            f"{_fmt_bytes(s.stash_bytes)} ({s.stash_peak})",
            _fmt_bytes(s.sent_bytes),
        )
        for s in stages
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "",
        "per stage, one device (pipeline.executor=mpmd: a program per chunk and "
        "action; the stash holds each forward's input until its backward):",
        *("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows),
    ]


def format_report(run: Run, totals: Totals) -> str:
    """The ``jaxpar inspect`` text: one row per parameter (and per variable of the model's
    other state), then per-device totals and what is replicated."""
    plan = run.plan
    model, shardings = plan.model, plan.state_shardings
    unnamed = set(model.unnamed)
    rows = shd.param_rows(model.params, model.param_axes, shardings.params)
    lines = _table(rows, unnamed, "parameter")
    if model.stateful:
        state_rows = shd.param_rows(model.state, model.state_axes, shardings.model_state)
        lines += [
            "",
            *_table(state_rows, set(), "model state (" + ", ".join(model.state_kinds) + ")"),
        ]
    lines += [
        "",
        f"devices: {plan.mesh.devices.size}  mesh: "
        + " ".join(f"{k}={v}" for k, v in plan.mesh.shape.items()),
        f"params per device:           {_fmt_bytes(totals.params_bytes)}"
        f"  (total {_fmt_bytes(totals.params_total_bytes)})",
        f"optimizer state per device:  {_fmt_bytes(totals.opt_state_bytes)}"
        f"  (total {_fmt_bytes(totals.opt_state_total_bytes)})"
        + ("  in pinned host memory between steps" if plan.optimizer_offload else ""),
        f"train step per device (compiled): arguments "
        f"{_fmt_bytes(totals.step_argument_bytes)}, outputs "
        f"{_fmt_bytes(totals.step_output_bytes)}, temporaries "
        f"{_fmt_bytes(totals.step_temp_bytes)}",
    ]
    if totals.collective_bytes is not None:
        lines.append(
            "collectives per step per device (compiled, wire bytes): "
            + (
                ", ".join(
                    f"{kind} {_fmt_bytes(int(n))}" for kind, n in totals.collective_bytes.items()
                )
                or "none"
            )
        )
    lines += _gather_lines(plan, totals.fsdp_gather)
    lines += _context_lines(plan, run.config.train.batch_size, getattr(run.data, "seq_len", 0))
    lines += _stage_lines(totals.stages)
    if unnamed:
        lines.append(
            f"note: {len(unnamed)} parameter{'s carry' if len(unnamed) != 1 else ' carries'} no "
            f"logical axes and {'are' if len(unnamed) != 1 else 'is'} replicated "
            "(annotate them with nnx.with_partitioning to shard them)"
        )
    return "\n".join(lines + _opt_note(plan))
