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

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLEE = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation"
    r"|called_computations)=\{?(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?"
)
_CALLS = ("body=", "condition=", "to_apply=", "calls=", "computation")
# Ops whose called computation is a scalar reducer such as %add.
_REDUCER_OPS = {"reduce", "reduce-window", "scatter", "sort", "select-and-scatter", "map"}
_BRACKETS = re.compile(r"[(){}\[\]]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``name = type opcode(operands), attrs``."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


@dataclass(frozen=True)
class Module:
    """A parsed HLO module: computations, which one is the entry, the device count."""

    computations: dict[str, list[Instruction]]
    entry: str
    num_partitions: int

    def types(self) -> dict[str, str]:
        """Instruction name → result type, over the whole module (names are unique)."""
        return {i.name: i.type for insts in self.computations.values() for i in insts}


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


# ---- parsing ---------------------------------------------------------------------------------
def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group that opens at ``text[start]``."""
    depth = 0
    for bracket in _BRACKETS.finditer(text, start):  # the regex skips the rest in C
        depth += 1 if bracket.group() in "({[" else -1
        if depth == 0:
            return bracket.end()
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    """An instruction line → :class:`Instruction` (None for anything else)."""
    text = line.strip()
    text = text.removeprefix("ROOT ")
    head = re.match(r"%?([\w.\-]+)\s*=\s*", text)
    if not head:
        return None
    rest = text[head.end() :]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end <= 0:
        return None
    typ, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = tuple(_NAME.findall(rest[op.end() : close - 1]))
    return Instruction(head.group(1), typ, op.group(1), operands, rest[close:])


@functools.lru_cache(maxsize=2)  # the lab reads one program's text several ways
def parse(hlo: str) -> Module:
    """The module's computations, entry name and partition count."""
    comps: dict[str, list[Instruction]] = {}
    entry = ""
    current = None
    for line in hlo.splitlines():
        if current is None:
            match = _HEADER.match(line.strip()) if not line.startswith(" ") else None
            if match and not line.startswith("HloModule"):
                current = match.group(2)
                comps[current] = []
                if match.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            inst = parse_instruction(line)
            if inst is not None:
                comps[current].append(inst)
    parts = re.search(r"num_partitions=(\d+)", hlo.split("\n", 1)[0])
    return Module(comps, entry, int(parts.group(1)) if parts else 1)


# ---- shapes ----------------------------------------------------------------------------------
def arrays(typ: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of every array in a type such as ``(f32[4,8]{1,0}, s32[])``."""
    out = []
    for dtype, dims in _ARRAY.findall(typ):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is not None:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _array_bytes(dtype: str, dims: tuple[int, ...]) -> float:
    return _DTYPE_BYTES.get(dtype, 1) * math.prod(dims)


# ---- call graph ------------------------------------------------------------------------------
def _callees(inst: Instruction) -> list[str]:
    if not any(key in inst.attrs for key in _CALLS):
        return []  # most instructions call nothing: skip the regex (a program has thousands)
    names = []
    for group in _CALLEE.findall(inst.attrs):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def trip_count(inst: Instruction) -> int | None:
    """A while loop's trip count as XLA recorded it (None when unknown)."""
    match = _TRIP.search(inst.attrs)
    return int(match.group(1)) if match else None


def loop_computations(hlo: str) -> set[str]:
    """Names of every computation that runs inside a ``while`` loop (bodies and callees)."""
    module = parse(hlo)
    inside: set[str] = set()
    todo = [
        m.group(1)
        for insts in module.computations.values()
        for inst in insts
        if inst.opcode == "while"
        for m in re.finditer(r"body=%?([\w.\-]+)", inst.attrs)
    ]
    while todo:
        name = todo.pop()
        if name in inside or name not in module.computations:
            continue
        inside.add(name)
        for inst in module.computations[name]:
            todo += _callees(inst)
    return inside


def count_ops(hlo: str, op: str, in_loops: bool | None = None) -> int:
    """How many ``op`` instructions (``-start`` forms included) the module has.

    Args:
      hlo: the compiled module's text.
      op: an HLO opcode such as ``all-reduce``.
      in_loops: True: only inside while loops; False: only outside; None: all.
    """
    loops = loop_computations(hlo)
    total = 0
    for name, insts in parse(hlo).computations.items():
        if in_loops is not None and (name in loops) != in_loops:
            continue
        total += sum(1 for inst in insts if inst.opcode in (op, f"{op}-start"))
    return total


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
    result = sum(_array_bytes(*a) for a in parts)
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", inst.attrs)
        n_pairs = len(re.findall(r"\{\d+,\d+", pairs.group(0))) if pairs else 0
        return kind, result, result * n_pairs / max(num_partitions, 1), len(parts)
    n = group_size(inst, num_partitions)
    payload = result * n if kind == "reduce-scatter" else result
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return kind, payload, payload * factor, len(parts)


# ---- FLOPs ----------------------------------------------------------------------------------
def _dims(attrs: str, key: str) -> list[int]:
    match = re.search(rf"{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


#: a GPU program's matrix products that XLA hands to a library as a custom call (cuBLAS,
#: cuBLASLt, FP8 included): the first result is the product, the first two operands its
#: factors, and the backend config names the contracting dimensions as a dot would
_GEMM_TARGETS = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


#: cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``): the
#: matrix products of one pass over its [B, N, T, S] scores, each 2·B·N·T·S·D FLOPs (D the
#: head dim) as the full product counts them — a causal kernel skips the masked tiles. The
#: forward's two (scores, weighted values); the backward's five, FlashAttention-2's: the
#: scores again, then the gradients of the probabilities, values, queries and keys.
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')
_FMHA_PRODUCTS = {"forward": 2, "backward": 5}
_SCORES = re.compile(r'"intermediate_tensor_shape":\{"dimensions":\[([^\]]*)\]')


def _fused_attention_flops(inst: Instruction, types: dict[str, str]) -> float:
    """FLOPs of a cuDNN fused-attention call: the scores' [B, N, T, S] from its backend
    config, the head dim from its first operand (the queries, [B, T, N, D])."""
    scores = _SCORES.search(inst.attrs)
    queries = arrays(types.get(inst.operands[0], "")) if inst.operands else []
    if not scores or not queries:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", scores.group(1))]
    head_dim = math.prod(queries[0][1]) / math.prod(dims[:-1])
    which = "backward" if "Backward" in _FMHA.search(inst.attrs).group() else "forward"
    return 2.0 * _FMHA_PRODUCTS[which] * math.prod(dims) * head_dim


def _contracting(inst: Instruction) -> list[int]:
    """A dot's (``lhs_contracting_dims={…}``) or a library gemm's contracting dims."""
    if inst.opcode == "dot":
        return _dims(inst.attrs, "lhs_contracting_dims")
    found = _GEMM_CONTRACT.search(inst.attrs)
    return [int(d) for d in re.findall(r"\d+", found.group(1))] if found else []


def _flops(inst: Instruction, types: dict[str, str]) -> float:
    """2 × multiply-adds of a dot, a library gemm (a GPU's cuBLAS custom call), cuDNN's
    fused attention or a convolution (0 for anything else)."""
    gemm = inst.opcode == "custom-call" and _GEMM_TARGETS.search(inst.attrs)
    if inst.opcode == "custom-call" and _FMHA.search(inst.attrs):
        return _fused_attention_flops(inst, types)
    if inst.opcode not in ("dot", "convolution") and not gemm:
        return 0.0
    out = arrays(inst.type)
    if not out or len(inst.operands) < 2:
        return 0.0
    out_elems = math.prod(out[0][1])
    lhs, rhs = (arrays(types.get(o, "")) for o in inst.operands[:2])
    if inst.opcode != "convolution":
        lhs_dims = lhs[0][1] if lhs else ()
        contract = math.prod(lhs_dims[d] for d in _contracting(inst))
        return 2.0 * out_elems * contract
    kernel = rhs[0][1] if rhs else ()
    labels = re.search(r"dim_labels=\w+_(\w+)->", inst.attrs)
    out_features = kernel[labels.group(1).index("o")] if labels and kernel else 1
    # An input gradient of a strided convolution reads its output gradient with zeros
    # inserted (lhs_dilate=s): of each window only 1/s per dim is data, as a GPU's
    # backward-data kernel computes it.
    dilate = re.search(r"lhs_dilate=([\dx]+)", inst.attrs)
    zeros = math.prod(int(d) for d in dilate.group(1).split("x")) if dilate else 1
    return 2.0 * out_elems * math.prod(kernel) / max(out_features, 1) / zeros


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
        cost = {"flops": _flops(inst, self.types)}
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
            for branch in (self.cost(c) for c in _callees(inst)):
                for k, v in branch.items():
                    total[k] = max(total.get(k, 0.0), v)
        elif inst.opcode not in _REDUCER_OPS and not _collective_kind(inst):
            for callee in _callees(inst):
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
                if cond.opcode == "conditional" and len(_callees(cond)) == branches:
                    return trip_count(inst) or 1, [walker.cost(c) for c in _callees(cond)]
    return None


def collective_stats(hlo: str) -> dict[str, CollectiveStat]:
    """Per collective kind: executions per step, payload bytes and wire bytes per device
    (every kind of :data:`COLLECTIVES` is present, zeros when the program has none)."""
    return program_cost(hlo).collectives
