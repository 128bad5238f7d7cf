"""The hook protocol and the loop context hooks see.

:func:`jaxpar.loop.fit` is a loop: fetch a batch, run the step, and call the hooks.
Everything else — the metrics file, the progress display, TensorBoard, evaluation,
checkpoints, the profiler, the non-finite guard — is a hook on this protocol, and a
user's hook is one more (passed to :func:`jaxpar.train` or named in ``train.hooks``).

Events, in the order the loop raises them for step ``n``:

1. ``before_step(ctx, n)`` — before step ``n`` fetches its batch.
2. ``on_state(ctx, n)`` — step ``n`` is dispatched; ``ctx.state`` is the state after it
   (its arrays may still be computing: reading them waits for the device).
3. ``on_step(ctx, n - 1, metrics)`` — the previous step's metrics as Python numbers. The
   host reads them while step ``n`` runs, so no hook forces a device sync on the hot
   path; the last step's metrics (and those of a step a hook needs the state of) are
   delivered before the loop ends or before that hook runs. Every step is delivered
   exactly once, in order.
4. ``on_eval(ctx, n, metrics)`` — held-out metrics (``eval_*``), when evaluated.
5. ``on_save(ctx, n)`` — a checkpoint of step ``n`` was started (written in the
   background).

plus ``on_start(ctx)`` before the first step and ``on_end(ctx)`` after the last, also
when the loop stops early (``ctx.error`` then holds the exception).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from jaxpar import run as run_lib
from jaxpar.errors import JaxparError, UserCodeFailed, code_name, is_own
from jaxpar.run import Run
from jaxpar.state import TrainState


class Hook:
    """A loop extension: override the events you need (every one is a no-op here).

    Example — send every step's loss to your own tracker::

        class Tracker(jaxpar.Hook):
            def on_step(self, ctx, step, metrics):
                my_tracker.log({"loss": metrics["loss"]}, step=step)
    """

    def on_start(self, ctx: Context) -> None:
        """Before the first step (``ctx.first_step``)."""

    def before_step(self, ctx: Context, step: int) -> None:
        """Before ``step`` fetches its batch."""

    def on_state(self, ctx: Context, step: int) -> None:
        """``step`` is dispatched; ``ctx.state`` is the state after it."""

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        """``step``'s metrics as Python numbers (``loss``, ``grad_norm``, ``lr`` when
        known, ``finite``, ``skipped`` and the task's own), one step late."""

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        """Held-out metrics of the state after ``step`` (keys ``eval_*``)."""

    def on_save(self, ctx: Context, step: int) -> None:
        """A checkpoint of ``step`` was started."""

    def on_end(self, ctx: Context) -> None:
        """After the loop, also when it stopped early (``ctx.error`` is then set)."""


@dataclass
class Context:
    """What the loop shares with its hooks.

    Attributes:
      run: the run (config, plan, trainer, data).
      run_dir: where files go (None on processes other than 0).
      state: the latest train state.
      first_step, last_step: the steps this loop runs (``last_step`` = ``train.steps``).
      stream: the training data stream (``get_state()`` is its position).
      hooks: every hook, in calling order.
      stopping: set when the run must stop after the current step (preemption).
      error: the exception that ended the loop early, if any.
      rows: the rows logged so far (``metrics.jsonl``'s content).
    """

    run: Run
    run_dir: Path | None
    state: TrainState
    first_step: int
    last_step: int
    stream: Any
    hooks: list[Hook]
    stopping: bool = False
    error: BaseException | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    start_time: float = field(default_factory=time.perf_counter)
    #: the step the loop is on, and its metrics as device arrays
    current_step: int = 0
    step_metrics: dict[str, jax.Array] = field(default_factory=dict)
    #: (step, device metrics) not yet delivered to ``on_step``
    pending: list[tuple[int, dict[str, jax.Array]]] = field(default_factory=list)
    #: seconds the loop spent on other work than training, by kind (``eval``, ``checkpoint``)
    paused: dict[str, float] = field(default_factory=dict)
    _evals: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def config(self) -> Any:
        return self.run.config

    def emit(self, event: str, *args: Any) -> None:
        """Calls ``event`` on every hook, in order. An exception a user's hook raises
        names the hook, the event and the step (:class:`~jaxpar.errors.UserCodeFailed`)."""
        for hook in self.hooks:
            method = getattr(hook, event, None)  # a hook may define only the events it needs
            if method is None:
                continue
            if is_own(hook):
                method(self, *args)
                continue
            try:
                method(self, *args)
            except JaxparError:
                raise
            except Exception as err:
                step = args[0] if args else self.current_step
                at = f"at step {step}" if step else "before the first step"
                raise UserCodeFailed(f"hook {code_name(hook)}.{event}", err, at) from err

    def flush(self) -> None:
        """Delivers every pending step's metrics to ``on_step`` now (a host sync)."""
        while self.pending:
            step, metrics = self.pending.pop(0)
            self.emit("on_step", step, run_lib.host_metrics(metrics))

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics of the current state (the state after ``step``), computed once
        per step however many hooks ask, and announced with ``on_eval``."""
        if step not in self._evals:
            self.flush()  # rows stay in step order
            start = time.perf_counter()
            evals = {f"eval_{k}": v for k, v in run_lib.evaluate(self.run, self.state).items()}
            self._evals = {step: evals}
            seconds = time.perf_counter() - start
            self.pause("eval", seconds)
            self.emit("on_eval", step, {**evals, "eval_time_s": seconds})
        return self._evals[step]

    @property
    def can_evaluate(self) -> bool:
        return bool(getattr(self.run.data, "has_eval", True))

    def is_log_step(self, step: int) -> bool:
        """Rows are logged at step 1, every ``train.log_every``, the last step and a stop."""
        cfg = self.config.train
        return (
            step == 1
            or step % cfg.log_every == 0
            or step == self.last_step
            or (self.stopping and step == self.current_step)
        )

    def pause(self, kind: str, seconds: float) -> None:
        """Records ``seconds`` spent on ``kind`` of work other than training steps (left
        out of the step time and the throughput)."""
        self.paused[kind] = self.paused.get(kind, 0.0) + seconds

    def elapsed(self) -> float:
        """Seconds since the loop started."""
        return time.perf_counter() - self.start_time
