"""Pipeline schedules as data: per-device action lists, a time table, a validator.

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
  in-flight activations; :func:`tick_table` plays them with unit durations —
  the table the executor scans over, one row per tick — and assigns every
  activation and gradient message a buffer slot; :func:`validate` checks that
  table (every action exactly once, dependencies respected, no slot reused
  while live).
"""

from __future__ import annotations

import itertools
import typing
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from pydantic import Field

from jaxpar.errors import LayoutError
from jaxpar.schema import section

#: ``pipeline.schedule`` values.
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb_h1"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
KINDS = ("idle", "F", "B", "I", "W")
#: Durations used for reported bubbles: F = I = W = 1, a fused backward B = I + W.
UNIT_TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@section("pipeline")
class PipelineConfig:
    """Pipeline parallelism over mesh axis ``stage`` (used when ``mesh.stage > 1``)."""

    schedule: Schedule = Field("1f1b", description="the order of the microbatches' forward and "
                               "backward passes on each stage (see jaxpar/pipeline)")
    microbatches: int = Field(0, ge=0, description="how many microbatches one step's batch is "
                                                   "cut into (0: twice mesh.stage)")
    virtual_stages: int = Field(1, ge=1, description="layer chunks per device, for interleaved "
                                                     "(≥ 2) only")


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
      ValueError: naming the numbers and what to change.
    """
    if schedule not in SCHEDULES:
        raise LayoutError(f"unknown pipeline.schedule '{schedule}'; choose one of "
                          f"{', '.join(SCHEDULES)}")
    if p < 2:
        raise LayoutError(f"a pipeline needs mesh.stage ≥ 2 (got {p})")
    if m < 1:
        raise LayoutError(f"pipeline.microbatches must be ≥ 1 (got {m})")
    if schedule == "interleaved":
        if v < 2:
            raise LayoutError(
                f"pipeline.schedule=interleaved needs pipeline.virtual_stages ≥ 2 (got {v}); "
                "with one chunk per device use 1f1b")
        if m % p:
            raise LayoutError(
                f"pipeline.schedule=interleaved runs microbatches in groups of mesh.stage={p}: "
                f"pipeline.microbatches={m} is not a multiple of {p}; use "
                f"{max(p, m - m % p)} or {m - m % p + p}")
    elif v != 1:
        raise LayoutError(
            f"pipeline.virtual_stages={v} applies to schedule=interleaved only; "
            f"set pipeline.virtual_stages=1 for schedule={schedule}")


def build(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each device's ordered action list for ``schedule``."""
    check_shape(schedule, p, m, v)
    if schedule == "gpipe":
        return [[Action("F", j, d) for j in range(m)] + [Action("B", j, d) for j in range(m)]
                for d in range(p)]
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


def simulate(orders: list[list[Action]], v: int = 1,
             times: dict[str, float] | None = None) -> Timing:
    """Plays per-device action lists in order, each action as soon as its inputs exist.

    Args:
      orders: per-device action lists from :func:`build`.
      v: virtual stages per device (chunks = devices·v).
      times: duration of each action kind (default :data:`UNIT_TIMES`).

    Raises:
      ValueError: if the lists deadlock, repeat or miss an action.
    """
    times = dict(UNIT_TIMES if times is None else times)
    p = len(orders)
    num_chunks = p * v
    split = any(a.kind == "I" for order in orders for a in order)
    _check_complete(orders, num_chunks, split)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    pos, free = [0] * p, [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while pos[d] < len(orders[d]):
                action = orders[d][pos[d]]
                deps = dependencies(action, num_chunks, split)
                if any(dep not in end for dep in deps):
                    break
                t0 = max([free[d], *(end[dep] for dep in deps)])
                start[action], end[action] = t0, t0 + times[action.kind]
                free[d] = end[action]
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(orders[d][pos[d]]) for d in range(p) if pos[d] < len(orders[d])]
            raise ValueError(f"schedule deadlocks: next actions {stuck} wait on each other")
    makespan = max(end.values())
    busy = [sum(times[a.kind] for a in order) for order in orders]
    return Timing(start, end, makespan, busy, _peak_in_flight(orders, start, end, split))


def _check_complete(orders: list[list[Action]], num_chunks: int, split: bool,
                    m: int | None = None) -> None:
    """Each action once, on its chunk's device, for microbatches 0…m−1 (default: all seen)."""
    p = len(orders)
    seen: set[Action] = set()
    for d, order in enumerate(orders):
        for action in order:
            if action.chunk % p != d:
                raise ValueError(f"{action} of chunk {action.chunk} runs on device {d}, "
                                 f"not on its device {action.chunk % p}")
            if action in seen:
                raise ValueError(f"{action} appears twice")
            seen.add(action)
    kinds = ("F", "I", "W") if split else ("F", "B")
    mbs = set(range(m)) if m is not None else {a.mb for a in seen}
    want = {Action(k, j, c) for k in kinds for j in mbs for c in range(num_chunks)}
    missing = want - seen
    if missing or len(seen) != len(want):
        raise ValueError(f"schedule misses actions {sorted(map(str, missing))[:5]}")


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


# ---- the executor's table -------------------------------------------------------------------


@dataclass(frozen=True)
class TickTable:
    """What the executor scans over: one row per tick, one column per device.

    Arrays are int32 ``[ticks, p]``. ``kind`` indexes :data:`KINDS`; ``chunk``
    is the device-local chunk ``k`` (global chunk ``k·p + d``); ``act_slot`` /
    ``grad_slot`` are the buffer slots the action reads; ``recv_act`` /
    ``recv_grad`` the slots into which the message arriving this tick (from the
    left / right neighbour's previous tick) is written. Slot ``act_slots`` /
    ``grad_slots`` (one past the last) is the trash slot for messages nobody
    needs.
    """

    schedule: str
    p: int
    m: int
    v: int
    orders: list[list[Action]]
    kind: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_slots: int
    grad_slots: int
    tick: dict[Action, int] = field(repr=False)

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def split_backward(self) -> bool:
        return "I" in {a.kind for o in self.orders for a in o}

    def grid(self) -> list[list[Action | None]]:
        """``grid[t][d]``: the action device ``d`` runs at tick ``t`` (None: idle)."""
        rows: list[list[Action | None]] = [[None] * self.p for _ in range(self.ticks)]
        for action, t in self.tick.items():
            rows[t][action.chunk % self.p] = action
        return rows


def _intervals(table_tick: dict[Action, int], num_chunks: int, m: int, split: bool):
    """Live tick intervals [write, last read] of each activation and gradient buffer entry."""
    last = "W" if split else "B"
    back = "I" if split else "B"
    acts, grads = {}, {}
    for j in range(m):
        for c in range(num_chunks):
            # chunk 0's input is computed by its own F (the embedding); others arrive a tick
            # after the neighbour's F.
            write = table_tick[("F", j, c)] if c == 0 else table_tick[("F", j, c - 1)] + 1
            acts[(j, c)] = (write, table_tick[(last, j, c)])
            if c < num_chunks - 1:
                grads[(j, c)] = (table_tick[(back, j, c + 1)] + 1, table_tick[(last, j, c)])
    return acts, grads


def _assign_slots(intervals: dict, p: int) -> tuple[dict, int]:
    """Greedy interval colouring per device; returns slot per entry and slots per device."""
    slots, most = {}, 0
    for d in range(p):
        mine = sorted(((iv, key) for key, iv in intervals.items() if key[1] % p == d))
        free_at: list[int] = []  # free_at[s]: last tick slot s is busy
        for (lo, hi), key in mine:
            for s, busy_until in enumerate(free_at):
                if busy_until < lo:
                    free_at[s] = hi
                    break
            else:
                s = len(free_at)
                free_at.append(hi)
            slots[key] = s
        most = max(most, len(free_at))
    return slots, most


def tick_table(schedule: str, p: int, m: int, v: int = 1) -> TickTable:
    """The executor's table: the schedule played with unit durations, slots assigned."""
    orders = build(schedule, p, m, v)
    timing = simulate(orders, v, {"F": 1, "B": 1, "I": 1, "W": 1})
    tick = {a: int(t) for a, t in timing.start.items()}
    ticks = int(timing.makespan)
    split = schedule == "zb_h1"
    num_chunks = p * v
    acts, grads = _intervals(tick, num_chunks, m, split)
    act_slot_of, n_act = _assign_slots(acts, p)
    grad_slot_of, n_grad = _assign_slots(grads, p)
    shape = (ticks, p)
    kind, chunk, mb = np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    act_slot, grad_slot = np.full(shape, n_act, np.int32), np.full(shape, n_grad, np.int32)
    recv_act, recv_grad = np.full(shape, n_act, np.int32), np.full(shape, n_grad, np.int32)
    for action, t in tick.items():
        kd, j, c = action
        d = c % p
        kind[t, d], chunk[t, d], mb[t, d] = KINDS.index(kd), c // p, j
        act_slot[t, d] = act_slot_of[(j, c)]
        if (j, c) in grad_slot_of:
            grad_slot[t, d] = grad_slot_of[(j, c)]
    for (j, c), (write, _) in acts.items():
        if c > 0:
            recv_act[write, c % p] = act_slot_of[(j, c)]
    for (j, c), (write, _) in grads.items():
        recv_grad[write, c % p] = grad_slot_of[(j, c)]
    table = TickTable(schedule, p, m, v, orders, kind, chunk, mb, act_slot, grad_slot,
                      recv_act, recv_grad, n_act, n_grad, tick)
    validate(table)
    return table


def validate(table: TickTable) -> None:
    """Checks a tick table.

    * every action of every (microbatch, chunk) appears exactly once, on its device;
    * each action runs after what it needs (an input from another device arrives
      one tick after it was computed);
    * a message is written into its slot the tick it arrives and no slot is
      overwritten while its entry is still to be read.

    Raises:
      ValueError: describing the first violation.
    """
    p, num_chunks, split = table.p, table.p * table.v, table.split_backward
    # exactly once (from the arrays, not from the dict the arrays were made of)
    seen: dict[Action, int] = {}
    for t in range(table.ticks):
        for d in range(p):
            k = int(table.kind[t, d])
            if not 0 <= k < len(KINDS):
                raise ValueError(f"tick {t} device {d}: action code {k} is not one of {KINDS}")
            if k == 0:
                continue
            action = Action(KINDS[k], int(table.mb[t, d]), int(table.chunk[t, d]) * p + d)
            if action in seen:
                raise ValueError(f"{action} runs twice (ticks {seen[action]} and {t})")
            seen[action] = t
    _check_complete(table.orders, num_chunks, split, table.m)
    if set(seen) != set(table.tick):
        raise ValueError("the table does not hold every action of the schedule")
    for action, t in seen.items():
        for dep in dependencies(action, num_chunks, split):
            lag = 0 if dep.chunk % p == action.chunk % p else 1
            if dep not in seen or seen[dep] + lag > t:
                raise ValueError(f"{action} at tick {t} runs before {dep} is available")
    # slots: every reader of an entry uses one slot, arrivals are written to it, and
    # no two entries of one slot are live at once
    acts, grads = _intervals(seen, num_chunks, table.m, split)
    back = ("I", "W") if split else ("B",)
    for name, intervals, reads, recv, trash, kinds in (
        ("activation", acts, table.act_slot, table.recv_act, table.act_slots, ("F", *back)),
        ("gradient", grads, table.grad_slot, table.recv_grad, table.grad_slots, back),
    ):
        lives: dict[tuple[int, int], list[tuple[int, int, tuple[int, int]]]] = {}
        arrivals = 0
        for (j, c), (lo, hi) in intervals.items():
            d = c % p
            slots = {int(reads[seen[Action(k, j, c)], d]) for k in kinds}
            if len(slots) != 1 or trash in slots:
                raise ValueError(f"{name} of microbatch {j} chunk {c} is read from slots {slots}")
            slot = slots.pop()
            if c > 0 or name == "gradient":
                arrivals += 1
                if int(recv[lo, d]) != slot:
                    raise ValueError(f"{name} of microbatch {j} chunk {c} is not written to "
                                     f"slot {slot} when it arrives (tick {lo})")
            lives.setdefault((d, slot), []).append((lo, hi, (j, c)))
        if int((recv != trash).sum()) != arrivals:
            raise ValueError(f"the table writes {name} messages that no action reads")
        for (d, slot), spans in lives.items():
            spans.sort()
            for (_, hi1, k1), (lo2, _, k2) in itertools.pairwise(spans):
                if lo2 <= hi1:
                    raise ValueError(
                        f"device {d} {name} slot {slot} is overwritten at tick {lo2} by "
                        f"microbatch {k2[0]} chunk {k2[1]} while microbatch {k1[0]} chunk "
                        f"{k1[1]} needs it until tick {hi1}")
