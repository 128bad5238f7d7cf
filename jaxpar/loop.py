"""``jaxpar train`` as a Python API: build everything from a config, run the loop.

The loop is a few named steps — :func:`~jaxpar.run.build`, :func:`prepare_run_dir`,
:func:`fit` (with :func:`log_metrics` and :func:`~jaxpar.run.evaluate`) and
:func:`summarize` — so a script can reuse any of them; checkpoint handling is in
:mod:`jaxpar.resume`.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from jaxpar import config as config_lib
from jaxpar import resume as resume_lib
from jaxpar import sharding as shd
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.data import Loader
from jaxpar.mesh import describe_devices, describe_mesh
from jaxpar.pipeline.chart import describe_pipeline
from jaxpar.resume import Preempted, export_params, save_checkpoint
from jaxpar.run import Run, build, evaluate, host_value, is_eval_step, to_host
from jaxpar.trainer import TrainState

__all__ = ["DataWait", "History", "Preempted", "Run", "build", "check_finite", "evaluate",
           "export_params", "fit", "log_metrics", "open_loader", "prepare_run_dir",
           "summarize", "train"]


@dataclass
class History:
    """What :func:`fit` returns: logged rows and the final state."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    state: TrainState | None = None
    first_log_s: float = 0.0


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


def _log_row(run: Run, state: TrainState, step: int, host: dict[str, float], dt: float,
             evals: dict[str, float] | None = None) -> dict:
    """One ``metrics.jsonl`` row: the step's metrics, timing, throughput and eval
    (``evals`` when the checkpoint save already computed them)."""
    cfg = run.config.train
    row = {"step": step, **host, "finite": bool(host["finite"]), "step_time_s": dt,
           "examples_per_s": cfg.batch_size / dt, "skipped": int(host_value(state.skipped))}
    if run.trainer.task.tokens_per_example:
        row["tokens_per_s"] = cfg.batch_size * run.trainer.task.tokens_per_example / dt
    if is_eval_step(step, cfg):
        row.update(evals or {f"eval_{k}": v for k, v in evaluate(run, state.params).items()})
    return row


def _show(bar: Any, row: dict[str, Any], steps: int) -> None:
    if bar is None:
        return
    bar.update(steps)
    rate = (f"{row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row
            else f"{row['examples_per_s']:.0f} ex/s")
    bar.set_postfix_str(f"loss {row['loss']:.4f}, {rate}")


class DataWait:
    """Time the loop spends waiting for host batches, per logging interval, and a one-time
    warning when, over at least 3 intervals after the first (compile-bound) one, more than
    ``data.wait_warn`` of the loop's time went to waiting."""

    MIN_INTERVALS = 3

    def __init__(self, threshold: float):
        self.threshold, self.seconds, self.warned, self.intervals = threshold, 0.0, False, 0
        self.total_wait = self.total_time = 0.0
        self.total_steps = 0

    def next(self, loader: Loader) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        batch = next(loader)
        self.seconds += time.perf_counter() - start
        return batch

    def fraction(self, interval_s: float, steps: int, cfg: Config) -> float:
        """The waiting share of the interval just ended (and resets the count)."""
        frac = min(self.seconds / max(interval_s, 1e-9), 1.0)
        self.intervals += 1
        if self.intervals > 1:
            self.total_wait += self.seconds
            self.total_time += interval_s
            self.total_steps += steps
        self.seconds = 0.0
        overall = self.total_wait / max(self.total_time, 1e-9)
        if (self.threshold and not self.warned and overall > self.threshold
                and self.intervals > self.MIN_INTERVALS):
            self.warned = True
            warnings.warn(
                f"input-bound: the loop waited for data {overall:.0%} of the time over the "
                f"last {self.total_steps} steps ({self.total_time / self.total_steps * 1e3:.1f} "
                f"ms/step); raise data.threads={cfg.data.threads}, data.prefetch="
                f"{cfg.data.prefetch} or data.workers={cfg.data.workers} (warning threshold "
                f"data.wait_warn={self.threshold})", stacklevel=3)
        return frac


def _warn_profile_span(cfg: config_lib.TrainConfig, has_run_dir: bool) -> None:
    """Warns when ``train.profile_steps`` traces less than it names, or nothing."""
    start, stop = config_lib.parse_profile_steps(cfg.profile_steps)
    setting = f"train.profile_steps={cfg.profile_steps!r}"
    if not has_run_dir:
        message = f"{setting} has no effect without a run dir: pass run_dir to fit()"
    elif start > cfg.steps:
        message = (f"{setting} has no effect: it starts after the last step (train.steps="
                   f"{cfg.steps}); lower START to trace")
    elif stop > cfg.steps + 1:
        message = (f"{setting} reaches past the last step (train.steps={cfg.steps}): steps "
                   f"{start} to {cfg.steps} are traced, until the end of the run")
    else:
        return
    warnings.warn(message, stacklevel=4)


class _Profiler:
    """A JAX profiler trace of the steps ``train.profile_steps`` names, in ``<run.dir>/profile``.

    The trace starts before the first traced step fetches its batch and stops once the
    last traced step's device work is done (its logging, evaluation and checkpoint are
    left out). Without a run dir (processes other than 0) nothing is traced.
    """

    def __init__(self, run_dir: Path | None, cfg: config_lib.TrainConfig):
        span = config_lib.parse_profile_steps(cfg.profile_steps)
        self.directory = run_dir / "profile" if run_dir is not None and span else None
        self.start, self.stop = span or (0, 0)
        self.active = False
        if span and jax.process_index() == 0:
            _warn_profile_span(cfg, run_dir is not None)
        self.stop = min(self.stop, cfg.steps + 1)

    def before(self, step: int) -> None:
        """Starts the trace when ``step`` is the first traced one (or a resumed run's first)."""
        if self.directory is not None and not self.active and self.start <= step < self.stop:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, state: TrainState) -> None:
        """Stops the trace after the last traced step, once its device work is done."""
        if self.active and step + 1 >= self.stop:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stops (and writes) the trace if it is running — also when the run ends early."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


def open_loader(run: Run, data_state: dict[str, Any] | None = None) -> Loader:
    """The training stream, positioned after the batches a checkpoint's loader had read.

    Raises:
      ValueError: when the saved position comes from other data settings.
    """
    loader = run.data.loader(run.config.train.batch_size, run.config.data)
    if data_state:
        try:
            loader.set_state(data_state)
        except ValueError as err:
            loader.close()
            raise ValueError(
                f"the checkpoint's data position does not fit this run ({err}) — keep "
                "train.batch_size, run.seed and the data settings of the run you resume, "
                "or start afresh (checkpoint.resume=never with a new run.dir)") from err
    return loader


def fit(run: Run, run_dir: Path | None = None, state: TrainState | None = None,
        ckpt: Checkpointer | None = None, data_state: dict[str, Any] | None = None) -> History:
    """Trains for ``train.steps`` steps, logging and evaluating along the way.

    Metrics stay on the device between log points, so the loop does not sync
    with the host every step; ``step_time_s`` is the mean over the interval and
    ``data_wait`` the share of it spent waiting for the loader. A non-finite
    step is never applied (the step guards itself); with
    ``train.nonfinite=stop`` the run stops at the next log point, naming it.
    A ``state`` passed in continues from its step, and ``data_state`` (the
    loader position saved with it) makes the loader yield the batches the
    uninterrupted run would have; with ``ckpt`` the state and the loader
    position are saved every ``checkpoint.every_steps`` and after the last step.
    With ``train.profile_steps`` and a ``run_dir``, the steps it names are traced
    into ``run_dir / "profile"``; every step is marked ``train`` (with its
    ``step_num``) in profiler traces.
    """
    cfg, trainer = run.config.train, run.trainer
    history, t_start = History(), time.perf_counter()
    state = state if state is not None else trainer.init()
    first = int(host_value(state.step)) + 1
    profiler = _Profiler(run_dir, cfg)
    loader = open_loader(run, data_state)
    if loader.batches_consumed != first - 1:
        loader.close()
        raise ValueError(f"the checkpoint of step {first - 1} holds a data position after "
                         f"{loader.batches_consumed} batches; it is not a jaxpar train checkpoint "
                         "of this run — start afresh (checkpoint.resume=never)")
    writer, bar = _tensorboard(run_dir, cfg.tensorboard), _progress(cfg.steps, cfg.progress)
    wait = DataWait(run.config.data.wait_warn)
    pending: list[tuple[int, dict]] = []
    t_last, last_step = t_start, first - 1
    every = run.config.checkpoint.every_steps
    try:
        for step in range(first, cfg.steps + 1):
            profiler.before(step)
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                batch = trainer.shard_batch(wait.next(loader))
                state, metrics = trainer.step(state, batch)
            profiler.after(step, state)
            pending.append((step, metrics))
            stop = ckpt is not None and resume_lib.preempted(step)
            evals = None
            if ckpt is not None and ((every and step % every == 0) or step == cfg.steps or stop):
                evals = save_checkpoint(run, ckpt, step, state, metrics, loader.get_state())
            if stop:
                ckpt.wait()  # the checkpoint is complete before the process exits
            if not (_is_log_step(step, cfg) or stop):
                continue
            host = [(s, to_host(m)) for s, m in pending]
            check_finite(host, cfg.nonfinite)
            now = time.perf_counter()
            history.first_log_s = history.first_log_s or now - t_start
            steps = step - last_step
            row = _log_row(run, state, step, host[-1][1], (now - t_last) / steps, evals)
            row["data_wait"] = wait.fraction(now - t_last, steps, run.config)
            history.rows.append(row)
            log_metrics(run_dir, row, writer)
            _show(bar, row, steps)
            pending, t_last, last_step = [], time.perf_counter(), step
            if stop:
                raise Preempted(step, ckpt.directory)
    finally:
        loader.close()
        for closer in (bar, writer):
            if closer is not None:
                closer.close()
        profiler.close()
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
    ckpt = resume_lib.open_checkpoints(run)
    try:
        state, start, meta = resume_lib.resume(config, run, ckpt)
        if start:
            say(f"jaxpar: resumed from the checkpoint of step {start} in {ckpt.directory}")
        run_dir = prepare_run_dir(config, start) if jax.process_index() == 0 else None
        if start >= config.train.steps:
            say(f"jaxpar: the run is already at step {start} of train.steps="
                f"{config.train.steps}; nothing to train")
            return History(state=state)
        with resume_lib.sigterm_checkpoints():
            history = fit(run, run_dir, state, ckpt, meta.get("data"))
    finally:
        ckpt.close()  # waits for pending saves; a failed save raises here
    say(summarize(run, history))
    return history
