"""Mesh degrees: -1 fills the rest, the product must equal the device count."""

import jax
import pytest
from jax.sharding import AxisType

from jaxpar.config import MeshConfig
from jaxpar.mesh import make_mesh, resolve_degrees, select_devices


def test_fill_and_axis_order():
    mesh = make_mesh(MeshConfig(data=-1, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tensor is innermost: a tensor group is two neighbouring devices
    assert [d.id for d in mesh.devices[0, 0, 0, :]] == [0, 1]


def test_product_must_equal_device_count():
    with pytest.raises(ValueError, match=r"data=2, stage=1, fsdp=2, tensor=1\) multiply to 4 but there are 8 devices"):
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
