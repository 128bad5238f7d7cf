"""Hooks on the step metrics: the rows of ``metrics.jsonl``, TensorBoard, the non-finite
guard."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from jaxpar.data.mixture import tokens_by_source
from jaxpar.errors import ConfigError, NonFiniteStop, TooManySkipped
from jaxpar.hooks.base import Context, Hook


class MetricsLog(Hook):
    """Makes a row at every log step (``ctx.rows``) and appends it to
    ``<run_dir>/metrics.jsonl`` when there is a run dir.

    A train row holds the step's metrics, ``time`` (seconds since the loop started),
    ``step_time_s`` (mean over the interval since the last row, evaluation and checkpoint
    time left out: see :meth:`Context.pause`), ``examples_per_s``,
    ``tokens_per_s`` and ``tokens`` (tokens seen) for sequence tasks (for a mixture also
    ``tokens/<source>``, each source's share of them), and ``data_wait``
    (the share of the interval spent waiting for the data). An eval row holds ``step``,
    ``time``, the ``eval_*`` metrics and ``eval_time_s``.
    """

    def __init__(self, wait: Any = None):
        self.wait = wait
        self._last_time = self._last_step = None
        self._paused = 0.0

    def on_start(self, ctx: Context) -> None:
        self._last_time = time.perf_counter()
        self._last_step = ctx.first_step - 1
        self._paused = sum(ctx.paused.values())

    def _write(self, ctx: Context, row: dict[str, Any]) -> None:
        ctx.rows.append(row)
        if ctx.run_dir is not None:
            with open(Path(ctx.run_dir) / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        if not ctx.is_log_step(step):
            return
        now = time.perf_counter()
        paused = sum(ctx.paused.values())
        steps = step - self._last_step
        interval = max(now - self._last_time - (paused - self._paused), 1e-9)
        dt = interval / steps
        batch = ctx.config.train.batch_size
        row = {
            "step": step,
            **metrics,
            "time": ctx.elapsed(),
            "step_time_s": dt,
            "examples_per_s": batch / dt,
        }
        per_example = ctx.run.plan.task.tokens_per_example
        if per_example:
            row["tokens_per_s"] = batch * per_example / dt
            row["tokens"] = step * batch * per_example
            row.update(tokens_by_source(ctx.run.data, step * batch, per_example))
        if self.wait is not None:
            row["data_wait"] = self.wait.fraction(interval, steps, ctx.config)
        self._write(ctx, row)
        self._last_time = now
        self._last_step = step
        self._paused = paused

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        self._write(ctx, {"step": step, "time": ctx.elapsed(), **metrics})


class TensorBoard(Hook):
    """The logged rows' scalars as TensorBoard events in ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path):
        self.writer = _summary_writer()(str(Path(run_dir) / "tensorboard"))

    def _scalars(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if (
                key not in ("step", "time")
                and isinstance(value, (int, float))
                and math.isfinite(value)
            ):
                self.writer.add_scalar(key, value, row["step"])

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        if ctx.rows and ctx.rows[-1]["step"] == step and "loss" in ctx.rows[-1]:
            self._scalars(ctx.rows[-1])

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        self._scalars({"step": step, **metrics})

    def on_end(self, ctx: Context) -> None:
        self.writer.close()


def _summary_writer() -> type:
    """tensorboardX's ``SummaryWriter``, imported without the torch its writer module imports
    at load time where torch is installed, only to accept torch tensors (jaxpar hands it
    floats): 3.9 s of its 4.7 s import here (``python -X importtime -c "import
    tensorboardX"``, torch 2.13), paid before a run's first step. ``torch`` stays importable
    afterwards; one imported already is left as it is."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # an `import torch` meanwhile raises ImportError
    try:
        from tensorboardX import SummaryWriter
    except ImportError as err:
        raise ConfigError(
            "train.tensorboard=true needs tensorboardX: pip install 'jaxpar[tensorboard]'"
        ) from err
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


def _what_was_not_finite(metrics: dict[str, Any]) -> str:
    if not math.isfinite(metrics["loss"]):
        return "loss"
    if not math.isfinite(metrics["grad_norm"]):
        return "gradients"
    return "update or new parameters (the loss and gradients were finite)"


def skip_budget(cfg: Any) -> int:
    """How many skipped steps ``train.max_skipped`` allows in all (0: no limit)."""
    limit = cfg.max_skipped
    if 0 < limit < 1:
        return max(1, math.ceil(limit * cfg.steps))
    return int(limit)


class NonFiniteGuard(Hook):
    """Acts on steps whose loss, gradients, update or new parameters were not finite (the
    step itself never applies them): with ``train.nonfinite=stop`` the run stops at the
    first; with ``skip`` it fails once more steps were skipped than ``train.max_skipped``
    allows in all (the run's earlier, resumed steps included) or
    ``train.max_consecutive_skipped`` in a row, naming the first skipped step."""

    def __init__(self) -> None:
        self.first: tuple[int, str] | None = None
        self.in_a_row = 0
        self.before: int | None = None  # steps skipped before this run resumed

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        cfg = ctx.config.train
        skipped = int(metrics.get("skipped", 0))
        if self.before is None:
            self.before = skipped - (not metrics["finite"])
        if metrics["finite"]:
            self.in_a_row = 0
            return
        what = _what_was_not_finite(metrics)
        if cfg.nonfinite == "stop":
            raise NonFiniteStop(
                f"non-finite {what} at step {step} (loss={metrics['loss']}, grad_norm="
                f"{metrics['grad_norm']}); the update was not applied. Lower optim.lr, set "
                "optim.clip_norm, check the data, or set train.nonfinite=skip to skip such "
                "steps"
            )
        self.in_a_row += 1
        if self.first is None:
            self.first = (step, what)
        total = skipped
        budget = skip_budget(cfg)
        over = []
        if budget and total > budget:
            share = (
                f"={cfg.max_skipped:g} of train.steps={cfg.steps}, i.e. {budget}"
                if cfg.max_skipped < 1
                else f"={budget}"
            )
            earlier = f", {self.before} of them before this run resumed" if self.before else ""
            over.append(f"{total} steps were skipped{earlier}, more than train.max_skipped{share}")
        if cfg.max_consecutive_skipped and self.in_a_row > cfg.max_consecutive_skipped:
            over.append(
                f"{self.in_a_row} steps in a row were skipped, more than "
                f"train.max_consecutive_skipped={cfg.max_consecutive_skipped}"
            )
        if over:
            first, first_what = self.first
            raise TooManySkipped(
                f"train.nonfinite=skip: {' and '.join(over)}, up to step {step}. The first "
                f"bad step of this run was {first} (non-finite {first_what}); the last "
                "checkpoint holds no skipped update. Lower optim.lr, set optim.clip_norm or "
                "check the data; or raise the limits"
            )
