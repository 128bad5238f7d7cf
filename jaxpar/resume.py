"""A run's checkpoints: when to save, how to resume, preemption.

The glue between :mod:`jaxpar.checkpoint` (Orbax) and the training loop: which
checkpoint a run starts from (``checkpoint.resume``, falling back past checkpoints
that fail verification), what a save holds besides the train state (the loader
position, the seed, metrics, the config), SIGTERM and Ctrl-C handling, and the
checkpoint a command reads (:func:`restore_state`; ``jaxpar export``: :mod:`jaxpar.export`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from jaxpar import config as config_lib
from jaxpar import signals
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.errors import ConfigError, CorruptCheckpoint, RestoreError
from jaxpar.run import Run, eval_metric_names, host_value, to_host
from jaxpar.state import TrainState

_SIGTERM = threading.Event()
_SIGNAL: list[str] = []  # the name of the first stop signal received
#: what a second Ctrl-C does: end the process at once (the ``jaxpar`` command), or raise
#: KeyboardInterrupt (``jaxpar.train`` called from Python: a notebook's kernel survives)
HARD_SECOND_CTRL_C = False


def on_sigterm(signum: int, frame: Any) -> None:
    _SIGNAL[:] = _SIGNAL or [signal.Signals(signum).name]
    _SIGTERM.set()


def on_sigint(signum: int, frame: Any) -> None:
    """The first Ctrl-C asks for a checkpoint and a stop, like SIGTERM. A second one ends
    the process at once (SIGINT's default action: no Python code needs to run, so also in
    the middle of a long compiled step) — or, from Python, raises KeyboardInterrupt."""
    signal.signal(
        signal.SIGINT, signal.SIG_DFL if HARD_SECOND_CTRL_C else signal.default_int_handler
    )
    print(
        "\njaxpar: Ctrl-C: finishing this step and writing a checkpoint (press Ctrl-C "
        "again to stop at once, without it)",
        file=sys.stderr,
        flush=True,
    )
    if jax.process_count() > 1:  # JAX's preemption notifier listens for SIGTERM
        _SIGNAL[:] = _SIGNAL or ["SIGINT"]
        os.kill(os.getpid(), signal.SIGTERM)
        return
    on_sigterm(signum, frame)


def stop_signal() -> str:
    """The name of the signal that stopped the run (``SIGTERM`` when none was seen here:
    another process received it)."""
    return _SIGNAL[0] if _SIGNAL else "SIGTERM"


def preempted(step: int) -> bool:
    """Whether to stop after ``step``: SIGTERM or a first Ctrl-C here, or JAX's
    preemption sync point when several processes must agree on the step."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return _SIGTERM.is_set()


@contextlib.contextmanager
def sigterm_checkpoints() -> Iterator[None]:
    """Inside, a SIGTERM or a first Ctrl-C (SIGINT) makes :func:`preempted` true: the loop
    checkpoints the step it is on and stops; a second Ctrl-C ends the process at once.

    Signal handlers can only be set in the main thread; elsewhere this only clears the
    flag. With several processes JAX's own preemption notifier handles SIGTERM (and
    agrees on the step across processes), so only the Ctrl-C handler is installed: it
    sends this process a SIGTERM."""
    _SIGTERM.clear()
    _SIGNAL.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals.raise_pending()  # a stop signal during start-up that a library swallowed
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, on_sigint)}
    if jax.process_count() == 1:
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def checkpoint_dir(config: Config) -> Path:
    """``checkpoint.dir``, or ``<run.dir>/checkpoints``."""
    return Path(config.checkpoint.dir or Path(config.run.dir) / "checkpoints")


def open_checkpoints(run: Run) -> Checkpointer:
    """The run's :class:`Checkpointer` per the ``checkpoint`` section.

    Raises:
      ConfigError: when ``checkpoint.best_metric`` is not a metric evaluation logs.
    """
    cfg = run.config.checkpoint
    if cfg.keep_best and not getattr(run.data, "has_eval", True):
        raise ConfigError(
            f"checkpoint.keep_best={cfg.keep_best} ranks checkpoints by an "
            f"evaluation metric, but the task {run.name} has no eval_data; give "
            "the Task eval_data or set checkpoint.keep_best=0"
        )
    if cfg.keep_best and cfg.best_metric not in (names := eval_metric_names(run)):
        raise ConfigError(
            f"checkpoint.best_metric={cfg.best_metric} is not an evaluation "
            f"metric of {run.name}; use one of {', '.join(names)}"
        )
    return Checkpointer(
        checkpoint_dir(run.config),
        run.plan,
        keep=cfg.keep,
        async_save=cfg.async_save,
        keep_best=cfg.keep_best,
        best_metric=cfg.best_metric,
        best_mode=cfg.best_mode,
        verify=cfg.verify,
        settings=config_lib.to_dict(run.config),
    )


def _check_seed(config: Config, meta: dict[str, Any], where: Path) -> None:
    """A run resumed in place must keep its seed: it fixes the batch order."""
    saved = meta.get("seed", config.run.seed)
    if saved != config.run.seed:
        raise RestoreError(
            f"the checkpoint in {where} was saved with run.seed={saved} but this run has "
            f"run.seed={config.run.seed}; set run.seed={saved} to continue it, or start "
            "afresh with a new run.dir"
        )


def resume(
    config: Config, run: Run, ckpt: Checkpointer
) -> tuple[TrainState | None, int, dict[str, Any], Path]:
    """The state to start from, its step, its checkpoint's JSON item (``{}`` for a fresh
    start) and the folder of checkpoints it came from (``ckpt``'s, or the one
    ``checkpoint.resume`` names), per ``checkpoint.resume``.

    Raises:
      RestoreError: for a step or path that holds no complete checkpoint, or a
        checkpoint of another model (listing the mismatched paths).
    """
    how = config.checkpoint.resume
    if how == "never":
        if ckpt.steps():
            raise RestoreError(
                f"{ckpt.directory} already holds checkpoints (steps {ckpt.steps()}) and "
                "checkpoint.resume=never: use a new run.dir or checkpoint.dir, or "
                "checkpoint.resume=auto to continue"
            )
        return None, 0, {}, ckpt.directory
    source = ckpt
    if how == "auto":
        if ckpt.latest_step() is None:
            return None, 0, {}, ckpt.directory
        state, meta = newest_verified(ckpt)
        _check_seed(config, meta, ckpt.directory)
    elif how.isdigit():
        state, meta = _restore_named(ckpt, int(how), f"checkpoint.resume={how}")
        _check_seed(config, meta, ckpt.directory)
    else:
        path = _checkpoint_path(how)
        source = Checkpointer(
            path.parent if path.name.isdigit() else path,
            run.plan,
            keep=config.checkpoint.keep,
            verify=config.checkpoint.verify,
            settings=config_lib.to_dict(config),
        )
        try:
            state, meta = _restore_named(
                source, int(path.name) if path.name.isdigit() else None, f"checkpoint.resume={how}"
            )
        finally:
            source.close()
    return state, int(host_value(state.step)), meta, source.directory


def _checkpoint_path(how: str) -> Path:
    """The path ``checkpoint.resume`` names: a checkpoint (``…/checkpoints/200``) or a
    folder of them (its newest).

    Raises:
      RestoreError: for a path that does not exist, or a run dir (naming its checkpoints).
    """
    path = Path(how)
    if not path.exists():
        raise RestoreError(
            f"checkpoint.resume={how}: no such checkpoint directory; give auto, never, a step "
            "number or a checkpoint's path (RUN_DIR/checkpoints/STEP)"
        )
    held = sorted(
        (int(p.name) for p in (path / "checkpoints").glob("*") if p.name.isdigit()), reverse=True
    )
    if held:
        raise RestoreError(
            f"checkpoint.resume={how} is a run directory; name one of its checkpoints, e.g. "
            f"checkpoint.resume={path / 'checkpoints' / str(held[0])} (its newest), or the "
            f"folder checkpoint.resume={path / 'checkpoints'} for its newest complete one"
        )
    return path


def _restore_named(
    ckpt: Checkpointer, step: int | None, what: str
) -> tuple[TrainState, dict[str, Any]]:
    """The checkpoint a setting (``what``) names; no fallback: a checkpoint that fails
    verification is a ValueError (exit status 2) that lists the others."""
    try:
        return ckpt.restore(step)
    except CorruptCheckpoint as err:
        others = [s for s in ckpt.steps() if s != err.step]
        fix = (
            "use checkpoint.resume=auto, which continues from the newest checkpoint that verifies"
            if what.startswith("checkpoint.")
            else "pass --step N"
        )
        held = f"also held, not verified yet: {others}" if others else "none other is held"
        raise RestoreError(f"{what}: {err}; name another checkpoint ({held}) or {fix}") from err


def newest_verified(ckpt: Checkpointer) -> tuple[TrainState, dict[str, Any]]:
    """The newest checkpoint that verifies. Each one that fails is reported, set aside as
    ``<step>.corrupt`` (so it is neither resumed nor counted by ``checkpoint.keep``) and
    the next older one tried; only the checkpoint restored is read whole.

    Raises:
      RestoreError: when no checkpoint verifies (each failure is listed).
    """
    failures: list[CorruptCheckpoint] = []
    for step in sorted(ckpt.steps(), reverse=True):
        try:
            state, meta = ckpt.restore(step)
        except CorruptCheckpoint as err:
            failures.append(err)
            continue
        if failures:
            moved = [ckpt.set_aside(err.step) for err in failures]
            warnings.warn(
                "skipped checkpoint"
                + "s" * (len(failures) > 1)
                + " that failed verification: "
                + "; ".join(f"{err} (moved to {dst})" for err, dst in zip(failures, moved))
                + f"; training continues from step {step}",
                stacklevel=3,
            )
        return state, meta
    raise RestoreError(
        f"no checkpoint in {ckpt.directory} verifies: "
        + "; ".join(f"step {err.step}: {err.reason}" for err in failures)
        + ". Restore the files from a copy, or move the directory away and start afresh"
    )


def save_checkpoint(
    run: Run,
    ckpt: Checkpointer,
    step: int,
    state: TrainState,
    metrics: dict[str, jax.Array],
    data_state: dict[str, Any] | None = None,
    evals: dict[str, float] | None = None,
) -> None:
    """Starts saving ``step``: the state, and in the checkpoint's JSON item the step's
    metrics (with ``evals``, the held-out ones that rank checkpoints under
    ``checkpoint.keep_best``), the seed, the loader position and the config."""
    meta = {
        "step": step,
        "seed": run.config.run.seed,
        "data": data_state,  # not a mesh axis: the loader's position
        "metrics": {**to_host(metrics), **(evals or {})},
        "config": config_lib.to_dict(run.config),
    }
    ckpt.save(step, state, meta, metrics=evals)


def restore_state(run: Run, step: int | None, command: str) -> TrainState:
    """The state of ``run``'s checkpoint ``step`` (None: the latest), restored with the
    run's shardings (on its mesh, whatever mesh the checkpoint was saved from).
    ``command`` names the caller in errors (``jaxpar export``).

    Raises:
      RestoreError: when the run has no such checkpoint, it fails verification, or it does
        not fit the model.
    """
    config = run.config
    ckpt = Checkpointer(
        checkpoint_dir(config),
        run.plan,
        verify=config.checkpoint.verify,
        settings=config_lib.to_dict(config),
    )
    try:
        state, _ = _restore_named(
            ckpt, step, command + (f" --step {step}" if step is not None else "")
        )
    finally:
        ckpt.close()
    return state
