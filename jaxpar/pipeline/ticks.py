"""The executor's table: a schedule played with unit durations, one row per tick, every
activation and gradient message given a buffer slot (:func:`tick_table`), and the checks
that the table is right (:func:`validate`: every action exactly once, dependencies
respected, no slot reused while live). Pure NumPy, no JAX."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from jaxpar.pipeline.schedule import (
    KINDS,
    Action,
    build,
    check_complete,
    dependency_keys,
    simulate,
)


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
    slots = {}
    most = 0
    by_device: list[list] = [[] for _ in range(p)]
    for key, iv in intervals.items():
        by_device[key[1] % p].append((iv, key))
    for entries in by_device:
        mine = sorted(entries)
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


@functools.lru_cache(maxsize=64)
def tick_table(schedule: str, p: int, m: int, v: int = 1) -> TickTable:
    """The executor's table: the schedule played with unit durations, slots assigned.

    Made and checked once per process for each ``(schedule, p, m, v)`` (a plan over many
    layouts asks for the same few tables): the one table is shared, its arrays read-only
    (``dataclasses.replace`` with copies makes another)."""
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
    kind = np.zeros(shape, np.int32)
    chunk = np.zeros(shape, np.int32)
    mb = np.zeros(shape, np.int32)
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
    table = TickTable(
        schedule,
        p,
        m,
        v,
        orders,
        kind,
        chunk,
        mb,
        act_slot,
        grad_slot,
        recv_act,
        recv_grad,
        n_act,
        n_grad,
        tick,
    )
    validate(table)
    for array in (kind, chunk, mb, act_slot, grad_slot, recv_act, recv_grad):
        array.flags.writeable = False
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
    p = table.p
    num_chunks = table.p * table.v
    split = table.split_backward
    seen = _actions_once(table)
    check_complete(table.orders, num_chunks, split, table.m)
    if set(seen) != set(table.tick):
        raise ValueError("the table does not hold every action of the schedule")
    for action, t in seen.items():
        for dep in dependency_keys(action, num_chunks, split):
            lag = 0 if dep[2] % p == action.chunk % p else 1
            if dep not in seen or seen[dep] + lag > t:
                raise ValueError(f"{action} at tick {t} runs before {Action(*dep)} is available")
    acts, grads = _intervals(seen, num_chunks, table.m, split)
    back = ("I", "W") if split else ("B",)
    _check_slots(
        table,
        seen,
        "activation",
        acts,
        table.act_slot,
        table.recv_act,
        table.act_slots,
        ("F", *back),
    )
    _check_slots(
        table, seen, "gradient", grads, table.grad_slot, table.recv_grad, table.grad_slots, back
    )


def _actions_once(table: TickTable) -> dict[Action, int]:
    """The tick of every action, read from the arrays (not from the dict they were made
    of); an action code out of range or an action run twice is an error."""
    p = table.p
    seen = {}
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
    return seen


def _check_slots(
    table: TickTable,
    seen: dict[Action, int],
    name: str,
    intervals: dict,
    reads: np.ndarray,
    recv: np.ndarray,
    trash: int,
    kinds: tuple[str, ...],
) -> None:
    """Every reader of a message entry uses one slot, arrivals are written to it, and no
    two entries of one slot are live at once."""
    lives: dict[tuple[int, int], list[tuple[int, int, tuple[int, int]]]] = {}
    arrivals = 0
    for (j, c), (lo, hi) in intervals.items():
        d = c % table.p
        slots = {int(reads[seen[Action(k, j, c)], d]) for k in kinds}
        if len(slots) != 1 or trash in slots:
            raise ValueError(f"{name} of microbatch {j} chunk {c} is read from slots {slots}")
        slot = slots.pop()
        if c > 0 or name == "gradient":
            arrivals += 1
            if int(recv[lo, d]) != slot:
                raise ValueError(
                    f"{name} of microbatch {j} chunk {c} is not written to "
                    f"slot {slot} when it arrives (tick {lo})"
                )
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
                    f"{k1[1]} needs it until tick {hi1}"
                )
