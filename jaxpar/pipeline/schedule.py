"""Pipeline schedules as data: per-device action lists and their simulation.

Pure NumPy, no JAX. Vocabulary (``p`` stages/devices, ``m`` microbatches,
``v`` virtual stages per device):

* the model's layers are cut into ``C = p·v`` *chunks*; chunk ``c`` lives on
  device ``c % p`` (for ``v = 1`` a chunk is a stage, for ``v > 1`` device ``d``
  holds chunks ``d, d+p, d+2p, …`` — the interleaved layout);
* an :class:`Action` is one unit of work on one microbatch and one chunk:
  ``F`` forward, ``B`` full backward, or — zero-bubble schedules — ``I`` (the
  input gradient, on the critical path) and ``W`` (the weight gradient, which
  can wait);
* :func:`build` gives each device its ordered action list; :func:`simulate`
  plays the lists against their dependencies with given action durations and
  returns the start times, the bubble fraction and the peak number of
  in-flight activations. :mod:`jaxpar.pipeline.ticks` plays them with unit
  durations — the table both executors run — and checks that table.
"""

from __future__ import annotations

import typing
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from pydantic import Field

from jaxpar.errors import LayoutError
from jaxpar.schema import IntList, section

#: ``pipeline.executor`` values (see :class:`PipelineConfig`).
Executor = Literal["auto", "spmd", "mpmd"]
#: ``pipeline.backward`` values (see :class:`PipelineConfig`).
Backward = Literal["recompute", "residuals"]
#: ``pipeline.schedule`` values.
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb_h1"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
KINDS = ("idle", "F", "B", "I", "W")
#: Durations used for reported bubbles: F = I = W = 1, a fused backward B = I + W.
UNIT_TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@section("pipeline")
class PipelineConfig:
    """Pipeline parallelism over mesh axis ``stage`` (used when ``mesh.stage > 1``)."""

    schedule: Schedule = Field(
        "1f1b",
        description="the order of the microbatches' forward and "
        "backward passes on each stage (see jaxpar/pipeline)",
    )
    microbatches: int = Field(
        0,
        ge=0,
        description="how many microbatches one step's batch is cut into (0: twice mesh.stage)",
    )
    virtual_stages: int = Field(
        1, ge=1, description="layer chunks per device, for interleaved (≥ 2) only"
    )
    executor: Executor = Field(
        "auto",
        description="spmd: one program over the whole mesh, "
        "a stack of identical layers (Task.stages) split over stage; "
        "mpmd: one program per stage on its sub-mesh, any model split "
        "by layer (Task.layers) or a stack of layers; auto: spmd for a "
        "stack, mpmd for a model given by its layers",
    )
    split: IntList = Field(
        (),
        description="with the mpmd executor, layers per chunk (one "
        "number per stage × virtual stage, in order, summing to the "
        "model's layers); empty: balanced by parameter bytes",
    )
    backward: Backward = Field(
        "recompute",
        description="with the mpmd executor, what a "
        "backward starts from: recompute (the chunk's forward again, "
        "from its stashed input: least memory) or residuals (kept by "
        "the forward: no second forward, more memory)",
    )


class Action(NamedTuple):
    """One unit of work: ``kind`` on microbatch ``mb`` of chunk ``chunk``."""

    kind: str
    mb: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def check_shape(schedule: str, p: int, m: int, v: int) -> None:
    """Rejects (schedule, p, m, v) combinations the schedule cannot run.

    Raises:
      LayoutError: naming the numbers and what to change.
    """
    if schedule not in SCHEDULES:
        raise LayoutError(
            f"unknown pipeline.schedule '{schedule}'; choose one of {', '.join(SCHEDULES)}"
        )
    if p < 2:
        raise LayoutError(f"a pipeline needs mesh.stage ≥ 2 (got {p})")
    if m < 1:
        raise LayoutError(f"pipeline.microbatches must be ≥ 1 (got {m})")
    if schedule == "interleaved":
        if v < 2:
            raise LayoutError(
                f"pipeline.schedule=interleaved needs pipeline.virtual_stages ≥ 2 (got {v}); "
                "with one chunk per device use 1f1b"
            )
        if m % p:
            raise LayoutError(
                f"pipeline.schedule=interleaved runs microbatches in groups of mesh.stage={p}: "
                f"pipeline.microbatches={m} is not a multiple of {p}; use "
                f"{max(p, m - m % p)} or {m - m % p + p}"
            )
    elif v != 1:
        raise LayoutError(
            f"pipeline.virtual_stages={v} applies to schedule=interleaved only; "
            f"set pipeline.virtual_stages=1 for schedule={schedule}"
        )


def build(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each device's ordered action list for ``schedule``."""
    check_shape(schedule, p, m, v)
    if schedule == "gpipe":
        return [
            [Action("F", j, d) for j in range(m)] + [Action("B", j, d) for j in range(m)]
            for d in range(p)
        ]
    if schedule == "1f1b":
        return [_one_f_one_b(p, m, d) for d in range(p)]
    if schedule == "interleaved":
        return [_interleaved(p, m, v, d) for d in range(p)]
    return [_zb_h1(p, m, d) for d in range(p)]


def _one_f_one_b(p: int, m: int, d: int) -> list[Action]:
    """PipeDream-Flush: p−d−1 warm-up forwards, then alternate F and B, then drain."""
    warm = min(p - d - 1, m)
    order = [Action("F", j, d) for j in range(warm)]
    for i in range(m - warm):
        order += [Action("F", warm + i, d), Action("B", i, d)]
    return order + [Action("B", j, d) for j in range(m - warm, m)]


def _interleaved(p: int, m: int, v: int, d: int) -> list[Action]:
    """Megatron's interleaved 1F1B: microbatches in groups of p, v chunks per device."""

    def unit(i: int, forward: bool) -> Action:
        group, rest = divmod(i, p * v)
        k = rest // p if forward else v - 1 - rest // p
        return Action("F" if forward else "B", group * p + rest % p, k * p + d)

    total = m * v
    warm = min((p - d - 1) * 2 + (v - 1) * p, total)
    order = [unit(i, True) for i in range(warm)]
    for i in range(total - warm):
        order += [unit(warm + i, True), unit(i, False)]
    return order + [unit(i, False) for i in range(total - warm, total)]


def _zb_h1(p: int, m: int, d: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I and W.

    Device ``d`` warms up like 1F1B, then runs ``F, I`` pairs and defers its
    first ``d`` weight gradients ``W`` (holding at most ``p`` microbatches, the
    peak of 1F1B's first device); in the drain each ``I`` is followed by one
    deferred ``W``, filling what would be 1F1B's drain bubbles. With equal F, I
    and W times the idle time per device is ``p − 1`` units, a third of 1F1B's
    ``3(p − 1)``.
    """
    warm = min(p - d - 1, m)
    order = [Action("F", j, d) for j in range(warm)]
    deferred: deque[int] = deque()
    for i in range(m - warm):
        order += [Action("F", warm + i, d), Action("I", i, d)]
        deferred.append(i)
        if len(deferred) > d:
            order.append(Action("W", deferred.popleft(), d))
    for i in range(m - warm, m):
        order.append(Action("I", i, d))
        deferred.append(i)
        order.append(Action("W", deferred.popleft(), d))
    return order + [Action("W", i, d) for i in deferred]


# ---- playing the lists --------------------------------------------------------------------


def action_times(recompute: float) -> dict[str, float]:
    """Each action's cost in forwards as the executors run it: :data:`UNIT_TIMES`, but a
    split backward's weight half costs a whole backward (a chunk's weight gradients need
    the activation gradients through every one of its layers: measured on gpt_tiny's
    ``zb_h1`` over 4 stages, the W branch's FLOPs equal B's, 319 M against a forward's
    117 M); a backward, and each half of a split one, first runs ``recompute`` of its
    chunk's forward again (0 or False: none; 1 or True: all of it)."""
    times = {**UNIT_TIMES, "W": UNIT_TIMES["B"]}
    return {k: t + float(recompute) * (k in ("B", "I", "W")) for k, t in times.items()}


def dependencies(action: Action, num_chunks: int, split_backward: bool) -> list[Action]:
    """Actions that must finish before ``action`` may start."""
    kind, j, c = action
    if kind == "F":
        return [Action("F", j, c - 1)] if c > 0 else []
    if kind == "W":
        return [Action("I", j, c)]
    back = "I" if split_backward else "B"
    deps = [Action("F", j, c)]
    if c < num_chunks - 1:
        deps.append(Action(back, j, c + 1))
    return deps


def dependency_keys(action: Action, num_chunks: int, split_backward: bool) -> tuple[tuple, ...]:
    """:func:`dependencies` as plain tuples, which hash and compare as the actions they
    stand for and cost less to make (a simulation makes a set for every action)."""
    kind, j, c = action
    if kind == "F":
        return (("F", j, c - 1),) if c > 0 else ()
    if kind == "W":
        return (("I", j, c),)
    if c < num_chunks - 1:
        return ("F", j, c), ("I" if split_backward else "B", j, c + 1)
    return (("F", j, c),)


@dataclass(frozen=True)
class Timing:
    """A simulated run: start/end of every action, bubble and memory."""

    start: dict[Action, float]
    end: dict[Action, float]
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]

    @property
    def bubble(self) -> float:
        """Idle fraction of ``devices × makespan``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def idle(self) -> list[float]:
        """Idle time per device."""
        return [self.makespan - b for b in self.busy]


def simulate(
    orders: list[list[Action]],
    v: int = 1,
    times: dict[str, float] | None = None,
    last: dict[str, float] | None = None,
    cost: Callable[[Action], float] | None = None,
) -> Timing:
    """Plays per-device action lists in order, each action as soon as its inputs exist.

    Args:
      orders: per-device action lists from :func:`build`.
      v: virtual stages per device (chunks = devices·v).
      times: duration of each action kind (default :data:`UNIT_TIMES`).
      last: what each kind of the last chunk's actions lasts more (a model's head).
      cost: each action's duration, in place of ``times`` and ``last`` (a compiled
        program's FLOPs, say).

    Raises:
      ValueError: if the lists deadlock, repeat or miss an action.
    """
    times = dict(UNIT_TIMES if times is None else times)
    p = len(orders)
    num_chunks = p * v
    extra = last or {}

    def duration(a: Action) -> float:
        if cost is not None:
            return cost(a)
        return times[a.kind] + (extra.get(a.kind, 0.0) if a.chunk == num_chunks - 1 else 0.0)

    split = any(a.kind == "I" for order in orders for a in order)
    check_complete(orders, num_chunks, split)
    # each action with what it waits on and how long it lasts, worked out once
    plans = [
        [(a, dependency_keys(a, num_chunks, split), duration(a)) for a in order] for order in orders
    ]
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    pos = [0] * p  # the index of each device's next action
    free = [0.0] * p  # when each device is free
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d, steps in enumerate(plans):
            i, t = pos[d], free[d]
            while i < len(steps):
                action, deps, lasts = steps[i]
                ready = t
                for dep in deps:
                    done = end.get(dep)
                    if done is None:
                        break
                    ready = max(ready, done)
                else:
                    start[action], t = ready, ready + lasts
                    end[action] = t
                    i += 1
                    continue
                break
            if i > pos[d]:
                remaining -= i - pos[d]
                pos[d], free[d], progressed = i, t, True
        if not progressed:
            stuck = [str(orders[d][pos[d]]) for d in range(p) if pos[d] < len(orders[d])]
            raise ValueError(f"schedule deadlocks: next actions {stuck} wait on each other")
    makespan = max(end.values())
    busy = [sum(lasts for _, _, lasts in steps) for steps in plans]
    return Timing(start, end, makespan, busy, _peak_in_flight(orders, start, end, split))


def check_complete(
    orders: list[list[Action]], num_chunks: int, split: bool, m: int | None = None
) -> None:
    """Each action once, on its chunk's device, for microbatches 0…m−1 (default: all seen)."""
    p = len(orders)
    seen: set[Action] = set()
    for d, order in enumerate(orders):
        for action in order:
            if action.chunk % p != d:
                raise ValueError(
                    f"{action} of chunk {action.chunk} runs on device {d}, "
                    f"not on its device {action.chunk % p}"
                )
            if action in seen:
                raise ValueError(f"{action} appears twice")
            seen.add(action)
    kinds = ("F", "I", "W") if split else ("F", "B")
    mbs = set(range(m)) if m is not None else {a.mb for a in seen}
    want = {(k, j, c) for k in kinds for j in mbs for c in range(num_chunks)}  # as Actions
    missing = want - seen
    if missing or len(seen) != len(want):
        named = sorted(str(Action(*a)) for a in missing)
        raise ValueError(f"schedule misses actions {named[:5]}")


def _peak_in_flight(orders, start, end, split) -> list[int]:
    """Per device: most microbatch-chunks whose forward started and backward has not ended."""
    last = "W" if split else "B"
    peaks = []
    for order in orders:
        events = []
        for a in order:
            if a.kind == "F":
                events.append((start[a], 1))
            elif a.kind == last:
                events.append((end[a], -1))
        events.sort(key=lambda e: (e[0], e[1]))  # a release at t frees before an F at t
        live = peak = 0
        for _, delta in events:
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks
