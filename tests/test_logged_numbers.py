"""The numbers a run logs and the warnings it prints: step times measured over the step
they describe, "has no effect" only for keys that have none, the device count a script
set kept."""

import dataclasses
import statistics
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.config import load_config
from jaxpar.run import build
from tests.helpers import GPT_SMALL, child_env

WIDTH = 256


class _Tower(nnx.Module):
    """The same matmuls every step (a fixed device time per step)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (WIDTH, WIDTH)) / WIDTH**0.5)

    def __call__(self, x):
        return jax.lax.fori_loop(0, 40, lambda _, h: jnp.tanh(h @ self.w), x)


def _loss(model, batch):
    return optax.l2_loss(model(batch["x"])).mean(), {}


def _data(step, batch):
    return {"x": np.random.default_rng(step).normal(size=(batch, WIDTH)).astype(np.float32)}


def test_the_last_step_time_is_measured_over_its_step(tmp_path):
    """The last row once came ~1000× too fast: the checkpoint after the last step waited
    for the step and that wait was left out of the step's time as checkpoint time."""
    task = jaxpar.Task(
        _Tower,
        _loss,
        {"x": ("batch", None)},
        data=_data,
        name="tower",
        path_rules=(("w", (None, None)),),
    )
    config = load_config(
        [],
        [
            "train.steps=6",
            "train.log_every=1",
            "train.batch_size=64",
            "run.devices=1",
            "optim.warmup_steps=0",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    rows = jaxpar.train(config, task=task, echo=False).train_rows
    assert [r["step"] for r in rows] == list(range(1, 7))
    typical = statistics.median(r["step_time_s"] for r in rows[1:-1])  # the first compiles
    last = rows[-1]
    # a loaded machine only slows a step down: a wider bound above
    assert typical / 4 < last["step_time_s"] < typical * 10, (last, typical)
    assert last["examples_per_s"] == 64 / last["step_time_s"]


def _no_effect(config, task) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(config, task)
    return [str(w.message) for w in caught if "has no effect" in str(w.message)]


def test_a_family_task_with_its_own_data_warns_only_of_keys_without_effect():
    """``task_for`` + ``dataclasses.replace(task, data=…)``: the model and sizing keys
    built the task (once ~15 false warnings); ``data.eval_fraction`` truly has no effect."""
    config = load_config([], [*GPT_SMALL, "train.steps=2", "run.devices=1"])

    def data(step, batch):
        ids = np.random.default_rng(step).integers(0, 256, (batch, 17), dtype=np.int32)
        return {"tokens": ids}

    task = dataclasses.replace(jaxpar.task_for(config), data=data)
    assert _no_effect(config, task) == []
    held_out = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_fraction=0.2))
    found = _no_effect(held_out, task)
    assert len(found) == 1 and "'data.eval_fraction'" in found[0], found


SCRIPT = textwrap.dedent("""
    import jax, numpy as np, optax, jaxpar
    from flax import nnx
    from jaxpar.config import load_config
    jaxpar.setup_devices(8)
    class Line(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(np.zeros((4,), np.float32))
        def __call__(self, x):
            return x @ self.w
    task = jaxpar.Task(Line, lambda m, b: (optax.l2_loss(m(b["x"])).mean(), {}),
                       {"x": ("batch", None)}, data=lambda s, n: {"x": np.ones((n, 4), "f4")})
    config = load_config([], ["train.steps=1", "run.devices=1", "optim.warmup_steps=0",
                              "run.dir=" + __import__("sys").argv[1]])
    jaxpar.train(config, task=task, echo=False)
    print("devices", jax.device_count())
""")


def test_train_with_fewer_devices_keeps_the_count_a_script_set(tmp_path):
    """``setup_devices(8)`` then ``train(run.devices=1)`` once left the process one device,
    so the script's later layouts failed asking for ``setup_devices``."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")],
        env=child_env(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["devices", "8"]
