"""XLA's warnings while a step compiles, explained in one jaxpar line each.

XLA's SPMD partitioner warns from native code, on file descriptor 2, when it cannot move a
tensor from one sharding to another but by gathering all of it first ("[SPMD] Involuntary
full rematerialization … for HLO operation %x = f32[8,16,64] …"): a long line naming an
HLO value and tile assignments, no parameter and no fix. :func:`explained` captures what
native code writes to fd 2 while a block runs (the first step: its compilation) and writes
it back afterwards, each such warning replaced by one ``jaxpar: warning:`` line that says
what is gathered and what avoids it (:func:`describe`); everything else is written back as it
came. ``JAXPAR_DEBUG=1`` leaves fd 2 alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping

#: XLA's warning: the tile assignments it moves between and the HLO value's type.
_REMAT = re.compile(
    r"Involuntary full rematerialization.*?from sharding (\{.*?\}) to "
    r"(\{.*?\}).*?for HLO operation %\S+ = (\w+\[[\d,]*\])"
)
_TILES = re.compile(r"devices=\[([\d,]+)\]")


def splits(sharding: str, rank: int) -> tuple[int, ...]:
    """How many ways each of a value's ``rank`` dims is split by an HLO sharding (``{devices=
    [4,1,1,2]<=[8] last_tile_dim_replicate}`` of a rank-3 value: (4, 1, 1)); ``{replicated}``
    splits nothing."""
    match = _TILES.search(sharding)
    if match is None:
        return (1,) * rank
    return tuple(int(n) for n in match.group(1).split(","))[:rank]


def parse(line: str) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(the value's type, e.g. ``f32[8,16,64]``, its splits before, after) of an
    involuntary-rematerialization warning, or None for any other line."""
    match = _REMAT.search(line)
    if match is None:
        return None
    typ = match.group(3)
    rank = typ.count(",") + 1 if "[]" not in typ else 0
    return typ, splits(match.group(1), rank), splits(match.group(2), rank)


def describe(
    typ: str, before: tuple[int, ...], after: tuple[int, ...], named: Mapping[tuple[int, ...], str]
) -> str:
    """What the warning means and what avoids it; ``named``: the paths of the parameters by
    shape (a value of a parameter's shape is named as that parameter)."""
    shape = tuple(int(d) for d in typ[typ.index("[") + 1 : -1].split(",") if d)
    moved = f"its dims split {'×'.join(map(str, before))} → {'×'.join(map(str, after))}"
    gathered = (
        f"XLA gathers all of {{}} {typ} to change its sharding ({moved}): an "
        "involuntary full rematerialization, every device briefly holding it whole; "
    )
    if shape in named:
        return (
            gathered.format(f"parameter '{named[shape]}'") + "give its dims logical "
            "names whose rules split it as the activations it meets are split"
        )
    return (
        gathered.format("an activation") + "if it is an embedding lookup's, look the "
        'tokens up with jaxpar.tensor_parallel.lookup(table, tokens, ("vocab", '
        "\"embed\")), as jaxpar's models do (with the names the table's dims carry); else "
        "pin the activation's layout where the model makes it (jaxpar.constrain) or change "
        "the rule that splits its dims"
    )


@contextlib.contextmanager
def explained(named: Mapping[tuple[int, ...], str]) -> Iterator[None]:
    """Runs the block with fd 2 captured, then writes the capture back with each
    involuntary-rematerialization warning replaced by one ``jaxpar: warning:`` line
    (:func:`describe`; each different line once)."""
    if os.environ.get("JAXPAR_DEBUG", "") not in ("", "0"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            _write_back(capture.read().decode(errors="replace"), named)


def _write_back(text: str, named: Mapping[tuple[int, ...], str]) -> None:
    out = []
    said = set()
    for line in text.splitlines(keepends=True):
        found = parse(line)
        if found is None:
            out.append(line)
            continue
        note = f"jaxpar: warning: {describe(*found, named)}\n"
        if note not in said:
            said.add(note)
            out.append(note)
    if out:
        sys.stderr.write("".join(out))
        sys.stderr.flush()
