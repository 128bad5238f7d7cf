"""Shared test helpers: run a few steps of a config on a given number of devices."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.launch import force_device_count
from jaxpar.run import build
from tests.conftest import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]


#: a child's environment entry: Python lists each module it imports on stderr
LIST_IMPORTS = {"PYTHONPROFILEIMPORTTIME": "1"}


def imports_and_lines(stderr: str) -> tuple[list[str], list[str]]:
    """A child's stderr under :data:`LIST_IMPORTS`: the modules it imported, and its other
    lines (of the stripped text)."""
    lines = stderr.strip().splitlines()
    listed = [line for line in lines if line.startswith("import time:")]
    other = [line for line in lines if not line.startswith("import time:")]
    return [line.rsplit("|", 1)[-1].strip() for line in listed], other


def child_env(devices: int | None = 8, test_flags: bool = True) -> dict[str, str]:
    """A subprocess's environment: this process's compiler flags (``tests/conftest.py``'s
    compile-for-speed flags, so that a child compiles as fast as the tests do; without
    ``test_flags`` the compiler's defaults, for a child that mostly computes) with
    ``devices`` simulated CPU devices, or none forced (``None``: jaxpar or ``jaxpar
    launch`` choose, as in a fresh shell); the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    if not test_flags:
        env["XLA_FLAGS"] = " ".join(
            f for f in env.get("XLA_FLAGS", "").split() if f not in TEST_XLA_FLAGS
        )
    force_device_count(env, devices)
    env["PYTHONPATH"] = str(ROOT)
    return env


GPT_SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.batch_size=16",
    "optim.warmup_steps=0",
]
CONVNET_SMALL = [
    "model.name=convnet",
    "model.channels=4",
    "model.hidden=8",
    "data.image_size=8",
    "data.num_examples=256",
    "train.batch_size=16",
    "optim.warmup_steps=0",
]


def run_steps(overrides: list[str], steps: int = 3, devices: int = 8):
    """Losses of each step and the final params (as numpy) for a config."""
    cfg = load_config([], [*overrides, f"train.steps={steps}", f"run.devices={devices}"])
    run = build(cfg)
    state = run.trainer.init()
    run.init_params = jax.tree.map(np.asarray, state.params)
    losses = []
    for step in range(steps):
        batch = run.trainer.shard_batch(run.data.batch(step, cfg.train.batch_size))
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), run


def grid(params: list, default: set, heavy: set = frozenset()) -> list:
    """``pytest.param``s of a layout grid: those whose id is in ``default`` run in every
    suite; those in ``heavy`` are a claim of their own that costs too much for the suite's
    quarter hour (marked ``heavy``: CI runs them right after the suite, under the same
    interpreter); the others repeat a mechanism those already cover and are marked
    ``exhaustive`` (``pytest -m exhaustive`` runs them; CI runs them last)."""
    import pytest

    unknown = (set(default) | set(heavy)) - {p.id for p in params}
    assert not unknown, f"grid: no case has the id(s) {sorted(unknown)}"
    assert not set(default) & set(heavy), "grid: a case is in the suite or heavy, not both"

    def mark(p):
        if p.id in default:
            return p
        tier = pytest.mark.heavy if p.id in heavy else pytest.mark.exhaustive
        return pytest.param(*p.values, id=p.id, marks=(*p.marks, tier))

    return [mark(p) for p in params]


@functools.cache
def _one_device_steps(overrides: tuple[str, ...], steps: int) -> tuple:
    return run_steps([*overrides, "mesh.data=1"], steps=steps, devices=1)


def one_device_steps(overrides: list[str], steps: int = 3):
    """:func:`run_steps` of ``overrides`` on one device, run once per test process: the
    reference that many layouts of a test are compared with (the arrays are the cached
    ones: do not change them)."""
    return _one_device_steps(tuple(overrides), steps)


def measured_once():
    """A :func:`jaxpar.lab.measure.measure` (its signature, untimed and for the built-in
    model) that lowers and compiles each (config, layout, platform, host size) once and
    reads that program again for a later call: for another profile of the same platform
    and host size, or another ``memory_bytes`` (which only judges ``fits``). What a test
    reads is what ``measure`` reads; the program is compiled once."""
    from jaxpar.lab.measure import Row, compile_lowered, lower, read

    compiled = {}

    def measure(config, layout, hw, steps=0, memory_bytes=None, task=None):
        assert steps == 0 and task is None  # untimed, the built-in model: one program
        key = (id(config), layout, hw.platform, hw.devices_per_host)
        if key not in compiled:
            lowered = lower(config, layout, hw)
            if isinstance(lowered, Row):  # a layout that cannot run: its row, as measure's
                return lowered
            compiled[key] = (lowered, *compile_lowered(lowered))
        lowered, program, seconds = compiled[key]
        fresh = dataclasses.replace(lowered, row=Row(layout, hardware=hw.key))
        return read(fresh, program, seconds, hw, memory_bytes)

    return measure


def assert_params_close(actual, expected, elementwise: bool = True, rtol: float = 1e-5):
    """Parameters agree to f32 summation-order noise.

    ``elementwise``: every element within rtol 1e-5 (atol 1e-6) — right for
    SGD, whose update is linear in the gradient. For Adam-family optimizers
    use the per-tensor relative error ||a − b|| / ||b|| ≤ rtol: Adam divides
    each gradient element by its own magnitude, so an element whose gradient
    is ~0 turns a 1e-7 summation difference into a much larger update
    difference while the tensor as a whole still agrees closely.
    """
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        name = jax.tree_util.keystr(path)
        if elementwise:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-6, err_msg=name)
        else:
            rel = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
            assert rel <= rtol, f"{name}: relative error {rel:.2e} > {rtol:.0e}"


def decode_stepwise(model, tokens, prompt: int):
    """A model's logits of ``tokens`` through its KV cache: the first ``prompt`` tokens in one
    call, then one token a call (``model.decode``), concatenated."""
    import jax.numpy as jnp

    decode = jax.jit(model.decode)
    logits, cache = decode(tokens[:, :prompt], model.init_cache(tokens.shape[0]), jnp.int32(0))
    rows = [logits]
    for i in range(prompt, tokens.shape[1]):
        logits, cache = decode(tokens[:, i : i + 1], cache, jnp.int32(i))
        rows.append(logits)
    return jnp.concatenate(rows, 1)


def train_bpe(
    texts: list[str], path: Path, vocab_size: int = 300, special_tokens: tuple[str, ...] = ()
) -> Path:
    """A byte-level BPE tokenizer trained here on ``texts`` (nothing downloaded), saved
    to ``path``; needs ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


@contextlib.contextmanager
def small_file_system(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"64k"``, ``"1m"``) mounted at the new folder ``path``, a
    disk that really fills up; skips the test where mounting one needs root it lacks."""
    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        ).returncode
    ):
        pytest.skip(
            "needs root and mount for a small file system (the simulated full disks run everywhere)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, check=False)


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """Kill (and reap) each process still running: a test's children never outlive it."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finished(proc: subprocess.Popen, name: str, timeout: float) -> tuple[str, str]:
    """``proc``'s stdout and stderr once it ends; the test fails (the process killed) if
    it runs past ``timeout`` seconds."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{name}: still running after {timeout:g} s")
    return out, err


class Child:
    """A started child process, reaped by a thread as it ends, so that its time to its
    answer is that of its own end, not of when its test (after others) looks. ``first``:
    what that thread does before (reading stdout up to a line, say)."""

    def __init__(self, proc: subprocess.Popen, first=None):
        self.proc, self.start = proc, time.time()
        self.out, self.err, self.end = "", "", None
        self._first = first
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        if self._first is not None:
            self._first(self.proc)
        self.out, self.err = self.proc.communicate()
        self.end = time.time()

    def ended(self, name: str, timeout: float) -> tuple[str, str, float]:
        """stdout, stderr and the seconds from start to end; the test fails (the process
        killed) if it runs past ``timeout`` seconds from its start."""
        self._reaper.join(max(0.0, self.start + timeout - time.time()))
        if self.end is None:
            kill_all([self.proc])
            pytest.fail(f"{name}: still running after {timeout:g} s")
        return self.out, self.err, self.end - self.start
