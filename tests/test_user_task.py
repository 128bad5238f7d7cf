"""A user's Task through the whole loop: ``jaxpar train --task`` and ``jaxpar.train``, its
own data (a function, a grain dataset), SIGTERM and exact resume (BatchNorm statistics and
RNG counts included), restore onto another layout, hooks, and one-line errors."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grain
import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.run import build
from jaxpar.user_code import load_task
from tests.helpers import child_env
from tests.test_research import host

ROOT = Path(__file__).resolve().parents[1]
SPEC = "examples/research_cnn.py:TASK"
TASK = load_task(SPEC)
# the example's schedule has a fixed horizon (200 steps), so a short run is the start of a
# long one
SHORT = [
    "train.batch_size=16",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.every_steps=5",
]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows(run_dir) if "loss" in r]


def task_process(run_dir: Path, steps: int) -> subprocess.Popen:
    """`python -m jaxpar train --task` started in a fresh process (8 simulated devices)."""
    cmd = [
        sys.executable,
        "-m",
        "jaxpar",
        "train",
        "--task",
        SPEC,
        *SHORT,
        f"train.steps={steps}",
        f"run.dir={run_dir}",
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def task_here(run_dir: Path, steps: int) -> None:
    """The same run as :func:`task_process`, in this process (its compiler flags and 8
    devices: the same floats, bit for bit), without a new interpreter's start-up."""
    args = ["train", "--task", SPEC, *SHORT, f"train.steps={steps}", f"run.dir={run_dir}"]
    assert main(args) == 0


def final_state(run_dir: Path, layout=("mesh.data=8",)):
    run = build(load_config([], [*SHORT, *layout]), TASK)
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    state, meta = ckpt.restore()
    ckpt.close()
    return run, state, meta


def test_sigterm_then_resume_is_bitwise_identical_and_restores_onto_another_layout(
    tmp_path, monkeypatch
):
    """`jaxpar train --task`: SIGTERM → exit 4 with a checkpoint of the current step →
    resume gives the uninterrupted run's losses and final state bit for bit (parameters,
    optimizer state, BatchNorm statistics, RNG key and count); that state restores onto
    data=2×fsdp=2×tensor=2 with identical values. (The signalled run is a real process;
    the resume, which has only the files that process left, and the uninterrupted run run
    in this process.)"""
    monkeypatch.chdir(ROOT)  # SPEC is relative to the repository, as for the children
    stopped = tmp_path / "stopped"
    proc = task_process(stopped, 100000)
    deadline = time.time() + 120
    while time.time() < deadline and not (
        (stopped / "metrics.jsonl").exists() and len(losses(stopped)) >= 3
    ):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    step = int(err.split("checkpoint of step ")[1].split()[0])
    task_here(stopped, step + 4)  # resume=auto
    straight = tmp_path / "straight"
    task_here(straight, step + 4)
    assert losses(stopped) == losses(straight)
    assert [s for s, _ in losses(stopped)] == list(range(1, step + 5))
    run, resumed, meta = final_state(stopped)
    _, uninterrupted, _ = final_state(straight)
    assert meta["step"] == step + 4 and meta["data"]["batches_consumed"] == step + 4
    assert int(resumed.model_state["drop"]["rngs"]["count"]) == step + 4
    for a, b in zip(jax.tree.leaves(host(resumed)), jax.tree.leaves(host(uninterrupted))):
        np.testing.assert_array_equal(a, b)
    other, moved, _ = final_state(straight, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    for a, b in zip(jax.tree.leaves(host(moved)), jax.tree.leaves(host(uninterrupted))):
        np.testing.assert_array_equal(a, b)
    kernel = moved.params["hidden"]["kernel"]
    assert kernel.sharding == other.plan.state_shardings.params["hidden"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


class Recorder(jaxpar.Hook):
    """Records every event it sees."""

    def __init__(self):
        self.steps, self.evals, self.saves, self.started, self.ended = [], [], [], 0, 0

    def on_start(self, ctx):
        self.started += 1

    def on_step(self, ctx, step, metrics):
        assert isinstance(metrics["loss"], float) and metrics["finite"] is True
        self.steps.append(step)

    def on_eval(self, ctx, step, metrics):
        self.evals.append((step, sorted(metrics)))

    def on_save(self, ctx, step):
        self.saves.append(step)

    def on_end(self, ctx):
        self.ended += 1


class StopAt(jaxpar.Hook):
    """Sends this process a SIGTERM when it sees ``step``'s metrics (a preemption)."""

    def __init__(self, step):
        self.step = step

    def on_step(self, ctx, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _config(run_dir, steps, *extra):
    return load_config(
        [],
        [
            *SHORT,
            "train.eval_every=4",
            "train.eval_batches=2",
            f"train.steps={steps}",
            f"run.dir={run_dir}",
            *extra,
        ],
    )


def test_hooks_see_every_step_exactly_once_across_a_preemption_and_resume(tmp_path):
    first, second = Recorder(), Recorder()
    with pytest.raises(jaxpar.loop.Preempted) as stop:
        jaxpar.train(_config(tmp_path, 12), task=TASK, hooks=[first, StopAt(5)], echo=False)
    # step 5's metrics arrive before its checkpoint (its row is written first, so that its
    # time is its own); the loop checks for a preemption after each dispatch, so the next
    # check, after step 6, stops the run
    stopped_at = stop.value.step
    assert stopped_at == 6
    assert first.steps == list(range(1, stopped_at + 1))
    assert first.saves == [5, 6] and first.started == first.ended == 1
    assert first.evals == [(4, ["eval_accuracy", "eval_loss", "eval_time_s"])]
    history = jaxpar.train(_config(tmp_path, 12), task=TASK, hooks=[second], echo=False)
    assert second.steps == list(range(stopped_at + 1, 13))
    assert first.steps + second.steps == list(range(1, 13))
    assert [s for s, _ in second.evals] == [8, 12] and second.saves == [10, 12]
    assert [r["step"] for r in history.train_rows] == list(range(stopped_at + 1, 13))
    logged = [r["step"] for r in rows(tmp_path) if "loss" in r]
    assert logged == list(range(1, 13))  # metrics.jsonl: each step once


def test_a_script_under_as_command_ends_as_the_command_does(tmp_path, capsys):
    """``jaxpar.cli.as_command`` around a script's ``jaxpar.train``: a SIGTERM ends it with
    the command's one line and status 4 (a traceback and 1 without it), bad input with 2."""
    from jaxpar.cli import as_command

    with pytest.raises(SystemExit) as end, as_command():
        jaxpar.train(_config(tmp_path, 12), task=TASK, hooks=[StopAt(2)], echo=False)
    err = capsys.readouterr().err.strip()
    assert end.value.code == 4 and "\n" not in err
    assert re.match(r"jaxpar: preempted \(SIGTERM\): checkpoint of step \d+ written to ", err)
    with pytest.raises(SystemExit) as end, as_command():
        load_config([], ["train.setps=3"])
    err = capsys.readouterr().err.strip()
    assert end.value.code == 2 and err.startswith("jaxpar: error: ") and "train.steps" in err


def test_hooks_named_in_config(tmp_path):
    """`train.hooks=[file.py:Name]` (as on the command line): built with no arguments and
    called with every step."""
    (tmp_path / "myhooks.py").write_text(
        "import jaxpar\n"
        "class Log(jaxpar.Hook):\n"
        "    def on_step(self, ctx, step, metrics):\n"
        f"        line = f'{{step}} {{metrics[\"loss\"]}}\\n'\n"
        f"        open({str(tmp_path / 'seen.txt')!r}, 'a').write(line)\n"
    )
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--task",
                SPEC,
                *SHORT,
                "train.steps=3",
                f"run.dir={run_dir}",
                f"train.hooks=[{tmp_path / 'myhooks.py'}:Log]",
            ]
        )
        == 0
    )
    seen = [line.split() for line in (tmp_path / "seen.txt").read_text().splitlines()]
    assert [int(s) for s, _ in seen] == [1, 2, 3]
    assert [float(v) for _, v in seen] == [loss for _, loss in losses(run_dir)]


#: examples in the grain tests' dataset: an epoch is 4 steps of 16
EXAMPLES = 64


def _examples():
    """The example's first :data:`EXAMPLES` training examples, one dict per example."""
    b = TASK.data(0, EXAMPLES)
    return [{k: v[i] for k, v in b.items()} for i in range(EXAMPLES)]


@pytest.mark.parametrize("kind", ["map", "iter"])
def test_grain_dataset_task_resumes_exactly(tmp_path, kind):
    """A Task whose data is a grain dataset (random-access MapDataset: shuffled per epoch,
    resumed by position; IterDataset: resumed from grain's iterator state): 6 steps, stop,
    4 more = 10 straight, stopped inside the second epoch and going on across the next
    epoch boundary (64 examples, 16 a step)."""
    source = grain.MapDataset.source(_examples())
    data = source if kind == "map" else source.repeat().to_iter_dataset()
    task = dataclasses.replace(TASK, data=data, eval_data=None)
    extra = ["checkpoint.every_steps=4"]
    jaxpar.train(_config(tmp_path / "a", 6, *extra), task=task, echo=False)
    jaxpar.train(_config(tmp_path / "a", 10, *extra), task=task, echo=False)
    jaxpar.train(_config(tmp_path / "b", 10, *extra), task=task, echo=False)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(losses(tmp_path / "a")) == 10
    assert not any("eval_loss" in r for r in rows(tmp_path / "a"))  # no eval_data: no eval


def test_each_process_loads_only_its_rows(monkeypatch):
    """As process 1 of 2: a data function that takes `rows=` is asked for rows 8…15 of
    each global batch of 16 and computes only those; one that does not is cut to them.
    Either way the process holds exactly its rows of the global batch."""
    from jaxpar.data.task_data import BatchCheck, FunctionStream, TaskData

    asked = []

    def with_rows(step, batch_size, rows):
        asked.append((step, batch_size, rows))
        return {k: v[rows] for k, v in TASK.data(step, batch_size).items()}

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    check = lambda: BatchCheck("Task.data", frozenset(TASK.batch_axes))
    for fn in (with_rows, TASK.data):
        stream = FunctionStream(fn, 16, check(), threads=0)
        batches = [next(stream) for _ in range(3)]
        for step, got in enumerate(batches):
            for key, value in TASK.data(step, 16).items():
                np.testing.assert_array_equal(got[key], value[8:16])
    assert asked == [(step, 16, slice(8, 16)) for step in range(3)]
    # processes split along stage hold the same rows: each loads the share its plan names
    data = TaskData("t", TASK.data, None, 0, frozenset(TASK.batch_axes))
    assert data.batch(0, 16)["labels"].shape[0] == 8  # process 1 of 2 by default
    whole = data.with_share((0, 1))
    for key, value in TASK.data(0, 16).items():
        np.testing.assert_array_equal(whole.batch(0, 16)[key], value)
    assert data.batch(0, 16)["labels"].shape[0] == 8  # the data given keeps its share


def _error(capsys, *args):
    code = main(["train", *SHORT, "train.steps=2", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_tasks_are_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_dir = f"run.dir={tmp_path / 'run'}"
    assert "file 'missing.py' does not exist" in _error(
        capsys, "--task", "missing.py:TASK", run_dir
    )
    err = _error(capsys, "--task", "examples/research_cnn.py:NOPE", run_dir)
    assert "defines no 'NOPE'" in err and "TASK" in err
    assert "not a jaxpar.Task" in _error(
        capsys, "--task", "examples/research_cnn.py:QUADRANTS", run_dir
    )
    assert "function of 2 arguments" in _error(
        capsys, "--task", "examples/research_cnn.py:batch", run_dir
    )
    assert "no module named 'no_such_pkg.tasks'" in _error(
        capsys, "--task", "no_such_pkg.tasks:TASK", run_dir
    )
    broken = tmp_path / "broken.py"
    broken.write_text("import jaxpar\n\nTASK = undefined_name\n")
    err = _error(capsys, "--task", f"{broken}:TASK", run_dir)
    assert "NameError" in err and "line 3" in err and "JAXPAR_DEBUG=1" in err


def _task_file(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import dataclasses, numpy as np\n"
        "from jaxpar.user_code import load_task\n"
        f"BASE = load_task({str(ROOT / SPEC)!r})\n" + body
    )
    return f"{path}:TASK"


def test_bad_data_and_names_are_one_line_errors(tmp_path, capsys):
    run_dir = f"run.dir={tmp_path / 'run'}"
    short = _task_file(
        tmp_path,
        "short",
        "def data(step, n):\n    b = BASE.data(step, n)\n"
        "    return {k: v[: n // 2] for k, v in b.items()}\n"
        "TASK = dataclasses.replace(BASE, data=data)\n",
    )
    err = _error(capsys, "--task", short, run_dir)
    assert "Task.data(step=0, global_batch_size=16) returned 'images' with 8 rows" in err
    assert "must have 16 rows" in err
    keys = _task_file(
        tmp_path,
        "keys",
        "TASK = dataclasses.replace(BASE, data=lambda s, n: {'x': np.zeros((n, 3))})\n",
    )
    assert "returned entries ['x'], but the task's batch_axes name ['images', 'labels']" in _error(
        capsys, "--task", keys, run_dir
    )
    shapes = _task_file(
        tmp_path,
        "shapes",
        "def data(step, n):\n    b = BASE.data(step, n)\n"
        "    if step: b['images'] = b['images'][:, :4]\n    return b\n"
        "TASK = dataclasses.replace(BASE, data=data)\n",
    )
    err = _error(capsys, "--task", shapes, "train.progress=false", run_dir)
    assert "returned 'images' of shape (16, 4, 8, 1)" in err and "earlier batches had" in err
    names = _task_file(
        tmp_path,
        "names",
        "import flax.nnx as nnx\n"
        "class M(nnx.Module):\n"
        "    def __init__(self, rngs):\n"
        "        self.w = nnx.Param(np.zeros((64, 4), np.float32), "
        "out_sharding=('pixels', 'classes'))\n"
        "    def __call__(self, x):\n"
        "        return x.reshape(len(x), -1) @ self.w[...]\n"
        "TASK = dataclasses.replace(BASE, model_fn=M)\n",
    )
    err = _error(capsys, "--task", names, run_dir)
    assert "logical axis 'pixels' of parameter 'w'" in err and "rules.pixels=null" in err
    assert (
        main(["inspect", "--task", names, "rules.pixels=fsdp", "mesh.data=1", "mesh.fsdp=8"]) == 0
    )  # the fix the message names works
    assert "P(fsdp, None)" in capsys.readouterr().out


def test_unannotated_parameters_replicate_with_a_warning_and_show_in_inspect(capsys):
    """A stock module without annotations trains (data parallel); its parameters are
    replicated, and jaxpar says so — a warning naming them and a note in inspect."""
    from flax import nnx

    task = jaxpar.Task(
        lambda rngs: nnx.Linear(16, 4, rngs=rngs),
        lambda m, b: (((m(b["x"]) - b["y"]) ** 2).mean(), {}),
        {"x": ("batch", None), "y": ("batch", None)},
        data=lambda s, n: {"x": np.ones((n, 16), np.float32), "y": np.zeros((n, 4), np.float32)},
        name="plain",
    )
    with pytest.warns(
        UserWarning,
        match=r"2 parameters carry no logical axes and are "
        r"replicated on every device: bias, kernel",
    ):
        run = build(load_config([], ["train.batch_size=16"]), task)
    assert run.plan.param_specs["kernel"] == jax.sharding.PartitionSpec(None, None)
    from jaxpar.report import format_report, layout_totals

    text = format_report(run, layout_totals(run))
    assert "(none: replicated)" in text and "2 parameters carry no logical axes" in text


def test_a_users_language_model_on_the_configs_text_counts_its_tokens():
    """A user's task that brings no data reads the config's text: its examples carry
    ``data.seq_len`` tokens, which the logged rows' ``tokens``, ``tokens_per_s`` and, under a
    mixture, ``tokens/<source>`` count (they were missing: the task said 0)."""
    from tests.helpers import GPT_SMALL

    config = load_config([], GPT_SMALL)
    task = dataclasses.replace(jaxpar.task_for(config), tokens_per_example=0, family="")
    assert build(config, task).plan.task.tokens_per_example == config.data.seq_len == 16
    own = dataclasses.replace(task, tokens_per_example=12)  # what a task says stands
    assert build(config, own).plan.task.tokens_per_example == 12


def test_optimizer_and_data_keys_that_the_task_overrides_warn():
    with pytest.warns(UserWarning) as caught:
        build(
            load_config(
                [], ["train.batch_size=16", "optim.lr=0.5", "data.seq_len=64", "model.d_model=8"]
            ),
            TASK,
        )
    said = {str(w.message) for w in caught if "has no effect" in str(w.message)}
    # each key with its own reason (all of them were said of every key)
    assert said == {
        "config key 'optim.lr' has no effect with a run that brings its own Optax optimizer",
        "config key 'data.seq_len' has no effect with a task that brings its own data",
        "config key 'model.d_model' has no effect with a user's task, whose model is its own",
    }


def test_layout_lab_measures_a_users_task(tmp_path, capsys):
    """`jaxpar sweep --task`: the user's model compiles under each layout; the gradient
    collectives of data and FSDP parallelism (which need no model knowledge) match the
    textbook, and FSDP holds about an eighth of the state."""
    assert (
        main(
            [
                "sweep",
                "--task",
                SPEC,
                "train.batch_size=16",
                "--layouts",
                "data=8",
                "fsdp=8",
                "--steps",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    import csv

    table = {r["layout"]: r for r in csv.DictReader((tmp_path / "sweep.csv").open())}
    assert float(table["data=8"]["comm_ratio"]) == pytest.approx(1.0, abs=0.05)
    assert float(table["fsdp=8"]["comm_ratio"]) == pytest.approx(1.0, abs=0.05)
    assert float(table["fsdp=8"]["mem_args_bytes"]) < 0.2 * float(table["data=8"]["mem_args_bytes"])
    assert "sweeping 2 layouts of research_cnn" in capsys.readouterr().out


def test_a_task_builds_its_model_for_testing_outside_a_run():
    """task.build_model() (no mesh, logical names kept as metadata) gives a run's initial
    parameters for run.seed, and the model runs on a batch; built plainly, Flax's eager
    sharding would look for mesh axes of the logical names."""
    from flax import nnx

    model = TASK.build_model(seed=3)
    run = build(load_config([], ["run.seed=3", "run.devices=1"]), TASK)
    want = jax.tree.map(np.asarray, run.trainer.init().params)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    batch = run.data.batch(0, 8) if TASK.data is None else TASK.data(0, 8)
    loss, _ = TASK.loss_fn(model, batch)
    assert np.isfinite(float(loss))
