"""Devices and the device mesh.

Axis types: jaxpar builds meshes with ``AxisType.Auto`` on purpose. Parameter,
optimizer-state and batch layouts are fixed by the rules table through the
step's ``in_shardings``/``out_shardings`` and a few activation constraints;
XLA's SPMD partitioner propagates everything in between. ``Explicit`` axes
would make sharding part of every array's type, so each contraction in a model
would need an ``out_sharding`` naming mesh axes, which ties the model code to a
layout. With Auto axes the model names logical axes only and a layout change
stays a config change. The numerical-equivalence tests guard the result.
"""

from __future__ import annotations

import math
import os
import warnings

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh
from pydantic import Field

from jaxpar.axes import MESH_AXES, Axis
from jaxpar.environ import FORCE_DEVICES_FLAG
from jaxpar.errors import ConfigError, LayoutError
from jaxpar.limits import MAX_CPU_DEVICES, MAX_DEVICES
from jaxpar.schema import section

DEFAULT_CPU_DEVICES = 8

_DEGREE = "parallel degree over mesh axis {}; one degree may be -1: it fills the rest"
_HOSTS = "how much of mesh.{}'s degree runs across hosts (0 for every axis: the default)"


@section("mesh")
class MeshConfig:
    """Parallel degrees per mesh axis. One of them may be -1: it fills the rest.

    ``hosts_<axis>``: with several processes (hosts), how many of an axis's degree run
    across hosts — the slow network — while the rest stays within a host. 0 for every
    axis (default) lets the outermost axes cross hosts (``data`` first: data parallelism
    needs the least bandwidth). Otherwise they must multiply to the process count and each
    divide its axis. Each process loads the batch rows its devices hold: processes that
    differ along ``stage``, ``context`` or ``tensor`` load the same rows (the sub-mesh
    executor, ``pipeline.executor=mpmd``, keeps its stages within hosts).
    """

    data: int = Field(-1, le=MAX_DEVICES, description=_DEGREE.format(Axis.DATA))
    fsdp: int = Field(1, le=MAX_DEVICES, description=_DEGREE.format(Axis.FSDP))
    tensor: int = Field(1, le=MAX_DEVICES, description=_DEGREE.format(Axis.TENSOR))
    stage: int = Field(
        1, le=MAX_DEVICES, description=_DEGREE.format(Axis.STAGE) + " (pipeline stages)"
    )
    context: int = Field(
        1,
        le=MAX_DEVICES,
        description=_DEGREE.format(Axis.CONTEXT) + " (each sequence split over it)",
    )
    hosts_data: int = Field(0, ge=0, le=MAX_DEVICES, description=_HOSTS.format(Axis.DATA))
    hosts_stage: int = Field(0, ge=0, le=MAX_DEVICES, description=_HOSTS.format(Axis.STAGE))
    hosts_fsdp: int = Field(0, ge=0, le=MAX_DEVICES, description=_HOSTS.format(Axis.FSDP))
    hosts_context: int = Field(0, ge=0, le=MAX_DEVICES, description=_HOSTS.format(Axis.CONTEXT))
    hosts_tensor: int = Field(0, ge=0, le=MAX_DEVICES, description=_HOSTS.format(Axis.TENSOR))


def setup_devices(count: int = 0) -> None:
    """Chooses the simulated CPU device count before JAX starts its backend.

    A ``count`` above :data:`MAX_CPU_DEVICES` is for an accelerator only: the CPU backend
    keeps its default, and without an accelerator it is refused at once (never tried).

    With no device count set by the user (``XLA_FLAGS=--xla_force_host_platform_
    device_count=N`` or ``JAX_NUM_CPU_DEVICES``), the CPU backend gets ``count``
    simulated devices, 8 when ``count`` is 0, so every layout is real on a
    laptop. When the user did set one, it stands and ``count`` (at most that
    many) selects the first devices. On an accelerator this only affects the
    unused CPU backend; the mesh then takes the first ``count`` accelerators.

    Raises:
      ConfigError: when JAX has already started with too few devices, ``count``
        exceeds the user's own setting, or there is no accelerator and ``count``
        exceeds :data:`MAX_CPU_DEVICES`.
    """
    flag = FORCE_DEVICES_FLAG.search(os.environ.get("XLA_FLAGS", ""))
    env = os.environ.get("JAX_NUM_CPU_DEVICES")
    user_count = int(flag.group(1)) if flag else (int(env) if env else 0)
    if user_count:  # the user chose a device count: respect it; --devices takes a subset
        if count > user_count:
            raise ConfigError(
                f"--devices {count} asks for more than the {user_count} CPU devices set by "
                "XLA_FLAGS/JAX_NUM_CPU_DEVICES; lower --devices or raise that setting"
            )
        return
    if count > MAX_CPU_DEVICES:  # only an accelerator has that many: see MAX_CPU_DEVICES
        if jax.default_backend() == "cpu":
            raise ConfigError(
                f"run.devices={count} (--devices): without an accelerator jaxpar simulates at "
                f"most {MAX_CPU_DEVICES:,} CPU devices (each costs host memory and start-up "
                f"time); set --devices (or run.devices) to at most {MAX_CPU_DEVICES:,}"
            )
        return
    wanted = count or DEFAULT_CPU_DEVICES
    try:
        jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError as err:  # the backend is already running
        if jax.device_count("cpu") < wanted:
            raise ConfigError(
                f"JAX started before jaxpar could set {wanted} CPU devices "
                f"(it has {jax.device_count('cpu')}); call jaxpar.setup_devices() before "
                "any JAX computation, or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{wanted}"
            ) from err


def select_devices(count: int = 0) -> list[jax.Device]:
    """The first ``count`` devices of the default backend (all when 0)."""
    devices = jax.devices()
    if count and count > len(devices):
        raise ConfigError(
            f"run.devices={count} but only {len(devices)} {devices[0].platform} devices exist; "
            f"set run.devices (or --devices) to at most {len(devices)}"
        )
    return devices[:count] if count else devices


def describe_devices(devices: list[jax.Device]) -> str:
    """One line saying what a run is using, e.g. '8 simulated CPU devices'."""
    platform = devices[0].platform
    if platform == "cpu":
        return f"{len(devices)} simulated CPU devices (no accelerator; set --devices N to change)"
    return f"{len(devices)} × {devices[0].device_kind} ({platform})"


def resolve_degrees(cfg: MeshConfig, device_count: int) -> dict[str, int]:
    """Mesh degrees with the single -1 filled in, checked against the devices.

    Raises:
      LayoutError: on a bad degree, more than one -1, or a product that is not
        the device count; the message lists the degrees and the device count.
    """
    degrees = {axis: getattr(cfg, axis) for axis in MESH_AXES}
    shown = ", ".join(f"{k}={v}" for k, v in degrees.items())
    fill = [axis for axis, d in degrees.items() if d == -1]
    bad = [axis for axis, d in degrees.items() if d == 0 or d < -1]
    if bad:
        raise LayoutError(
            f"mesh degree mesh.{bad[0]}={degrees[bad[0]]} must be ≥ 1 or -1 ({shown})"
        )
    if len(fill) > 1:
        raise LayoutError(f"only one mesh degree may be -1, got {fill} ({shown})")
    fixed = math.prod(d for d in degrees.values() if d != -1)
    if fill:
        if device_count % fixed:
            raise LayoutError(
                f"mesh degrees ({shown}) cannot fill {device_count} devices: {device_count} "
                f"is not divisible by {fixed}; choose degrees whose product divides it"
            )
        degrees[fill[0]] = device_count // fixed
    elif fixed != device_count:
        raise LayoutError(
            f"mesh degrees ({shown}) multiply to {fixed} but there are {device_count} devices; "
            "make the product equal the device count or set one degree to -1"
        )
    return degrees


def host_degrees(
    cfg: MeshConfig, degrees: dict[str, int], hosts: int | None
) -> dict[str, int] | None:
    """How many of each axis's degree cross hosts (``mesh.hosts_*``), or None for the
    default (devices in process order, outer axes across hosts). ``hosts``: the process
    count, or None for a plan of devices that are not here (its hosts are what the
    degrees multiply to).

    Raises:
      LayoutError: when the host degrees do not multiply to the process count or one does
        not divide its axis.
    """
    chosen = {axis: getattr(cfg, f"hosts_{axis}") for axis in MESH_AXES}
    if not any(chosen.values()):
        return None
    if hosts == 1:  # the same config runs in one process: nothing crosses hosts
        warnings.warn("mesh.hosts_* have no effect in a single-process run", stacklevel=3)
        return None
    chosen = {axis: d or 1 for axis, d in chosen.items()}
    shown = ", ".join(f"mesh.hosts_{a}={d}" for a, d in chosen.items())
    if hosts is not None and math.prod(chosen.values()) != hosts:
        raise LayoutError(
            f"host degrees ({shown}) multiply to {math.prod(chosen.values())} but "
            f"the run has {hosts} processes; make their product {hosts}"
        )
    for axis, d in chosen.items():
        if degrees[axis] % d:
            raise LayoutError(
                f"mesh.hosts_{axis}={d} does not divide mesh.{axis}={degrees[axis]}; pick a "
                "divisor of it, or let another axis cross the hosts (mesh.hosts_<axis>)"
            )
    return chosen


def grid_ranks(degrees: dict[str, int], hosts: dict[str, int] | None = None) -> np.ndarray:
    """Each place of the (data, stage, fsdp, context, tensor) grid as the rank of its
    device in process order (what :func:`device_grid` puts there).

    Without ``hosts``: row-major, so the outermost axes change process first. With
    ``hosts`` (a hybrid mesh): axis ``a`` is ``hosts[a]`` groups of processes × the rest
    within each process, so only the named degrees cross the slow network.
    """
    shape = tuple(degrees[a] for a in MESH_AXES)
    ranks = np.arange(math.prod(shape))
    if hosts is None:
        return ranks.reshape(shape)
    outer = tuple(hosts.get(a, 1) for a in MESH_AXES)
    inner = tuple(degrees[a] // hosts.get(a, 1) for a in MESH_AXES)
    n = len(MESH_AXES)  # interleave (host part, local part) per axis, host part major
    grid = ranks.reshape(outer + inner)
    grid = grid.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
    return grid.reshape(shape)


def device_grid(
    devices: list, degrees: dict[str, int], hosts: dict[str, int] | None = None
) -> np.ndarray:
    """The devices laid out as the (data, stage, fsdp, context, tensor) grid
    (:func:`grid_ranks`): in the given order, or with ``hosts`` by process."""
    if hosts is not None:
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.asarray(devices, dtype=object)[grid_ranks(degrees, hosts)]


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` over ``devices`` with axes (data, stage, fsdp, context, tensor), all Auto.

    Axis order follows how often and how much each axis communicates. ``tensor`` is
    innermost, so tensor-parallel groups are neighbouring devices (the fastest links on a
    GPU host): it all-reduces activations around every matmul. ``context`` comes next: it
    gathers (or passes round) each layer's keys and values, activation-sized traffic once
    per layer, on the critical path of attention. ``fsdp`` gathers weights a layer ahead
    (XLA overlaps them with compute), ``stage`` sends one activation per microbatch, and
    ``data`` all-reduces gradients once a step: it is outermost, the axis that crosses
    hosts — unless ``mesh.hosts_*`` choose which degrees cross hosts (:func:`device_grid`).
    """
    devices = list(devices if devices is not None else jax.devices())
    degrees = resolve_degrees(cfg, len(devices))
    processes = len({d.process_index for d in devices})
    grid = device_grid(devices, degrees, host_degrees(cfg, degrees, processes))
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def abstract_mesh(cfg: MeshConfig, count: int) -> AbstractMesh:
    """The mesh of ``count`` devices that are not here (a plan for a cluster): the axes
    and degrees :func:`make_mesh` would give, no devices. Nothing compiles or runs on it;
    plans, shardings and the lab's terms are computed from it."""
    degrees = resolve_degrees(cfg, count)
    sizes = tuple(degrees[a] for a in MESH_AXES)
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh) -> str:
    """e.g. 'mesh data=2 stage=1 fsdp=2 context=1 tensor=2'."""
    return "mesh " + " ".join(f"{k}={v}" for k, v in mesh.shape.items())
