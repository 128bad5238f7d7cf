"""Test setup: 8 simulated CPU devices, set before JAX starts its backend."""

import os

# LLVM optimization level 0 halves XLA:CPU compile time, which dominates the suite; every
# comparison is between programs compiled with the same flags.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, "tests need 8 simulated CPU devices"
