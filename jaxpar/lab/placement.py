"""Where a layout's axes sit on a cluster's NVLink domains, as ``mesh.hosts_*`` name it
(:func:`jaxpar.mesh.grid_ranks`; the network model prices it: :mod:`jaxpar.lab.network`).

jaxpar's own order fills each domain innermost first — ``tensor``, ``context``, ``fsdp``,
``stage``, then ``data`` — so ``data`` crosses domains first. Megatron-LM lays its ranks out
with the pipeline outermost instead (``initialize_model_parallel``: tensor groups of
consecutive ranks, the data-parallel ranks of a stage next, pipeline groups strided by
``world/p``), which keeps a stage's gradient all-reduce inside a domain and sends its
activations across: the better of the two where the reduction outweighs the sends (the
SC'21 paper's Figure 14, ``docs/published.md``). A plan for a cluster prices both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jaxpar.axes import Axis

#: jaxpar's own order, innermost first (``make_mesh`` without ``mesh.hosts_*``)
OWN = (Axis.TENSOR, Axis.CONTEXT, Axis.FSDP, Axis.STAGE, Axis.DATA)
#: the pipeline outermost (Megatron-LM's rank order), innermost first
PIPELINE_OUTERMOST = (Axis.TENSOR, Axis.CONTEXT, Axis.FSDP, Axis.DATA, Axis.STAGE)


def across(
    degrees: Mapping[str, int], inner_first: Sequence[str], per_domain: int
) -> dict[str, int] | None:
    """How much of each axis's degree crosses domains when the axes fill domains of
    ``per_domain`` devices innermost first, each keeping what room is left; None where a
    domain would hold part of a group and part of the next (not a product of degrees)."""
    room, crossing = per_domain, {}
    for axis in inner_first:
        degree = degrees.get(axis, 1)
        local = math.gcd(degree, room)
        if local < min(degree, room):
            return None
        room //= local
        crossing[axis] = degree // local
    return crossing


def pipeline_outermost(degrees: Mapping[str, int], per_domain: int) -> list[str]:
    """The ``mesh.hosts_*`` overrides that put the pipeline outermost on domains of
    ``per_domain`` devices; none where jaxpar's own order places the axes the same (or
    either order cannot be named so)."""
    megatron = across(degrees, PIPELINE_OUTERMOST, per_domain)
    own = across(degrees, OWN, per_domain)
    if megatron is None or own is None or megatron == own:
        return []
    return [f"mesh.hosts_{axis.value}={n}" for axis, n in megatron.items() if n > 1]
