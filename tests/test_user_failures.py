"""The user's own code failing — a loss, a data function, a hook — is one line naming the
function, where it failed and the exception's own message (exit 1); a loss of the wrong
form is refused as the step is traced, saying what ``loss_fn`` must return (exit 2);
``JAXPAR_DEBUG=1`` shows the traceback, and the run stays resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxpar.cli import main
from tests.helpers import GPT_SMALL

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "train.batch_size=16",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.every_steps=2",
]
TASKS = """
import dataclasses, os, sys
import jax
import jaxpar
import optax
sys.path.insert(0, {examples!r})
import research_cnn as cnn

def per_example(model, b):
    logits = model(b["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]), {{}}

def bare(model, b):
    return cnn.loss(model, b)[0]

def raising(model, b):
    return {{}}["no such entry"]

def data(step, batch_size):
    if step == 3 and os.path.exists({flag!r}):
        raise RuntimeError("the bucket went away")
    return cnn.batch(step, batch_size)

class Upload(jaxpar.Hook):
    def on_save(self, ctx, step):
        raise ValueError("upload failed")

class Start(jaxpar.Hook):
    def on_start(self, ctx):
        raise OSError("no tracker")

GPT = jaxpar.task_for(jaxpar.load_config([], {gpt!r}))

def per_example_head(model, x, b):
    loss, metrics = GPT.stages.head(model, x, b)
    return loss * jax.numpy.ones(4), metrics

PER_EXAMPLE = dataclasses.replace(cnn.TASK, loss_fn=per_example)
PIPELINED = dataclasses.replace(GPT, stages=dataclasses.replace(GPT.stages, head=per_example_head))
BARE = dataclasses.replace(cnn.TASK, loss_fn=bare)
RAISING = dataclasses.replace(cnn.TASK, loss_fn=raising)
DATA = dataclasses.replace(cnn.TASK, data=data)
"""
FIX = (
    "fix it and run the same command (it resumes from the last checkpoint); "
    "JAXPAR_DEBUG=1 shows the traceback"
)
#: where no checkpoint was written (train.steps=2, none saved before the failure)
AGAIN = (
    "fix it and run the same command (no checkpoint was written, so it starts again from "
    "the first step: checkpoint.every_steps=N keeps the progress); JAXPAR_DEBUG=1 shows the "
    "traceback"
)
MUST = (
    "loss_fn must return (loss, metrics): a scalar loss (average the per-example losses, "
    "e.g. loss.mean()) and a dict of scalar metrics ({} for none)"
)


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "my_tasks.py"
    path.write_text(
        TASKS.format(examples=str(ROOT / "examples"), flag=str(tmp_path / "fail"), gpt=GPT_SMALL)
    )
    (tmp_path / "fail").write_text("")
    return path


def _err(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


@pytest.mark.parametrize(
    "name,status,line",
    [
        (
            "PER_EXAMPLE",
            2,
            "loss_fn (my_tasks.py:per_example) returned a loss of shape (16,); " + MUST,
        ),
        ("BARE", 2, "loss_fn (my_tasks.py:bare) returned one array of shape (); " + MUST),
        (
            "RAISING",
            1,
            "loss_fn (my_tasks.py:raising) raised KeyError at step 1: 'no such entry' — " + AGAIN,
        ),
    ],
)
def test_a_loss_that_fails_is_one_line_naming_it(tmp_path, capsys, tasks, name, status, line):
    assert (
        main(
            [
                "train",
                "--task",
                f"{tasks}:{name}",
                *SHORT,
                "train.steps=2",
                f"run.dir={tmp_path / 'run'}",
            ]
        )
        == status
    )
    assert _err(capsys) == f"jaxpar: error: {line}"


@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_a_per_example_loss_from_the_stages_head_is_refused_before_a_step(
    tmp_path, capsys, tasks, executor
):
    """A pipelined task whose stages' head returns a loss per example: refused as the step
    is traced, under either executor, in one line naming the head (exit 2), no step run."""
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--task",
                f"{tasks}:PIPELINED",
                *GPT_SMALL,
                *SHORT,
                "train.steps=2",
                "mesh.stage=2",
                "mesh.data=1",
                "run.devices=2",
                "pipeline.microbatches=2",
                f"pipeline.executor={executor}",
                f"run.dir={run_dir}",
            ]
        )
        == 2
    )
    assert _err(capsys) == (
        "jaxpar: error: the stages' head (my_tasks.py:per_example_head) "
        f"returned a loss of shape (4,); {MUST}"
    )
    assert not (run_dir / "metrics.jsonl").exists() or _steps(run_dir) == []


@pytest.mark.parametrize(
    "hook,line,fix",
    [
        (
            "Upload",
            "hook my_tasks.py:Upload.on_save raised ValueError at step 2: upload failed",
            FIX,  # step 2's checkpoint was written (on_save: its write is under way)
        ),
        (
            "Start",
            "hook my_tasks.py:Start.on_start raised OSError before the first step: no tracker",
            AGAIN,
        ),
    ],
)
def test_a_hook_that_raises_is_one_line_naming_its_class_and_event(
    tmp_path, capsys, tasks, hook, line, fix
):
    assert (
        main(
            [
                "train",
                "--task",
                f"{tasks}:DATA",
                *SHORT,
                "train.steps=2",
                f"train.hooks=[{tasks}:{hook}]",
                f"run.dir={tmp_path / 'run'}",
            ]
        )
        == 1
    )
    assert _err(capsys) == f"jaxpar: error: {line} — {fix}"


def test_a_data_function_that_raises_is_one_line_and_the_run_resumes(
    tmp_path, capsys, tasks, monkeypatch
):
    run_dir = tmp_path / "run"
    argv = ["train", "--task", f"{tasks}:DATA", *SHORT, "train.steps=6", f"run.dir={run_dir}"]
    assert main(argv) == 1
    assert _err(capsys) == (
        "jaxpar: error: Task.data (my_tasks.py:data) raised RuntimeError for "
        f"batch 3 (step 4): the bucket went away — {FIX}"
    )
    monkeypatch.setenv("JAXPAR_DEBUG", "1")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and 'raise RuntimeError("the bucket went away")' in err
    monkeypatch.delenv("JAXPAR_DEBUG")
    (tmp_path / "fail").unlink()  # fixed
    assert main(argv) == 0
    assert "resumed from the checkpoint of step 2" in capsys.readouterr().out
    assert _steps(run_dir) == [1, 2, 3, 4, 5, 6]
