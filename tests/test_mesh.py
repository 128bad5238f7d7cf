"""Mesh degrees: -1 fills the rest, the product must equal the device count."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxpar.config import MeshConfig
from jaxpar.mesh import MESH_AXES, make_mesh, resolve_degrees, select_devices


def test_fill_and_axis_order():
    mesh = make_mesh(MeshConfig(data=-1, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tensor is innermost: a tensor group is two neighbouring devices
    assert [d.id for d in mesh.devices[0, 0, 0, 0, :]] == [0, 1]
    # context next: a context group of two is two tensor groups apart
    mesh = make_mesh(MeshConfig(data=-1, context=2, tensor=2))
    assert [d.id for d in mesh.devices[0, 0, 0, :, 0]] == [0, 2]


def test_product_must_equal_device_count():
    with pytest.raises(
        ValueError,
        match=r"data=2, stage=1, fsdp=2, context=1, tensor=1\) multiply to 4 "
        r"but there are 8 devices",
    ):
        resolve_degrees(MeshConfig(data=2, fsdp=2), 8)


def test_one_fill_only_and_divisibility():
    with pytest.raises(ValueError, match="only one mesh degree may be -1"):
        resolve_degrees(MeshConfig(data=-1, fsdp=-1), 8)
    with pytest.raises(ValueError, match="8 is not divisible by 3"):
        resolve_degrees(MeshConfig(fsdp=3), 8)
    with pytest.raises(ValueError, match="mesh.tensor=0"):
        resolve_degrees(MeshConfig(tensor=0), 8)


def test_too_many_devices_requested():
    with pytest.raises(ValueError, match="run.devices=16 but only 8 cpu devices"):
        select_devices(16)
    assert len(select_devices(4)) == 4 and len(select_devices(0)) == jax.device_count()


class _FakeDevice:
    def __init__(self, process_index, id):
        self.process_index, self.id = process_index, id

    def __repr__(self):
        return f"p{self.process_index}d{self.id}"


def _fake_devices(processes, per_process):
    return [
        _FakeDevice(p, p * per_process + i) for p in range(processes) for i in range(per_process)
    ]


def _processes_along(grid, axis):
    """For each position along ``axis``, the set of processes found there."""
    index = MESH_AXES.index(axis)
    return [
        {d.process_index for d in np.take(grid, i, axis=index).ravel()}
        for i in range(grid.shape[index])
    ]


def test_hybrid_grid_puts_only_the_chosen_degrees_across_hosts():
    """4 hosts × 4 devices, data=4 × fsdp=4: by default data crosses hosts (each data slice
    within one host); with hosts_fsdp=4 it is fsdp that crosses them instead."""
    from jaxpar.config import MeshConfig
    from jaxpar.mesh import device_grid, host_degrees

    devices = _fake_devices(4, 4)
    degrees = {"data": 4, "stage": 1, "fsdp": 4, "context": 1, "tensor": 1}
    default = device_grid(devices, degrees, host_degrees(MeshConfig(data=4, fsdp=4), degrees, 4))
    assert _processes_along(default, "data") == [{0}, {1}, {2}, {3}]
    cfg = MeshConfig(data=4, fsdp=4, hosts_fsdp=4)
    hybrid = device_grid(devices, degrees, host_degrees(cfg, degrees, 4))
    assert _processes_along(hybrid, "fsdp") == [{0}, {1}, {2}, {3}]
    assert all(s == {0, 1, 2, 3} for s in _processes_along(hybrid, "data"))
    assert sorted(d.id for d in hybrid.ravel()) == list(range(16))  # each device once
    mixed = MeshConfig(data=4, fsdp=4, hosts_data=2, hosts_fsdp=2)
    grid = device_grid(devices, degrees, host_degrees(mixed, degrees, 4))
    # data index 0,1 on hosts {0,1}; 2,3 on {2,3}: 2 host groups along data, 2 along fsdp
    assert _processes_along(grid, "data") == [{0, 1}, {0, 1}, {2, 3}, {2, 3}]
    assert _processes_along(grid, "fsdp") == [{0, 2}, {0, 2}, {1, 3}, {1, 3}]


def test_host_degrees_errors():
    from jaxpar.config import MeshConfig
    from jaxpar.mesh import host_degrees

    degrees = {"data": 4, "stage": 1, "fsdp": 2, "tensor": 1}
    with pytest.raises(ValueError, match="multiply to 2 but the run has 4 processes"):
        host_degrees(MeshConfig(hosts_data=2), degrees, 4)
    with pytest.raises(ValueError, match="mesh.hosts_fsdp=4 does not divide mesh.fsdp=2"):
        host_degrees(MeshConfig(hosts_fsdp=4), degrees, 4)
    with pytest.warns(UserWarning, match="no effect in a single-process run"):
        assert host_degrees(MeshConfig(hosts_data=2), degrees, 1) is None


def test_each_process_loads_the_rows_its_devices_hold():
    """A process's share of the batch rows is where its devices sit along the batch axes:
    processes split along ``data`` load different halves, along ``stage`` (or ``tensor``)
    the same rows; a placement whose process holds rows that are not one consecutive
    share, or entries split over different axes, is refused in one line."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from jaxpar.errors import LayoutError
    from jaxpar.mesh import grid_ranks
    from jaxpar.plan.checks import row_share

    def shares(hosts, specs=None, **degrees):
        sizes = {a: degrees.get(a, 1) for a in MESH_AXES}
        mesh = AbstractMesh(tuple(sizes.values()), MESH_AXES)
        count = int(np.prod(list(hosts.values())))
        grid = grid_ranks(sizes, hosts) // (mesh.size // count)
        specs = specs or {"tokens": P(("data", "fsdp"), None)}
        return [row_share(mesh, specs, grid, p) for p in range(count)]

    assert shares({"data": 2}, data=2, stage=2, tensor=2) == [(0, 2), (1, 2)]
    assert shares({"stage": 2}, data=2, stage=2, tensor=2) == [(0, 1), (0, 1)]
    assert shares({"tensor": 2}, data=2, stage=2, tensor=2) == [(0, 1), (0, 1)]
    assert shares({"data": 2, "stage": 2}, data=2, stage=2) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert shares({"data": 2, "fsdp": 2}, data=2, fsdp=4) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    with pytest.raises(LayoutError, match="not one consecutive share.*mesh.hosts_fsdp above 1"):
        shares({"fsdp": 2}, data=2, fsdp=4)
    # the batch on (fsdp, data): fsdp is the outer axis, which the hosts must cross first
    fsdp_first = {"tokens": P(("fsdp", "data"), None)}
    assert shares({"fsdp": 2}, fsdp_first, data=2, fsdp=4) == [(0, 2), (1, 2)]
    with pytest.raises(LayoutError, match="cross fsdp, the outer batch axis, first"):
        shares({"data": 2}, fsdp_first, data=2, fsdp=4)
    # by default (devices in process order) data=3 × tensor=2 on 2 processes of 3: their
    # rows overlap (blocks 0, 1 and 1, 2); the batch axes must divide among them
    sizes = {a: {"data": 3, "tensor": 2}.get(a, 1) for a in MESH_AXES}
    mesh = AbstractMesh(tuple(sizes.values()), MESH_AXES)
    with pytest.raises(
        LayoutError,
        match=r"make data \(3\) a multiple of the 2 processes, or "
        r"let only axes that do not split the rows cross the hosts "
        r"\(mesh.hosts_tensor\)",
    ):
        row_share(mesh, {"tokens": P("data")}, grid_ranks(sizes) // 3, 0)
    # stage=2 × fsdp=3 on 3 processes of 2: fsdp divides among them and can cross alone
    sizes = {a: {"stage": 2, "fsdp": 3}.get(a, 1) for a in MESH_AXES}
    mesh = AbstractMesh(tuple(sizes.values()), MESH_AXES)
    with pytest.raises(LayoutError, match=r"put fsdp across the hosts \(mesh.hosts_fsdp=3\)"):
        row_share(mesh, {"tokens": P(("data", "fsdp"))}, grid_ranks(sizes) // 2, 0)
    hosts = {a: {"fsdp": 3}.get(a, 1) for a in MESH_AXES}
    assert row_share(mesh, {"tokens": P(("data", "fsdp"))}, grid_ranks(sizes, hosts) // 2, 2) == (
        2,
        3,
    )
    two = {"tokens": P("data", None), "labels": P(None)}
    with pytest.raises(LayoutError, match="entries tokens, labels are split over different"):
        shares({"data": 2}, two, data=2, stage=2)


def test_the_sub_mesh_executor_needs_each_place_of_every_stage_in_one_process():
    """The sub-mesh executor moves each shard to the device at the same place of the next
    stage: 3 processes of 4 devices over data=2 × stage=2 × tensor=3 (devices in process
    order) give every stage devices of all three, but not place by place — refused in one
    line; stage=2 within processes (data across them) runs."""
    from jax.sharding import AbstractMesh

    from jaxpar.errors import LayoutError
    from jaxpar.mesh import grid_ranks
    from jaxpar.plan.checks import check_stages_in_every_process

    def grid(**degrees):
        sizes = {a: degrees.get(a, 1) for a in MESH_AXES}
        return AbstractMesh(tuple(sizes.values()), MESH_AXES), grid_ranks(sizes)

    mesh, ranks = grid(data=2, stage=2, tensor=3)
    with pytest.raises(LayoutError, match="pipeline.executor=mpmd moves each process's own"):
        check_stages_in_every_process(mesh, ranks // 4)
    mesh, ranks = grid(data=2, stage=2, tensor=2)
    check_stages_in_every_process(mesh, ranks // 4)  # each process a data index
