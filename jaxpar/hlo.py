"""Reading a compiled program's HLO text: which collectives run, how often, how many bytes.

``jax.jit(f).lower(...).compile().as_text()`` prints the optimized HLO module as
named computations. A collective inside a ``while`` body (a ``lax.scan``) runs
once per iteration; the same op outside runs once per step. These helpers walk
the call graph from the entry computation, multiply each while body by its
trip count (XLA records ``known_trip_count`` for scans), and sum:

* collective bytes per kind (:func:`collective_stats`), both the payload (the
  buffer the op reduces, gathers or sends) and the bytes each device puts on
  the wire under the ring algorithms of the textbook:

  ===================  =========================  ==========================
  kind                 payload S                  wire bytes per device
  ===================  =========================  ==========================
  all-reduce           operand (= result)         2(n−1)/n · S
  all-gather           result (the whole buffer)  (n−1)/n · S
  reduce-scatter       operand (= n × result)     (n−1)/n · S
  all-to-all           operand (= result)         (n−1)/n · S
  collective-permute   operand (= result)         S × pairs / devices
  ===================  =========================  ==========================

  with n the replica-group size;
* how many collectives one step executes (:attr:`ProgramCost.collective_ops`, the
  count an α-β model prices: a collective inside a scan of 4 layers counts 4);
* matmul and convolution FLOPs (:attr:`ProgramCost.flops`): XLA's own
  ``cost_analysis()`` counts a while body once, whatever its trip count, so a
  scanned 4-layer model reads as about one layer. A GPU program's matmuls are
  custom calls to cuBLAS (a gemm's backend config names its contracting dims as a
  ``dot`` does) and its attention cuDNN's fused kernel (two products forward, five
  backward over the scores): both are counted (``benchmarks/`` keeps a step
  compiled for an H200, ``tests/test_hlo.py``).

The parser accepts the text of JAX 0.10–0.12 (replica groups written as
explicit lists, iota ``[g,n]<=[N]``, or ``mesh[...] {axes}``) and the ``-start``
forms of asynchronous collectives that GPU programs use.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from jaxpar.hlo_flops import instruction_flops
from jaxpar.hlo_text import (
    REDUCER_OPS,
    Instruction,
    array_bytes,
    arrays,
    callees,
    parse,
    trip_count,
)

# the text's reading, for callers that read a program's text and its cost through this module
from jaxpar.hlo_text import Module as Module
from jaxpar.hlo_text import count_ops as count_ops
from jaxpar.hlo_text import loop_computations as loop_computations

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


@dataclass(frozen=True)
class CollectiveStat:
    """One collective kind summed over a step: executions, payload and wire bytes, and
    the arrays they move (an all-reduce of a tuple of k arrays moves k: XLA:CPU makes a
    call per array), and the devices each waits for (its group; a collective-permute,
    which names no groups, every device of the program)."""

    count: int = 0
    payload_bytes: float = 0.0
    wire_bytes: float = 0.0
    arrays: int = 0
    participants: int = 0


# ---- collectives -----------------------------------------------------------------------------
def group_size(inst: Instruction, num_partitions: int) -> int:
    """The replica-group size of a collective, in any of the text forms XLA prints."""
    attrs = inst.attrs
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if listed:
        return len([x for x in listed.group(1).split(",") if x.strip()])
    return num_partitions  # replica_groups={} : every device


def _collective_kind(inst: Instruction) -> str | None:
    kind = inst.opcode.removesuffix("-start")
    return kind if kind in COLLECTIVES else None


def _collective(inst: Instruction, num_partitions: int) -> tuple[str, float, float, int] | None:
    """(kind, payload bytes, wire bytes per device, arrays) of one collective
    instruction."""
    kind = _collective_kind(inst)
    if kind is None:
        return None
    parts = [a for a in arrays(inst.type) if a[1] or kind == "all-reduce"]
    if inst.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
        # async forms return (operands…, results…[, context scalars])
        parts = [a for a in parts if a[1]]
        parts = parts[len(parts) // 2 :] if kind == "all-gather" else parts[:1]
    result = sum(array_bytes(*a) for a in parts)
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", inst.attrs)
        n_pairs = len(re.findall(r"\{\d+,\d+", pairs.group(0))) if pairs else 0
        return kind, result, result * n_pairs / max(num_partitions, 1), len(parts)
    n = group_size(inst, num_partitions)
    payload = result * n if kind == "reduce-scatter" else result
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return kind, payload, payload * factor, len(parts)


# ---- the whole program -----------------------------------------------------------------------
@dataclass(frozen=True)
class ProgramCost:
    """What one execution of a compiled program does on each device."""

    flops: float
    collectives: dict[str, CollectiveStat]
    unknown_loops: int

    @property
    def collective_ops(self) -> int:
        """Collectives executed per execution, every kind together: each op inside a loop
        times its trip count, a conditional's busiest branch (the α term's count)."""
        return sum(s.count for s in self.collectives.values())

    @property
    def collective_arrays(self) -> int:
        """The arrays those collectives move, executions counted as above (a combined
        all-reduce of k arrays counts k: XLA:CPU's gloo makes one call per array)."""
        return sum(s.arrays for s in self.collectives.values())

    @property
    def collective_participants(self) -> int:
        """The devices those collectives wait for, executions counted as above: each one's
        group size (a collective-permute: every device of the program). A collective on
        XLA:CPU is a rendezvous of its devices' threads."""
        return sum(s.participants for s in self.collectives.values())


def _add(total: dict[str, float], part: dict[str, float], times: float = 1.0) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + times * v


def step_cost(compiled: Any) -> ProgramCost:
    """What one execution of a compiled train step does on each device: read from its HLO,
    or given by the step itself when it is several programs (the sub-mesh pipeline's)."""
    own = getattr(compiled, "program_cost", None)
    return own() if own is not None else program_cost(compiled.as_text())


class _Walker:
    """Sums instruction costs over the call graph (memoized per computation)."""

    def __init__(self, module: Module):
        self.module = module
        self.types = module.types()
        self.memo: dict[str, dict[str, float]] = {}

    def own(self, inst: Instruction) -> dict[str, float]:
        cost = {"flops": instruction_flops(inst, self.types)}
        found = _collective(inst, self.module.num_partitions)
        if found:
            kind, payload, wire, parts = found
            cost.update({f"{kind}:count": 1, f"{kind}:payload": payload, f"{kind}:wire": wire})
            cost[f"{kind}:arrays"] = parts
            # a permute names pairs, not groups: XLA:CPU's rendezvous takes in every device
            cost[f"{kind}:participants"] = (
                self.module.num_partitions
                if kind == "collective-permute"
                else group_size(inst, self.module.num_partitions)
            )
        return cost

    def cost(self, name: str) -> dict[str, float]:
        if name not in self.memo:
            total: dict[str, float] = {}
            for inst in self.module.computations.get(name, []):
                _add(total, self.own(inst))
                _add(total, self.called(inst))
            self.memo[name] = total
        return self.memo[name]

    def called(self, inst: Instruction) -> dict[str, float]:
        """The cost of what ``inst`` calls: a while body × its trip count, the costliest
        branch of a conditional, a fusion's or call's computation once."""
        total: dict[str, float] = {}
        if inst.opcode == "while":  # the condition holds no collectives or FLOPs
            body = re.search(r"body=%?([\w.\-]+)", inst.attrs)
            trips = trip_count(inst)
            _add(total, self.cost(body.group(1)), trips or 1)
            total["unknown_loops"] = total.get("unknown_loops", 0.0) + (trips is None)
        elif inst.opcode == "conditional":
            for branch in (self.cost(c) for c in callees(inst)):
                for k, v in branch.items():
                    total[k] = max(total.get(k, 0.0), v)
        elif inst.opcode not in REDUCER_OPS and not _collective_kind(inst):
            for callee in callees(inst):
                _add(total, self.cost(callee))
        return total


def program_cost(hlo: str) -> ProgramCost:
    """FLOPs and collectives per device of one execution of ``hlo``.

    While bodies count trip-count times (once, and counted in ``unknown_loops``,
    when XLA recorded no trip count). A conditional counts its costliest branch:
    in one SPMD program every device waits for the slowest, so for a pipeline
    tick that is the step-time view (a bubble costs as much as the busiest tick).
    """
    module = parse(hlo)
    total = _Walker(module).cost(module.entry)
    stats = {
        k: CollectiveStat(
            int(total.get(f"{k}:count", 0)),
            total.get(f"{k}:payload", 0.0),
            total.get(f"{k}:wire", 0.0),
            int(total.get(f"{k}:arrays", 0)),
            int(total.get(f"{k}:participants", 0)),
        )
        for k in COLLECTIVES
    }
    return ProgramCost(total.get("flops", 0.0), stats, int(total.get("unknown_loops", 0)))


def loop_branch_costs(hlo: str, branches: int) -> tuple[int, list[dict[str, float]]] | None:
    """The trip count of the first while loop whose body runs a ``conditional`` of
    ``branches`` branches, and each branch's cost (``flops``, …); None when
    the program has no such loop. A pipeline's tick loop is one: with the schedule, which
    branch each device takes at each tick, it prices the ticks one by one."""
    module = parse(hlo)
    walker = _Walker(module)
    for insts in module.computations.values():
        for inst in insts:
            body = re.search(r"body=%?([\w.\-]+)", inst.attrs) if inst.opcode == "while" else None
            if body is None:
                continue
            for cond in module.computations.get(body.group(1), []):
                if cond.opcode == "conditional" and len(callees(cond)) == branches:
                    return trip_count(inst) or 1, [walker.cost(c) for c in callees(cond)]
    return None


def collective_stats(hlo: str) -> dict[str, CollectiveStat]:
    """Per collective kind: executions per step, payload bytes and wire bytes per device
    (every kind of :data:`COLLECTIVES` is present, zeros when the program has none)."""
    return program_cost(hlo).collectives
