"""``jaxpar plan --longest``: the longest sequence each layout fits, doubling the
config's ``data.seq_len`` and compiling each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxpar.config import Config
from jaxpar.lab.chart import fmt_value
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Row, measure
from jaxpar.task import Task


@dataclass
class Longest:
    """The longest sequence one layout fits (doubling from the config's ``data.seq_len``):
    ``row`` measured at ``tokens``; ``beyond``: the row of twice as many (too big or
    invalid), None when the search stopped at its limit."""

    layout: str
    tokens: int = 0
    row: Row | None = None
    beyond: Row | None = None


def longest_sequence(
    config: Config,
    layout: str,
    hw: Hardware,
    memory: float,
    task: Task | None = None,
    limit: int = 2**20,
) -> Longest:
    """The longest ``data.seq_len`` (the config's, doubled while it fits, up to ``limit``)
    with which ``layout`` fits in ``memory`` per device; ``model.max_seq_len`` follows it
    where the model has that key."""
    found = Longest(layout)
    tokens = config.data.seq_len
    stretch = "max_seq_len" in {f.name for f in dataclasses.fields(config.model)}
    while tokens <= limit:
        longer = f"{layout},data.seq_len={tokens}" + (
            f",model.max_seq_len={tokens}" if stretch else ""
        )
        row = measure(config, longer, hw, memory_bytes=memory, task=task)
        if not row.ok or not row.fits:
            found.beyond = row
            break
        found.tokens = tokens
        found.row = row
        tokens *= 2
    return found


def format_longest(found: list[Longest], memory: float) -> str:
    """One line per layout: the longest sequence that fits and what twice as long needs."""
    lines = []
    for f in found:
        fits = (
            f"{f.tokens:,} tokens fit ({fmt_value(f.row.mem_total_bytes, 'B')})"
            if f.row
            else "nothing fits"
        )
        b = f.beyond
        after = (
            ""
            if b is None
            else f"; {'twice as many' if f.row else 'the first'} "
            + (
                f"cannot run: {b.error}"
                if not b.ok
                else f"needs {fmt_value(b.mem_total_bytes, 'B')}"
            )
        )
        lines.append(f"{f.layout}: {fits}{after}")
    lines.append(
        f"memory judged against {memory / 1e9:.3g} GB ({fmt_value(memory, 'B')}) per device"
    )
    return "\n".join(lines)
