"""Test setup: 8 simulated CPU devices, set before JAX starts its backend."""

import os
import shutil
import tempfile

# LLVM optimization level 0 halves XLA:CPU compile time, which dominates the suite; every
# comparison is between programs compiled with the same flags.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

# One persistent compilation cache for the whole run: the pytest process sets it, and the
# xdist workers and every `jaxpar` subprocess a test starts inherit it, so the same program
# (a resumed run, a layout trained again by another test) compiles once. A cached
# executable is the one XLA compiled, so no comparison changes. A cache directory the user
# set is used as it is and kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.path.join(tempfile.gettempdir(),
                              f"jaxpar-test-compile-cache-{os.getpid()}")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# A size limit makes JAX read and write entries under a file lock (filelock): without it a
# process could read an entry another is still writing, and warn on stderr.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 2**30))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


def pytest_sessionfinish(session):
    """The pytest process (not an xdist worker) removes the cache directory it made."""
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
