"""The network as it is: which of a step's collectives leave an NVLink domain, and what
they cost there.

A profile's chips sit in NVLink domains of :attr:`~jaxpar.lab.hardware.Hardware.
domain_devices` chips (8 on an HGX board, 72 in a GB200 NVL72 rack); between domains each
chip sends through its own NIC at :attr:`~jaxpar.lab.hardware.Hardware.network_rate` (its
bandwidth at the share NCCL reaches).
The mesh's devices fill the domains in process order, as :func:`jaxpar.mesh.make_mesh`
lays them out (:func:`jaxpar.mesh.grid_ranks`): by default row-major over (data, stage,
fsdp, context, tensor), outermost first, so ``tensor`` stays inside a domain longest and
``data`` leaves it first; with ``mesh.hosts_*``, the degrees they name cross hosts and the
rest stay within one, a host's devices in one domain (an 8-GPU node is both; the 4-GPU
hosts of a GB200 rack fill its domain in order). Megatron-LM lays its ranks out with the
pipeline outermost (``initialize_model_parallel``: tensor groups of consecutive ranks,
data-parallel groups strided by ``t`` within a stage's block, pipeline groups strided by
``world/p``): where a host is a whole domain (an 8-GPU server), ``mesh.hosts_stage`` (and
``hosts_data``) say so; hosts are numbered ``data`` first, so on smaller hosts they cannot.

A collective over the axes its :class:`~jaxpar.lab.terms.Term` names falls, group by
group, on ``m`` domains with ``k`` of its members in each (:func:`placements`). Inside one
domain (``m = 1``) it is the ring of :attr:`Term.wire_bytes` at ``B`` (today's roofline);
across domains NCCL runs it hierarchically, and one device sends, for a payload ``S``::

    all-reduce       2(k−1)/k·S / B  +  2(m−1)/(m·k)·S / N
                     (reduce-scatter inside the domain, all-reduce of the 1/k shard across
                     domains — k rings at once, one per GPU's NIC —, all-gather inside)
    all-gather,      (k−1)/k·S / B  +  (m−1)/(m·k)·S / N
    reduce-scatter   (the same two phases, once)
    send (permute)   S / N             (the ring's sends that cross set its pace)
    all-to-all       max((k−1)/n·S / B, (n−k)/n·S / N),  n = k·m
                     (the share for other domains leaves through the NIC)

with ``B`` = :attr:`~jaxpar.lab.hardware.Hardware.link_rate` and ``N`` =
:attr:`~jaxpar.lab.hardware.Hardware.network_rate` (each the wire's figure × the profile's
efficiency for it). A group whose domains hold unequal numbers of its members is costed
at its sparsest domain (the largest share per NIC), and the step at its slowest group.
Every collective pays ``collective_latency``; one that crosses pays ``network_latency``
more per level of NCCL's tree across the ``m`` domains (⌈log2 m⌉; a send: one).

Sources: NCCL's own cost model (NVIDIA/nccl, ``src/graph/tuning.cc``: an inter-node ring
all-reduce spends ``2(nNodes−1)`` of its ``2(nRanks−1)`` steps on the network, a tree
``2·log2(nNodes)`` network hops) and its rings and trees built one per NIC; the
hierarchical all-reduce (reduce-scatter, inter-node all-reduce, all-gather) of Jia et al.,
"Highly Scalable Deep Learning Training System with Mixed-Precision" (2018); and
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), whose first takeaway keeps tensor parallelism within a server
because its all-reduces across servers run over the slower inter-server links.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpar.axes import MESH_AXES
from jaxpar.lab.hardware import (
    UNKNOWN_KERNELS,
    Hardware,
    Kernels,
    StepTime,
    compute_time,
    memory_time,
)
from jaxpar.lab.terms import Term
from jaxpar.mesh import grid_ranks, host_degrees
from jaxpar.plan.checks import check_stages_in_every_process, row_share
from jaxpar.run import Run


@dataclass(frozen=True)
class Placement:
    """Where one group of a collective lies: ``members`` of it (``k``, the fewest in any)
    in each of the ``domains`` (``m``) it spans."""

    members: int
    domains: int


def placements(
    axes: Sequence[str],
    sizes: Mapping[str, int],
    domain_devices: int,
    ranks: np.ndarray | None = None,
) -> frozenset[Placement]:
    """The distinct placements of the groups of a collective over ``axes`` on a mesh of
    ``sizes`` (mesh axis order, outermost first) whose devices fill domains of
    ``domain_devices`` in order (0: one domain holds them all); ``ranks``: each place's
    device in that order (:func:`jaxpar.mesh.grid_ranks`; None: row-major)."""
    names = list(sizes)
    assert set(axes) <= set(names), (axes, names)
    spanned = sorted({names.index(a) for a in axes})
    n = math.prod(sizes[names[i]] for i in spanned)
    total = math.prod(sizes.values())
    if not domain_devices or total <= domain_devices or n == 1:
        return frozenset({Placement(n, 1)})
    shape = [sizes[a] for a in names]
    index = np.arange(total).reshape(shape) if ranks is None else ranks.reshape(shape)
    rest = [i for i in range(len(names)) if i not in spanned]
    domains = index.transpose(rest + spanned).reshape(-1, n) // domain_devices
    found = set()
    for row in np.unique(domains - domains[:, :1], axis=0):  # each group's domains, relative
        _, counts = np.unique(row, return_counts=True)
        found.add(Placement(int(counts.min()), len(counts)))
    return frozenset(found)


@functools.lru_cache(maxsize=4096)
def _placements(
    axes: frozenset[str],
    sizes: tuple[tuple[str, int], ...],
    domain_devices: int,
    hosts: tuple[tuple[str, int], ...] | None,
) -> frozenset[Placement]:
    """:func:`placements` on the grid ``hosts`` lays out (None: row-major), once per
    arguments (a plan prices the same groups on many layouts)."""
    degrees = dict(sizes)
    ranks = None if hosts is None else grid_ranks(degrees, dict(hosts))
    return placements(sorted(axes), degrees, domain_devices, ranks)


def _bytes(term: Term, where: Placement, hw: Hardware, scale: float) -> tuple[float, float]:
    """(NVLink bytes, network bytes) one device sends for all of ``term``'s executions."""
    k, m = where.members, where.domains
    if m == 1:
        return scale * term.wire_bytes, 0.0
    size = scale * term.payload_bytes * term.times
    if term.kind == "collective-permute":
        return 0.0, size
    if term.kind == "all-to-all":
        n = k * m
        inside, across = size * (k - 1) / n, size * (n - k) / n
        if across / hw.network_rate >= inside / hw.link_rate:
            return 0.0, across
        return inside, 0.0
    phases = 2 if term.kind == "all-reduce" else 1
    return phases * size * (k - 1) / k, phases * size * (m - 1) / (m * k)


def _levels(term: Term, where: Placement) -> int:
    """Levels of NCCL's tree across domains one execution of ``term`` climbs."""
    if where.domains == 1:
        return 0
    return 1 if term.kind == "collective-permute" else math.ceil(math.log2(where.domains))


def _seconds(sent: Sequence[float], nvlink: float, nic: float) -> float:
    """The time of (NVLink bytes, network bytes); a profile of one domain has no network
    (``nic`` 0), and nothing crosses it."""
    return sent[0] / nvlink + (sent[1] / nic if sent[1] else 0.0)


def step_time(
    hw: Hardware,
    flops: float,
    traffic_bytes: float,
    terms: Sequence[Term],
    sizes: Mapping[str, int],
    dtype: str,
    *,
    calls: int | None = None,
    scale: float = 1.0,
    kernels: Kernels = UNKNOWN_KERNELS,
    state_bytes: float = 0.0,
    hosts: Mapping[str, int] | None = None,
) -> StepTime:
    """The roofline of one step on ``hw`` with each collective placed on its NVLink domains
    and the network (the module docstring); equal to :func:`~jaxpar.lab.hardware.roofline`
    of the same bytes where every group stays inside a domain.

    Args:
      hw: the profile.
      flops, traffic_bytes, dtype: per device, as :func:`~jaxpar.lab.hardware.roofline`.
      terms: the step's collectives (GPU form); hidden ones count in ``hidden_s``.
      sizes: the mesh's degrees in mesh axis order, outermost first.
      calls: the collectives the step executes (the compiled program's count, hidden ones
        left out), replacing the terms' count; their latency is priced at the terms' mix
        of crossing and staying.
      scale: multiplies every term's bytes (measured over predicted).
      kernels: the matmuls' shapes' efficiency and the other kernels' bytes.
      state_bytes: the state's part of ``traffic_bytes`` (its arguments and outputs).
      hosts: how many of each axis's degree cross hosts (``mesh.hosts_*``:
        :func:`jaxpar.mesh.host_degrees`); None: the outermost axes do.
    """
    nvlink, nic = hw.link_rate, hw.network_rate
    placed = None
    if hosts is not None:  # the grid in mesh axis order, as grid_ranks lays it out
        sizes = {a: sizes.get(a, 1) for a in MESH_AXES}
        placed = tuple(sorted(hosts.items()))
    known: dict[frozenset, frozenset[Placement]] = {}
    exposed, hidden = [0.0, 0.0], [0.0, 0.0]
    count = levels = 0
    for term in terms:
        key = frozenset(term.axes)
        if key not in known:
            known[key] = _placements(key, tuple(sizes.items()), hw.domain_devices, placed)
        options = [_bytes(term, p, hw, scale) for p in known[key]]
        inside, across = max(options, key=lambda b: _seconds(b, nvlink, nic))
        into = hidden if term.hidden else exposed
        into[0] += inside
        into[1] += across
        if not term.hidden:
            count += term.times
            levels += term.times * max(_levels(term, p) for p in known[key])
    calls = count if calls is None else calls
    crossing = levels / count if count else 0.0
    return StepTime(
        compute_s=compute_time(hw, flops, dtype, kernels),
        memory_s=memory_time(hw, traffic_bytes, state_bytes),
        comm_s=_seconds(exposed, nvlink, nic),
        latency_s=calls * (hw.collective_latency + hw.network_latency * crossing),
        hidden_s=_seconds(hidden, nvlink, nic),
        overhead_s=hw.step_overhead,
        elementwise_s=kernels.elementwise_bytes / hw.hbm_bandwidth,
    )


def hosts_of(
    run: Run, hw: Hardware, processes: bool = True, sub_mesh: bool | None = None
) -> dict[str, int] | None:
    """How many of each axis's degree the run's ``mesh.hosts_*`` put across hosts of
    ``hw`` (one process a host of :attr:`~jaxpar.lab.hardware.Hardware.devices_per_host`
    GPUs), for a plan of devices that may not be here; None: the default placement, or
    devices of one host (nothing crosses, as one process ignores them). ``processes``: and
    each process's devices hold one share of the batch rows, as a multi-process run checks
    (and with ``sub_mesh``, None: the plan's executor, that no stage crosses the hosts).

    Raises:
      LayoutError: host degrees that do not divide their axes or multiply to the hosts;
        with ``processes``, processes whose devices do not hold one share of the rows, or
        (the sub-mesh executor) stages that cross hosts.
    """
    per_host = hw.devices_per_host
    devices = run.plan.mesh.size
    sizes = dict(run.plan.mesh.shape)
    if per_host and devices > per_host and devices % per_host:  # not whole hosts
        return host_degrees(run.config.mesh, sizes, None)
    if not per_host or devices <= per_host:
        return None
    hosts = host_degrees(run.config.mesh, sizes, devices // per_host)
    if processes:
        grid = grid_ranks(sizes, hosts) // per_host
        row_share(run.plan.mesh, run.plan.batch_specs, grid)
        if run.plan.executor == "mpmd" if sub_mesh is None else sub_mesh:
            check_stages_in_every_process(run.plan.mesh, grid)
    return hosts
