"""Hooks on the step metrics: the rows of ``metrics.jsonl``, TensorBoard, the non-finite
guard."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from jaxpar.hooks.base import Context, Hook


class MetricsLog(Hook):
    """Makes a row at every log step (``ctx.rows``) and appends it to
    ``<run_dir>/metrics.jsonl`` when there is a run dir.

    A train row holds the step's metrics, ``time`` (seconds since the loop started),
    ``step_time_s`` (mean over the interval since the last row), ``examples_per_s``,
    ``tokens_per_s`` and ``tokens`` (tokens seen) for sequence tasks, and ``data_wait``
    (the share of the interval spent waiting for the data). An eval row holds ``step``,
    ``time``, the ``eval_*`` metrics and ``eval_time_s``.
    """

    def __init__(self, wait: Any = None):
        self.wait = wait
        self._last_time = self._last_step = None

    def on_start(self, ctx: Context) -> None:
        self._last_time, self._last_step = time.perf_counter(), ctx.first_step - 1

    def _write(self, ctx: Context, row: dict[str, Any]) -> None:
        ctx.rows.append(row)
        if ctx.run_dir is not None:
            with open(Path(ctx.run_dir) / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        if not ctx.is_log_step(step):
            return
        now = time.perf_counter()
        steps = step - self._last_step
        dt = (now - self._last_time) / steps
        batch = ctx.config.train.batch_size
        row = {"step": step, **metrics, "time": ctx.elapsed(), "step_time_s": dt,
               "examples_per_s": batch / dt}
        per_example = ctx.run.trainer.task.tokens_per_example
        if per_example:
            row["tokens_per_s"] = batch * per_example / dt
            row["tokens"] = step * batch * per_example
        if self.wait is not None:
            row["data_wait"] = self.wait.fraction(now - self._last_time, steps, ctx.config)
        self._write(ctx, row)
        self._last_time, self._last_step = time.perf_counter(), step

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        self._write(ctx, {"step": step, "time": ctx.elapsed(), **metrics})
        # evaluation time is not training time: the next interval starts after it
        self._last_time = time.perf_counter()


class TensorBoard(Hook):
    """The logged rows' scalars as TensorBoard events in ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as err:
            raise ValueError("train.tensorboard=true needs tensorboardX: "
                             "pip install 'jaxpar[tensorboard]'") from err
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def _scalars(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) \
                    and math.isfinite(value):
                self.writer.add_scalar(key, value, row["step"])

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        if ctx.rows and ctx.rows[-1]["step"] == step and "loss" in ctx.rows[-1]:
            self._scalars(ctx.rows[-1])

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        self._scalars({"step": step, **metrics})

    def on_end(self, ctx: Context) -> None:
        self.writer.close()


class NonFiniteGuard(Hook):
    """Stops the run at the first step whose loss or gradients were not finite, when
    ``train.nonfinite=stop``. (The step itself never applies such an update.)"""

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        if not metrics["finite"] and ctx.config.train.nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss or gradients at step {step} (loss={metrics['loss']}, "
                f"grad_norm={metrics['grad_norm']}); the update was not applied. Lower "
                "optim.lr, set optim.clip_norm, or set train.nonfinite=skip to skip such steps")
