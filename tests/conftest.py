"""Test setup: 8 simulated CPU devices, set before JAX starts its backend."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

# Compiling dominates the suite (XLA:CPU, one core per test process), so the tests compile
# for speed: LLVM optimization level 0 halves it, and XLA's older elemental fusion code
# generator, where this jaxlib still has it (the 0.10 line, not 0.12), halves it again
# (`python benchmarks/compile_flags.py`: a pipelined GPT train step 8.4 → 4.7 s, BERT
# fsdp=8 7.5 → 3.5 s). Every comparison is between programs compiled with the same flags;
# the tests' subprocesses inherit them.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib accepts ``flag`` (an unknown XLA flag aborts the process)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
    )
    return probe.returncode == 0


# The pytest process probes once; its xdist workers inherit the flags.
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    extra = [_FAST_COMPILE] + ([_OLD_EMITTERS] if _xla_knows(_OLD_EMITTERS) else [])
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()
TEST_XLA_FLAGS = (_FAST_COMPILE, _OLD_EMITTERS)  # what a child that mostly computes drops
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# XLA:CPU runs the simulated devices' kernels and collectives on one intra-op thread pool,
# as many threads as cores unless NPROC says otherwise. With 8 devices on 2 cores (and the
# older emitters, which split kernels over that pool), every pool thread can end up waiting
# in a collective for a device whose work is queued behind them, and XLA aborts the process
# after 40 s ("Termination timeout for `all reduce RendezvousKey…`"). Measured under JAX
# 0.10.2: 300 steps of BERT at fsdp=2, context=4 deadlocked in 6 of 6 runs by default and 3
# of 3 with NPROC=8, none in 6 with NPROC=16 or 32; compile times are unchanged. The tests'
# subprocesses inherit it.
os.environ.setdefault("NPROC", "32")

# One persistent compilation cache for the whole run: the pytest process sets it, and the
# xdist workers and every `jaxpar` subprocess a test starts inherit it, so the same program
# (a resumed run, a layout trained again by another test) compiles once. A cached
# executable is the one XLA compiled, so no comparison changes. A cache directory the user
# set is used as it is and kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.path.join(tempfile.gettempdir(), f"jaxpar-test-compile-cache-{os.getpid()}")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
# Only programs that took half a second or more to compile are written: a train step, not
# the op-by-op programs of eager code. With a size limit JAX lists the whole directory and
# reads every entry's access time on each write (`jax._src.lru_cache.LRUCache.put`), so
# writing every tiny program made each write slower than the last: with 6,000 entries
# present, `tests/test_ulysses.py`'s eager reference took 23 s where it takes 2.4 s.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
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


#: What `pytest` leaves out: the suite's ``heavy`` cases (CI runs them right after the
#: suite) and the extended tier (CI runs it last), `.ci/run`.
EXTENDED = ("heavy", "exhaustive", "multiprocess")


#: The suite's longest files, longest first (test time per file, from `pytest --durations=0`
#: on 2026-12-01, less the cases marked heavy that evening: 73 s for test_checkpoint.py down
#: to 30 s for test_pack_families.py; the rest take less), handed to the xdist workers
#: before the others so that neither starts a long file while the other has little left
#: (files go to the workers whole, `--dist loadfile`, in this order: `--no-loadscope-reorder`
#: keeps xdist from ordering them by test count).
LONGEST_FIRST = (
    "test_checkpoint.py",
    "test_train.py",
    "test_analytic.py",
    "test_pipeline.py",
    "test_context.py",
    "test_cli.py",
    "test_families.py",
    "test_sequence_parallel.py",
    "test_signals.py",
    "test_moe.py",
    "test_lab.py",
    "test_faults.py",
    "test_config.py",
    "test_fp8.py",
    "test_trackers.py",
    "test_look.py",
    "test_user_task.py",
    "test_offload.py",
    "test_ulysses.py",
    "test_gpt_dropout.py",
    "test_sample.py",
    "test_sizes.py",
    "test_pack_families.py",
)


#: CI's time budget (`.ci/run` sets it for the stages after the 3.11 suite): a clock time,
#: seconds since the epoch, after which a test not yet started is skipped with this reason,
#: so that the run ends inside CI's limit and says what it left out, rather than being cut
#: off, landing nothing. `pytest` by hand leaves it unset: every test runs.
DEADLINE = "JAXPAR_TEST_DEADLINE"
_deadline = pytest.StashKey[float | None]()
ROTATE = "JAXPAR_TEST_ROTATE"
_rotation = pytest.StashKey[int]()
PAST_DEADLINE = f"CI's time budget ran out before this test started ({DEADLINE}, .ci/run)"


def pytest_configure(config):
    """Reads the deadline and the rotation once, refusing a bad value in one line."""
    value = os.environ.get(DEADLINE)
    try:
        config.stash[_deadline] = float(value) if value else None
    except ValueError:
        raise pytest.UsageError(
            f"{DEADLINE}={value!r} is not a clock time: give seconds since the epoch "
            "(`date +%s`), or unset it to run every test"
        ) from None
    value = os.environ.get(ROTATE, "0")
    if not value.isdigit():
        raise pytest.UsageError(
            f"{ROTATE}={value!r} is not a whole number of files: give one (0 leaves the order "
            "as it is) or unset it"
        )
    config.stash[_rotation] = int(value)


def pytest_runtest_setup(item):
    deadline = item.config.stash[_deadline]
    if deadline is not None and time.time() > deadline:
        pytest.skip(PAST_DEADLINE)


def pytest_collection_modifyitems(config, items):
    """The suite (`pytest`) leaves out the ``heavy`` cases (claims of their own that cost
    too much for its quarter hour) and the extended tier — the tests marked ``exhaustive``
    (further layouts of a grid whose mechanism its other cases cover) and ``multiprocess``
    (real multi-process launches) — unless a ``-m`` expression chooses (``pytest -m heavy``,
    ``pytest -m "exhaustive or multiprocess"``) or tests are named by node id."""
    chosen = config.getoption("markexpr") or any("::" in arg for arg in config.args)
    left = [item for item in items if not chosen and any(m in item.keywords for m in EXTENDED)]
    if left:
        config.hook.pytest_deselected(items=left)
        out = set(map(id, left))
        items[:] = [item for item in items if id(item) not in out]
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable, so files stay whole; in the extended tier the files with real multi-process
    # launches go first, the last a CI budget would skip (`.ci/run`)
    launching = {item.path for item in items if "multiprocess" in item.keywords}
    items.sort(key=lambda item: (item.path not in launching, first.get(item.path.name, len(first))))
    _rotate(items, launching, config.stash[_rotation])


def _rotate(items, launching, by: int) -> None:
    """Starts the files after the launching ones ``by`` files further on, the ones before
    going last: under CI's budget a slow machine then skips a different tail for each
    commit, not the same files every time (``.ci/run`` sets ``JAXPAR_TEST_ROTATE``)."""
    rest = [item for item in items if item.path not in launching]
    files = list(dict.fromkeys(item.path for item in rest))
    if not by or len(files) < 2:
        return
    start = {path: (i - by) % len(files) for i, path in enumerate(files)}
    items[len(items) - len(rest) :] = sorted(rest, key=lambda item: start[item.path])
