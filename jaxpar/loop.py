"""``jaxpar train`` as a Python API: build everything from a config, run the loop.

The loop is a few named steps — :func:`build`, :func:`prepare_run_dir`,
:func:`fit` (with :func:`log_metrics` and :func:`evaluate`) and
:func:`summarize` — so a script can reuse any of them.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from jaxpar import config as config_lib
from jaxpar import sharding as shd
from jaxpar.builtin_tasks import task_from_config
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.data import ImageData, TextData, load_data
from jaxpar.mesh import describe_devices, describe_mesh, make_mesh, select_devices
from jaxpar.optim import decay_mask, make_optimizer
from jaxpar.pipeline.chart import describe_pipeline
from jaxpar.trainer import Trainer, TrainState, abstract_params_and_axes


@dataclass
class Run:
    """Everything :func:`build` assembles from a config."""

    config: Config
    trainer: Trainer
    data: TextData | ImageData
    devices: list[jax.Device]


class Preempted(Exception):
    """Raised by :func:`fit` after a SIGTERM: a checkpoint of ``step`` is written."""

    def __init__(self, step: int, directory: Path):
        super().__init__(f"preempted (SIGTERM): checkpoint of step {step} written to "
                         f"{directory}; run the same command to resume")
        self.step = step


_SIGTERM = threading.Event()


def _on_sigterm(signum: int, frame: Any) -> None:
    _SIGTERM.set()


def _preempted(step: int) -> bool:
    """Whether to stop after ``step``: SIGTERM here, or JAX's preemption sync point when
    several processes must agree on the step."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return _SIGTERM.is_set()


@dataclass
class History:
    """What :func:`fit` returns: logged rows and the final state."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    state: TrainState | None = None
    first_log_s: float = 0.0


def build(config: Config) -> Run:
    """Devices, mesh, rules, data, task, optimizer and trainer from ``config``."""
    config_lib.warn_unused(config)
    devices = select_devices(config.run.devices)
    mesh = make_mesh(config.mesh, devices)
    rules = shd.resolve_rules(config.rules)
    data = load_data(config.data, config.model.name, config.model.num_classes, config.run.seed)
    image_shape = data.image_shape if isinstance(data, ImageData) else None
    if isinstance(data, TextData) and config.model.vocab_size < TextData.VOCAB:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the {TextData.VOCAB} "
            f"byte values of text data '{data.name}'; set model.vocab_size ≥ {TextData.VOCAB}"
        )
    task = task_from_config(config.model, config.data.seq_len, image_shape)
    mask = decay_mask(*abstract_params_and_axes(task, config.run.seed))
    tx, schedule = make_optimizer(config.optim, config.train.steps, mask)
    trainer = Trainer(task, tx, mesh, rules, schedule=schedule,
                      grad_accum=config.train.grad_accum, seed=config.run.seed,
                      pipeline=config.pipeline)
    # the global batch must split over microbatches × batch devices: say so before training
    trainer.batch_shardings(data.batch(0, config.train.batch_size))
    return Run(config, trainer, data, devices)


def prepare_run_dir(config: Config, start_step: int = 0) -> Path:
    """Creates the run dir and writes the resolved ``config.yaml``.

    ``metrics.jsonl`` keeps the rows of steps ≤ ``start_step`` (a resumed run
    appends after them without duplicating steps) and loses the rest.
    """
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(config), sort_keys=False))
    metrics = run_dir / "metrics.jsonl"
    kept = []
    if start_step and metrics.exists():
        kept = [line for line in metrics.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= start_step]
    metrics.write_text("".join(line + "\n" for line in kept))
    return run_dir


def checkpoint_dir(config: Config) -> Path:
    """``checkpoint.dir``, or ``<run.dir>/checkpoints``."""
    return Path(config.checkpoint.dir or Path(config.run.dir) / "checkpoints")


def resume(config: Config, run: Run, ckpt: Checkpointer) -> tuple[TrainState | None, int]:
    """The state to start from and its step, per ``checkpoint.resume``.

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
        return None, 0
    if how == "auto":
        if ckpt.latest_step() is None:
            return None, 0
        state, _ = ckpt.restore()
    elif how.isdigit():
        state, _ = ckpt.restore(int(how))
    else:
        path = Path(how)
        if not path.exists():
            raise ValueError(f"checkpoint.resume={how}: no such checkpoint directory")
        source = Checkpointer(path.parent if path.name.isdigit() else path, run.trainer,
                              keep=config.checkpoint.keep)
        state, _ = source.restore(int(path.name) if path.name.isdigit() else None)
        source.close()
    return state, int(np.asarray(state.step))


def _to_host(metrics: dict[str, jax.Array]) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in metrics.items()}


def check_finite(step_rows: list[tuple[int, dict[str, float]]], policy: str) -> None:
    """Stops the run at the first non-finite step when ``policy`` is 'stop'.

    Raises:
      FloatingPointError: naming the step, its loss and gradient norm.
    """
    for step, row in step_rows:
        if not row["finite"] and policy == "stop":
            raise FloatingPointError(
                f"non-finite loss or gradients at step {step} (loss={row['loss']}, "
                f"grad_norm={row['grad_norm']}); the update was not applied. Lower optim.lr, "
                "set optim.clip_norm, or set train.nonfinite=skip to skip such steps"
            )


def log_metrics(run_dir: Path | None, row: dict[str, Any], writer: Any = None) -> None:
    """Appends one row to ``metrics.jsonl`` (and TensorBoard when enabled)."""
    if run_dir is not None:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    if writer is not None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                writer.add_scalar(key, value, row["step"])


def evaluate(run: Run, params: Any) -> dict[str, float]:
    """Mean metrics over ``train.eval_batches`` held-out batches."""
    totals: dict[str, float] = {}
    n = run.config.train.eval_batches
    for i in range(n):
        batch = run.trainer.shard_batch(run.data.batch(i, run.config.train.batch_size, "eval"))
        for k, v in _to_host(run.trainer.evaluate(params, batch)).items():
            totals[k] = totals.get(k, 0.0) + v / n
    return totals


def _tensorboard(run_dir: Path | None, enabled: bool) -> Any:
    if not enabled or run_dir is None:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError as err:
        raise ValueError("train.tensorboard=true needs tensorboardX: pip install 'jaxpar[tensorboard]'") from err
    return SummaryWriter(str(run_dir / "tensorboard"))


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True,
                disable=not sys.stderr.isatty())


def _is_log_step(step: int, cfg: Any) -> bool:
    """Log the first step (the starting loss), every ``log_every``, and the last."""
    return step == 1 or step % cfg.log_every == 0 or step == cfg.steps


def _log_row(run: Run, state: TrainState, step: int, host: dict[str, float], dt: float) -> dict:
    """One ``metrics.jsonl`` row: the step's metrics, timing, throughput and eval."""
    cfg = run.config.train
    row = {"step": step, **host, "finite": bool(host["finite"]), "step_time_s": dt,
           "examples_per_s": cfg.batch_size / dt, "skipped": int(np.asarray(state.skipped))}
    if run.trainer.task.tokens_per_example:
        row["tokens_per_s"] = cfg.batch_size * run.trainer.task.tokens_per_example / dt
    if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
        row.update({f"eval_{k}": v for k, v in evaluate(run, state.params).items()})
    return row


def _show(bar: Any, row: dict[str, Any], steps: int) -> None:
    if bar is None:
        return
    bar.update(steps)
    rate = (f"{row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row
            else f"{row['examples_per_s']:.0f} ex/s")
    bar.set_postfix_str(f"loss {row['loss']:.4f}, {rate}")


def fit(run: Run, run_dir: Path | None = None, state: TrainState | None = None,
        ckpt: Checkpointer | None = None) -> History:
    """Trains for ``train.steps`` steps, logging and evaluating along the way.

    Metrics stay on the device between log points, so the loop does not sync
    with the host every step; ``step_time_s`` is the mean over the interval.
    A non-finite step is never applied (the step guards itself); with
    ``train.nonfinite=stop`` the run stops at the next log point, naming it.
    A ``state`` passed in continues from its step (batches are a function of
    the step, so a resumed run sees what the uninterrupted one would have);
    with ``ckpt`` the state is saved every ``checkpoint.every_steps`` and
    after the last step.
    """
    cfg, trainer = run.config.train, run.trainer
    history, t_start = History(), time.perf_counter()
    state = state if state is not None else trainer.init()
    first = int(np.asarray(state.step)) + 1
    writer, bar = _tensorboard(run_dir, cfg.tensorboard), _progress(cfg.steps, cfg.progress)
    pending: list[tuple[int, dict]] = []
    t_last, last_step = t_start, first - 1
    every = run.config.checkpoint.every_steps
    for step in range(first, cfg.steps + 1):
        batch = trainer.shard_batch(run.data.batch(step - 1, cfg.batch_size))
        state, metrics = trainer.step(state, batch)
        pending.append((step, metrics))
        stop = ckpt is not None and _preempted(step)
        if ckpt is not None and ((every and step % every == 0) or step == cfg.steps or stop):
            meta = {"step": step, "seed": run.config.run.seed, "metrics": _to_host(metrics),
                    "config": config_lib.to_dict(run.config)}
            ckpt.save(step, state, meta)
        if stop:
            ckpt.wait()  # the checkpoint is complete before the process exits
        if not (_is_log_step(step, cfg) or stop):
            continue
        host = [(s, _to_host(m)) for s, m in pending]
        check_finite(host, cfg.nonfinite)
        now = time.perf_counter()
        history.first_log_s = history.first_log_s or now - t_start
        row = _log_row(run, state, step, host[-1][1], (now - t_last) / (step - last_step))
        history.rows.append(row)
        log_metrics(run_dir, row, writer)
        _show(bar, row, step - last_step)
        pending, t_last, last_step = [], time.perf_counter(), step
        if stop:
            raise Preempted(step, ckpt.directory)
    for closer in (bar, writer):
        if closer is not None:
            closer.close()
    history.state = state
    return history


def summarize(run: Run, history: History) -> str:
    """The final summary: steps, final loss, throughput, per-device state bytes."""
    trainer, last = run.trainer, history.rows[-1]
    params = shd.bytes_per_device(trainer.abstract_params, trainer.state_shardings.params)
    opt = shd.bytes_per_device(trainer.abstract_state.opt_state, trainer.state_shardings.opt_state)
    lines = [
        f"steps: {last['step']}  final loss: {last['loss']:.4f}"
        + (f"  eval loss: {last['eval_loss']:.4f}" if "eval_loss" in last else ""),
        f"throughput: {last['examples_per_s']:.1f} examples/s"
        + (f", {last['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in last else "")
        + f"  (first step logged after {history.first_log_s:.1f} s, incl. compile)",
        f"state per device: params {params / 2**20:.2f} MiB, optimizer {opt / 2**20:.2f} MiB",
        f"skipped non-finite steps: {last['skipped']}",
    ]
    return "\n".join(lines)


def train(config: Config, echo: bool = True) -> History:
    """Runs ``jaxpar train``: build, write the run dir, fit, summarize."""
    run = build(config)
    say = print if echo and jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"jaxpar: running on {describe_devices(run.devices)}; {describe_mesh(run.trainer.mesh)}")
    say(f"jaxpar: data {run.data.name}; model {config.model.name}; rules preset {config.rules.preset}")
    if run.trainer.pipeline is not None:
        say(f"jaxpar: {describe_pipeline(run.trainer.pipeline)}")
    ckpt = Checkpointer(checkpoint_dir(config), run.trainer, keep=config.checkpoint.keep,
                        async_save=config.checkpoint.async_save)
    _SIGTERM.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        state, start = resume(config, run, ckpt)
        if start:
            say(f"jaxpar: resumed from the checkpoint of step {start} in {ckpt.directory}")
        run_dir = prepare_run_dir(config, start) if jax.process_index() == 0 else None
        if start >= config.train.steps:
            say(f"jaxpar: the run is already at step {start} of train.steps="
                f"{config.train.steps}; nothing to train")
            return History(state=state)
        history = fit(run, run_dir, state, ckpt)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        ckpt.close()  # waits for pending saves; a failed save raises here
    say(summarize(run, history))
    return history


def export_params(config: Config, out: str | Path, step: int | None = None) -> tuple[Path, int]:
    """Writes the parameters of a checkpoint of ``config``'s run to an ``.npz`` file.

    Keys are parameter paths (``'blocks/w_in'``); values are whole numpy arrays.

    Raises:
      ValueError: when the run has no such checkpoint or it does not fit the model.
    """
    run = build(config)
    ckpt = Checkpointer(checkpoint_dir(config), run.trainer)
    try:
        state, _ = ckpt.restore(step)
    finally:
        ckpt.close()
    flat = {shd.path_str(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **flat)
    return out, int(np.asarray(state.step))
