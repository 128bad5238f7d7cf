"""Reading a compiled program's HLO text: which collectives run, and where.

``jax.jit(f).lower(...).compile().as_text()`` prints the optimized HLO module
as named computations. A collective inside a ``while`` body (a ``lax.scan``)
runs once per iteration; the same op outside runs once per step. These helpers
tell the two apart, so tests and reports can check, e.g., that gradients are
reduced once per step and not once per microbatch.
"""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation"
    r"|called_computations)=\{?(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name → its instruction lines."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if current is None:
            match = _HEADER.match(line.strip()) if not line.startswith(" ") else None
            if match:
                current = match.group(1)
                comps[current] = []
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps


def _callees(line: str) -> list[str]:
    names = []
    for group in _CALLEE.findall(line):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def loop_computations(hlo: str) -> set[str]:
    """Names of every computation that runs inside a ``while`` loop (bodies and callees)."""
    comps = computations(hlo)
    inside: set[str] = set()
    todo = [m.group(1) for lines in comps.values() for line in lines
            for m in re.finditer(r"body=%?([\w.\-]+)", line)]
    while todo:
        name = todo.pop()
        if name in inside or name not in comps:
            continue
        inside.add(name)
        for line in comps[name]:
            todo += _callees(line)
    return inside


def count_ops(hlo: str, op: str, in_loops: bool | None = None) -> int:
    """How many ``op`` instructions (``-start`` forms included) the module has.

    Args:
      hlo: the compiled module's text.
      op: an HLO opcode such as ``all-reduce``.
      in_loops: True: only inside while loops; False: only outside; None: all.
    """
    loops = loop_computations(hlo)
    pattern = re.compile(rf"\s{re.escape(op)}(?:-start)?\(")
    total = 0
    for name, lines in computations(hlo).items():
        if in_loops is not None and (name in loops) != in_loops:
            continue
        total += sum(1 for line in lines if pattern.search(line))
    return total
