"""Checkpoints: bitwise resume across processes, restore onto other layouts, mismatch errors."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import load_config
from jaxpar.config.load import to_dict
from jaxpar.run import build
from jaxpar.sharding import path_str
from tests.helpers import GPT_SMALL, child_env

# The schedule's horizon is fixed (decay_steps), so a 4-step run and the first 4 steps of an
# 8-step run are the same computation.
RESUMABLE = [
    *GPT_SMALL,
    "optim.schedule=cosine",
    "optim.decay_steps=8",
    "optim.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.every_steps=2",
]
ROOT = Path(__file__).resolve().parents[1]


def train_process(run_dir: Path, steps: int, *extra: str) -> None:
    """`python -m jaxpar train` in a fresh process (8 simulated devices)."""
    env = child_env(8)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            *RESUMABLE,
            *extra,
            f"train.steps={steps}",
            f"run.dir={run_dir}",
        ],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def train_here(run_dir: Path, steps: int, *extra: str) -> None:
    """The same run as :func:`train_process`, in this process (its compiler flags and 8
    devices: the same floats, bit for bit), without a new interpreter's start-up."""
    from jaxpar.cli import main

    assert main(["train", *RESUMABLE, *extra, f"train.steps={steps}", f"run.dir={run_dir}"]) == 0


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def final_arrays(run_dir: Path, layout: list[str]) -> list[np.ndarray]:
    run = build(load_config([], [*RESUMABLE, *layout, "train.steps=8"]))
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    state, meta = ckpt.restore()
    ckpt.close()
    assert meta["step"] == 8 and int(state.step) == 8
    assert meta["data"]["batches_consumed"] == 8  # the loader's position travels with it
    return [np.asarray(x) for x in jax.tree.leaves(state)]


# data × fsdp × tensor: the data-parallel axis and the sharded ones at once
@pytest.mark.parametrize(
    "layout", [["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]], ids=["fsdp_tp"]
)
def test_resume_is_bitwise_identical(tmp_path, layout):
    """8 steps straight vs 4 steps, exit, resume for 4 more in a fresh process: same
    losses and params, bit for bit. (The straight run and the first 4 steps run in this
    process: the resume is the one that must start from the files alone.)"""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_here(straight, 8, *layout)
    train_here(resumed, 4, *layout)
    assert [s for s, _ in losses(resumed)] == [1, 2, 3, 4]
    train_process(resumed, 8, *layout)
    assert losses(resumed) == losses(straight)  # steps 1…8 once each, same floats
    assert [s for s, _ in losses(resumed)] == list(range(1, 9))
    for a, b in zip(final_arrays(straight, layout), final_arrays(resumed, layout)):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One step under fsdp=8, saved as step 1 in ``<dir>/ckpt``: ``(dir, leaves)``. The
    tests that use it only read the checkpoint, so the module trains and saves it once."""
    directory = tmp_path_factory.mktemp("saved")
    run = build(load_config([], [*GPT_SMALL, "mesh.data=1", "mesh.fsdp=8"]))
    state = run.trainer.init()
    state, _ = run.trainer.step(state, run.trainer.shard_batch(run.data.batch(0, 16)))
    ckpt = Checkpointer(directory / "ckpt", run.plan)
    ckpt.save(1, state, {"step": 1, "config": to_dict(run.config)})  # as a run saves it
    ckpt.close()
    return directory, [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize(
    "layout,devices",
    [
        # the same restore onto new shardings as layout1's, which also changes the device
        # count (and crosses fsdp with tensor)
        pytest.param(["mesh.data=2", "mesh.tensor=4"], 8, marks=pytest.mark.exhaustive),
        (["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], 4),
    ],
)
def test_restore_onto_another_layout(saved_run, layout, devices):
    """Saved under fsdp=8; restored under data=2×tensor=4 and on 4 devices: same values,
    new shardings, and training goes on."""
    directory, saved = saved_run
    run = build(load_config([], [*GPT_SMALL, *layout, f"run.devices={devices}"]))
    ckpt = Checkpointer(directory / "ckpt", run.plan)
    state, _ = ckpt.restore()
    for a, b in zip(saved, jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    w_in = state.params["blocks"]["w_in"]
    assert w_in.sharding == run.plan.state_shardings.params["blocks"]["w_in"]
    assert len(w_in.sharding.device_set) == devices
    state, metrics = run.trainer.step(state, run.trainer.shard_batch(run.data.batch(1, 16)))
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_incompatible_checkpoint_names_the_mismatches_in_one_line(saved_run):
    """The parameters' mismatches first, a count of the rest, and advice that works (no
    checkpoint.resume=never, which a directory holding checkpoints refuses)."""
    directory, _ = saved_run
    run = build(load_config([], [*GPT_SMALL, "model.d_ff=128", "model.tie_embeddings=true"]))
    with pytest.raises(ValueError) as err:
        Checkpointer(directory / "ckpt", run.plan).restore()
    text = str(err.value)
    assert "\n" not in text and "resume=never" not in text
    assert "does not fit this model/optimizer (12 mismatches: params/blocks/b_in:" in text
    assert text.endswith(
        "and 6 more); run with the settings it was saved with (a run dir's "
        "config.yaml edited by hand no longer holds them), or start afresh "
        "in a new run.dir"
    )
    assert "params/blocks/w_in: checkpoint ((2, 32, 64), 'float32'), model ((2, 32, 128)" in text
    assert "params/head: in the checkpoint ((32, 256), 'float32') but not in the model" in text
    # clip, then adamw (inject_hyperparams' inner state: scale_by_adam's mu, …)
    assert "opt_state/1/inner_state/0/mu/blocks/b_in: checkpoint ((2, 64), 'float32')" in text
    # given the run's settings, the fix names those the checkpoint was saved with
    settings = to_dict(run.config)
    with pytest.raises(ValueError) as err:
        Checkpointer(directory / "ckpt", run.plan, settings=settings).restore()
    assert str(err.value).endswith(
        "and 6 more); run with the settings it was saved with: model.d_ff=64 (this run: "
        "128), model.tie_embeddings=False (this run: True), or start afresh in a new run.dir"
    )


def test_resume_settings(tmp_path, capsys):
    """never refuses to overwrite; a step or a path picks that checkpoint; a missing one errors."""
    from jaxpar.cli import main

    base = [*RESUMABLE, "train.steps=4", f"run.dir={tmp_path / 'a'}"]
    assert main(["train", *base]) == 0
    assert main(["train", *base, "checkpoint.resume=never"]) == 2
    assert main(["train", *base, "checkpoint.resume=3"]) == 2  # saved: 2 and 4
    other = [*RESUMABLE, "train.steps=8", f"run.dir={tmp_path / 'b'}"]
    capsys.readouterr()
    # a run dir or a word is refused naming what to give
    assert main(["train", *other, f"checkpoint.resume={tmp_path / 'a'}"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"is a run directory; name one of its checkpoints, e.g. checkpoint.resume="
            f"{tmp_path / 'a' / 'checkpoints' / '4'} (its newest), or the folder "
            f"checkpoint.resume={tmp_path / 'a' / 'checkpoints'} for its newest complete one"
        )
    )
    assert main(["train", *other, "checkpoint.resume=latest"]) == 2
    assert "give auto, never, a step number or a checkpoint's path" in capsys.readouterr().err
    assert main(["train", *other, f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / '2'}"]) == 0
    # the checkpoint it came from, not the new run's empty folder
    said = f"resumed from the checkpoint of step 2 in {tmp_path / 'a' / 'checkpoints'}"
    assert said in capsys.readouterr().out
    assert [s for s, _ in losses(tmp_path / "b")] == list(range(3, 9))
    assert losses(tmp_path / "b")[:2] == losses(tmp_path / "a")[2:4]


@pytest.mark.exhaustive  # the handler: test_faults.py's Ctrl-C, test_user_task.py's SIGTERM
def test_sigterm_checkpoints_the_current_step_and_resume_continues(tmp_path):
    """SIGTERM mid-run: exit 4 with a complete checkpoint of the step it was on; resuming
    gives the losses of an uninterrupted run."""
    env = child_env(8)
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            *RESUMABLE,
            "train.steps=100000",
            f"run.dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(losses(run_dir)) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    step = int(err.split("checkpoint of step ")[1].split()[0])
    assert step >= 3
    run = build(load_config([], [*RESUMABLE, "train.steps=100000"]))
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    assert ckpt.latest_step() == step
    ckpt.close()
    train_process(run_dir, step + 3)  # resume=auto, 3 more steps
    assert [s for s, _ in losses(run_dir)] == list(range(1, step + 4))
    straight = tmp_path / "straight"
    train_process(straight, step + 3)
    assert losses(run_dir)[-3:] == losses(straight)[-3:]


def plain_orbax_script(relative_path: str) -> str:
    """The docs' plain-Orbax snippet (docs/checkpoints.md) for a checkpoint at
    ``relative_path`` (from the directory it runs in), then a check that jaxpar was never
    imported and a dump of what it read."""
    readme = (ROOT / "docs" / "checkpoints.md").read_text()
    snippet = readme.split("With Orbax alone")[1].split("```python\n")[1].split("```")[0]
    assert "runs/gpt_tiny/checkpoints/200/state" in snippet
    return snippet.replace("runs/gpt_tiny/checkpoints/200/state", relative_path) + (
        "import sys\n"
        "assert 'jaxpar' not in sys.modules\n"
        "np.savez(sys.argv[1], w_in=w_in, step=state['step'])\n"
    )


def test_checkpoint_reads_with_plain_orbax_and_exports(tmp_path, saved_run):
    """The docs' snippet (orbax only, one device, a relative path) and `jaxpar export` give
    the saved values."""
    from jaxpar.cli import main

    directory, saved = saved_run
    script = tmp_path / "read.py"
    script.write_text(plain_orbax_script("ckpt/1/state"))  # relative to where it runs
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "plain.npz")],
        check=True,
        cwd=directory,
        env=child_env(None),
        capture_output=True,
    )
    plain = np.load(tmp_path / "plain.npz")
    run = build(load_config([], [*GPT_SMALL, "mesh.data=1", "mesh.fsdp=8"]))
    names = [p for p, _ in jax.tree_util.tree_leaves_with_path(run.plan.abstract_state)]
    w_in = saved[[jax.tree_util.keystr(p) for p in names].index(".params['blocks']['w_in']")]
    np.testing.assert_array_equal(plain["w_in"], w_in)
    assert int(plain["step"]) == 1
    out = tmp_path / "params.npz"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(
            [
                "export",
                *GPT_SMALL,
                "mesh.data=1",
                "mesh.fsdp=8",
                "optim.warmup_steps=1000",  # a training setting: an export says nothing of it
                f"checkpoint.dir={directory / 'ckpt'}",
                "--out",
                str(out),
            ]
        )
    assert code == 0 and not [w for w in caught if "warmup" in str(w.message)]
    exported = np.load(out)
    np.testing.assert_array_equal(exported["blocks/w_in"], w_in)
    expected = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(run.plan.model.params)}
    assert set(exported.files) == expected and "blocks/w_in" in expected


def in_flight(run_dir: Path) -> list[str]:
    """The temporary directories of saves being written in ``run_dir``'s checkpoints."""
    names = os.listdir(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
    return [name for name in names if "tmp" in name]


def test_sigkill_during_a_save_leaves_nothing_resume_would_pick(tmp_path):
    """SIGKILL while an async save is being written (saves every step; a save — Orbax's
    writes, its finalization, the integrity record — outlasts a step of this small model,
    and the kill comes once a save's temporary directory is listed): the half-written save
    stays a temporary directory that is never listed, and the next run resumes from the
    last complete checkpoint with the losses of an uninterrupted run."""
    env = child_env(8)
    every = ["checkpoint.every_steps=1"]
    for attempt in range(5):
        run_dir = tmp_path / f"killed{attempt}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxpar",
                "train",
                *RESUMABLE,
                *every,
                "train.steps=100000",
                f"run.dir={run_dir}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 120
        while time.time() < deadline and not (
            (run_dir / "metrics.jsonl").exists()
            and len(losses(run_dir)) >= 3
            and in_flight(run_dir)
        ):
            time.sleep(0.01)
        proc.kill()
        proc.wait(timeout=60)
        names = os.listdir(run_dir / "checkpoints")
        if in_flight(run_dir):  # a half-written save survived the kill
            break
    else:
        pytest.fail(f"no save was in flight at any of 5 kills (last: {names})")
    complete = sorted(int(n) for n in names if n.isdigit())
    run = build(load_config([], [*RESUMABLE, *every, "train.steps=100000"]))
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    assert ckpt.steps() == complete and ckpt.latest_step() == complete[-1]
    ckpt.close()
    last = complete[-1]
    # the next run and the uninterrupted one in this process (the same floats as a child's)
    train_here(run_dir, last + 2, *every)  # resume=auto
    assert [s for s, _ in losses(run_dir)] == list(range(1, last + 3))  # each step once
    straight = tmp_path / "straight"
    train_here(straight, last + 2, *every)
    assert losses(run_dir)[-2:] == losses(straight)[-2:]


class _FailingWrite:
    """An Orbax commit future whose background write fails (a full disk)."""

    def result(self, timeout=None):
        raise OSError(28, "No space left on device (simulated)")


@pytest.mark.parametrize("every", [2, 0], ids=["next_save", "at_exit"])
def test_failed_async_save_exits_nonzero_with_the_error(tmp_path, monkeypatch, capsys, every):
    """A background write that fails is raised at the next save (the run stops there) or,
    for the last save, when the run waits at exit: exit status 5 with the error."""
    import orbax.checkpoint as ocp

    from jaxpar.cli import CHECKPOINT_FAILED, main

    original = ocp.StandardCheckpointHandler.async_save

    async def failing(self, *args, **kwargs):
        return [*(await original(self, *args, **kwargs) or []), _FailingWrite()]

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            *RESUMABLE,
            "train.steps=6",
            f"checkpoint.every_steps={every}",
            f"run.dir={run_dir}",
        ]
    )
    assert code == CHECKPOINT_FAILED
    err = capsys.readouterr().err
    assert "checkpoint error" in err and "No space left on device (simulated)" in err
    assert str(run_dir / "checkpoints") in err
    line = [x for x in err.splitlines() if "checkpoint error" in x]
    assert (
        len(line) == 1
        and line[0].startswith("jaxpar: checkpoint error: disk full: ")
        and " free there)" in line[0]
    )
    assert "Traceback" not in err
    logged = [s for s, _ in losses(run_dir)]
    # every=2: step 4's row is written (before its save waits), then the save of step 4
    # finds step 2's failure and the run stops
    assert logged == ([1, 2, 3, 4] if every else [1, 2, 3, 4, 5, 6])
    assert not [n for n in os.listdir(run_dir / "checkpoints") if n.isdigit()]


BEST = [
    *GPT_SMALL,
    "optim.lr=0.03",
    "optim.schedule=constant",
    "train.log_every=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.progress=false",
    "checkpoint.every_steps=2",
    "checkpoint.keep=2",
    "checkpoint.keep_best=2",
]


def test_keep_and_keep_best_retain_exactly_the_expected_steps(tmp_path):
    """keep=2, keep_best=2 by eval_loss over three runs of one run dir (resumed twice): the
    kept steps are exactly the latest 2 ∪ the best 2 of all saves, ranked with metrics that
    Orbax reads back from disk after each restart (a policy that forgot them would drop the
    older best checkpoint)."""
    from jaxpar.cli import main

    run_dir = tmp_path / "best"
    for steps in (12, 14, 20):
        assert main(["train", *BEST, f"train.steps={steps}", f"run.dir={run_dir}"]) == 0
        evals = {
            row["step"]: row["eval_loss"]
            for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in row
        }
        saved = sorted(evals)
        assert saved == list(range(2, steps + 1, 2))
        best = sorted(saved, key=evals.get)[:2]
        kept = sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n != ".jaxpar.lock")
        assert kept == sorted({*saved[-2:], *best}), (steps, evals)
    assert min(best) < saved[-2]  # a best checkpoint older than the latest ones was kept


def test_keep_best_metric_must_exist_and_async_alias(tmp_path, capsys):
    from jaxpar.cli import main

    code = main(["train", *BEST, "checkpoint.best_metric=eval_acc", f"run.dir={tmp_path}"])
    assert code == 2
    assert "checkpoint.best_metric=eval_acc" in capsys.readouterr().err
    config = load_config([], ["checkpoint.async=false"])
    assert config.checkpoint.async_save is False


def test_resume_in_place_keeps_the_seed(tmp_path, capsys):
    """Batches are a function of (seed, step): continuing a run under another seed is an error."""
    from jaxpar.cli import main

    base = [*RESUMABLE, "train.steps=3", f"run.dir={tmp_path}"]
    assert main(["train", *base]) == 0
    assert main(["train", *base, "train.steps=4", "run.seed=7"]) == 2
    assert "saved with run.seed=0" in capsys.readouterr().err


def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning(tmp_path, monkeypatch, recwarn):
    """keep=1 past a checkpoint whose deletion fails (an immutable or read-only directory,
    simulated): the write succeeded, so it is one warning naming the step, its directory
    and the cause; the run finishes and the newest checkpoint is on disk."""
    import errno
    import shutil

    from jaxpar.cli import main

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):
        if Path(path) == ckpts / "2":
            raise PermissionError(
                errno.EPERM, "Operation not permitted", str(ckpts / "2" / "_CHECKPOINT_METADATA")
            )
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", refuse)
    assert (
        main(["train", *RESUMABLE, "train.steps=6", "checkpoint.keep=1", f"run.dir={run_dir}"]) == 0
    )
    warned = [str(w.message) for w in recwarn if "could not delete" in str(w.message)]
    assert warned == [
        f"could not delete the old checkpoint of step 2 in {ckpts / '2'} "
        f"(Operation not permitted: {ckpts / '2' / '_CHECKPOINT_METADATA'}); "
        "delete it by hand — training goes on"
    ]
    assert sorted(n for n in os.listdir(ckpts) if n.isdigit()) == ["2", "6"]
    assert [s for s, _ in losses(run_dir)] == list(range(1, 7))


def test_a_damaged_checkpoint_that_cannot_be_moved_aside_says_so(tmp_path, monkeypatch, capsys):
    """The newest checkpoint truncated and immutable (its rename refused, simulated): one
    line saying which checkpoint could not be moved aside, why, and what to do."""
    import errno

    from jaxpar.cli import main

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    assert main(["train", *RESUMABLE, "train.steps=4", f"run.dir={run_dir}"]) == 0
    largest = max(
        (p for p in (ckpts / "4" / "state").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    os.truncate(largest, largest.stat().st_size // 2)
    replace = os.replace

    def refuse(src, dst, *args, **kwargs):
        if Path(src) == ckpts / "4":
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src), str(dst))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse)
    capsys.readouterr()
    assert main(["train", *RESUMABLE, "train.steps=6", f"run.dir={run_dir}"]) == 2
    err = [
        line
        for line in capsys.readouterr().err.splitlines()
        if not line.startswith("jaxpar: warning")
    ]
    assert err == [
        f"jaxpar: error: moving the checkpoint of step 4 in {ckpts / '4'} aside (it "
        f"failed verification) failed: Operation not permitted: {ckpts / '4'}; make "
        "it writable or move it away by hand"
    ]
    assert (ckpts / "4").is_dir() and (ckpts / "2").is_dir()
