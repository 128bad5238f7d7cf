"""A run's checkpoints: when to save, how to resume, preemption, export.

The glue between :mod:`jaxpar.checkpoint` (Orbax) and the training loop: which
checkpoint a run starts from (``checkpoint.resume``), what a save holds besides
the train state (the loader position, the seed, metrics, the config), SIGTERM
handling, and ``jaxpar export``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar import config as config_lib
from jaxpar import sharding as shd
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.run import Run, build, eval_metric_names, host_value, to_host
from jaxpar.trainer import TrainState


class Preempted(Exception):
    """Raised by :func:`jaxpar.loop.fit` after a SIGTERM: a checkpoint of ``step`` is written."""

    def __init__(self, step: int, directory: Path):
        super().__init__(f"preempted (SIGTERM): checkpoint of step {step} written to "
                         f"{directory}; run the same command to resume")
        self.step = step


_SIGTERM = threading.Event()


def on_sigterm(signum: int, frame: Any) -> None:
    _SIGTERM.set()


def preempted(step: int) -> bool:
    """Whether to stop after ``step``: SIGTERM here, or JAX's preemption sync point when
    several processes must agree on the step."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return _SIGTERM.is_set()


@contextlib.contextmanager
def sigterm_checkpoints() -> Iterator[None]:
    """Inside, a SIGTERM makes :func:`preempted` true: the loop checkpoints the step it is
    on and stops. Signal handlers can only be set in the main thread; elsewhere this only
    clears the flag. With several processes JAX's own preemption notifier handles SIGTERM
    (and agrees on the step across processes), so no Python handler is installed."""
    _SIGTERM.clear()
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def checkpoint_dir(config: Config) -> Path:
    """``checkpoint.dir``, or ``<run.dir>/checkpoints``."""
    return Path(config.checkpoint.dir or Path(config.run.dir) / "checkpoints")


def open_checkpoints(run: Run) -> Checkpointer:
    """The run's :class:`Checkpointer` per the ``checkpoint`` section.

    Raises:
      ValueError: when ``checkpoint.best_metric`` is not a metric evaluation logs.
    """
    cfg = run.config.checkpoint
    if cfg.keep_best and not getattr(run.data, "has_eval", True):
        raise ValueError(f"checkpoint.keep_best={cfg.keep_best} ranks checkpoints by an "
                         f"evaluation metric, but the task {run.name} has no eval_data; give "
                         "the Task eval_data or set checkpoint.keep_best=0")
    if cfg.keep_best and cfg.best_metric not in (names := eval_metric_names(run)):
        raise ValueError(f"checkpoint.best_metric={cfg.best_metric} is not an evaluation "
                         f"metric of {run.name}; use one of {', '.join(names)}")
    return Checkpointer(checkpoint_dir(run.config), run.trainer, keep=cfg.keep,
                        async_save=cfg.async_save, keep_best=cfg.keep_best,
                        best_metric=cfg.best_metric, best_mode=cfg.best_mode)


def _check_seed(config: Config, meta: dict[str, Any], where: Path) -> None:
    """A run resumed in place must keep its seed: it fixes the batch order."""
    saved = meta.get("seed", config.run.seed)
    if saved != config.run.seed:
        raise ValueError(
            f"the checkpoint in {where} was saved with run.seed={saved} but this run has "
            f"run.seed={config.run.seed}; set run.seed={saved} to continue it, or start "
            "afresh with a new run.dir")


def resume(config: Config, run: Run, ckpt: Checkpointer
           ) -> tuple[TrainState | None, int, dict[str, Any]]:
    """The state to start from, its step and its checkpoint's JSON item (``{}`` for a
    fresh start), per ``checkpoint.resume``.

    Raises:
      ValueError: for a step or path that holds no complete checkpoint, or a
        checkpoint of another model (listing the mismatched paths).
    """
    how = config.checkpoint.resume
    if how == "never":
        if ckpt.steps():
            raise ValueError(
                f"{ckpt.directory} already holds checkpoints (steps {ckpt.steps()}) and "
                "checkpoint.resume=never: use a new run.dir or checkpoint.dir, or "
                "checkpoint.resume=auto to continue")
        return None, 0, {}
    if how == "auto" or how.isdigit():
        if how == "auto" and ckpt.latest_step() is None:
            return None, 0, {}
        state, meta = ckpt.restore(None if how == "auto" else int(how))
        _check_seed(config, meta, ckpt.directory)
    else:
        path = Path(how)
        if not path.exists():
            raise ValueError(f"checkpoint.resume={how}: no such checkpoint directory")
        source = Checkpointer(path.parent if path.name.isdigit() else path, run.trainer,
                              keep=config.checkpoint.keep)
        state, meta = source.restore(int(path.name) if path.name.isdigit() else None)
        source.close()
    return state, int(host_value(state.step)), meta


def save_checkpoint(run: Run, ckpt: Checkpointer, step: int, state: TrainState,
                    metrics: dict[str, jax.Array], data_state: dict[str, Any] | None = None,
                    evals: dict[str, float] | None = None) -> None:
    """Starts saving ``step``: the state, and in the checkpoint's JSON item the step's
    metrics (with ``evals``, the held-out ones that rank checkpoints under
    ``checkpoint.keep_best``), the seed, the loader position and the config."""
    meta = {"step": step, "seed": run.config.run.seed, "data": data_state,
            "metrics": {**to_host(metrics), **(evals or {})},
            "config": config_lib.to_dict(run.config)}
    ckpt.save(step, state, meta, metrics=evals)


def export_params(config: Config, out: str | Path, step: int | None = None,
                  task: Any = None) -> tuple[Path, int]:
    """Writes the parameters of a checkpoint of ``config``'s run (of ``task``, a user's
    task, when given) to an ``.npz`` file.

    Keys are parameter paths (``'blocks/w_in'``); values are whole numpy arrays.

    Raises:
      ValueError: when the run has no such checkpoint or it does not fit the model.
    """
    run = build(config, task)
    ckpt = Checkpointer(checkpoint_dir(config), run.trainer)
    try:
        state, _ = ckpt.restore(step)
    finally:
        ckpt.close()
    flat = {shd.path_str(path): host_value(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **flat)
    return out, int(host_value(state.step))
