"""The HLO text of a compiled program as data: its computations and instructions, the
shapes in a type, the call graph (what an instruction calls, a loop's trip count).

``jax.jit(f).lower(...).compile().as_text()`` prints the optimized HLO module as named
computations. :mod:`jaxpar.hlo` reads the collectives and the program's cost from this,
:mod:`jaxpar.hlo_flops` the FLOPs of one instruction.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

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
REDUCER_OPS = {"reduce", "reduce-window", "scatter", "sort", "select-and-scatter", "map"}
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


def array_bytes(dtype: str, dims: tuple[int, ...]) -> float:
    return _DTYPE_BYTES.get(dtype, 1) * math.prod(dims)


# ---- call graph ------------------------------------------------------------------------------
def callees(inst: Instruction) -> list[str]:
    """The computations ``inst`` calls (a loop's body and condition, a fusion's, a
    conditional's branches…)."""
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
            todo += callees(inst)
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
