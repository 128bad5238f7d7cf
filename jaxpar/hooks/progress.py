"""The progress display: a bar on a terminal, one plain line per log interval elsewhere.

Under SLURM, ``nohup`` or any redirected output stdout is not a terminal and a progress
bar would print nothing until the end; there a line per logged row (and per
evaluation) goes to stdout instead, flushed as written, so a batch job's log shows the
run as it goes.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from jaxpar.hooks.base import Context, Hook


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _rate(row: dict[str, Any]) -> str:
    return (
        f"{row['tokens_per_s']:,.0f} tok/s"
        if "tokens_per_s" in row
        else f"{row['examples_per_s']:,.1f} ex/s"
    )


class Progress(Hook):
    """Shows the run's progress on process 0 (a ``tqdm`` bar on a terminal, else lines)."""

    def __init__(self, stream: Any = None):
        self.stream = stream
        self.bar = None
        self.terminal = False
        self.timed = False  # whether a row has been shown: the first one's time has compiles

    def on_start(self, ctx: Context) -> None:
        if jax.process_index() != 0:
            return
        out = self.stream or sys.stdout
        self.terminal = bool(getattr(out, "isatty", lambda: False)())
        if self.terminal:
            from tqdm import tqdm

            # no monitor thread: the bar is updated every step, and a stop signal that
            # lands while tqdm starts the thread would be caught there, as a warning
            tqdm.monitor_interval = 0
            self.bar = tqdm(
                total=ctx.last_step,
                initial=ctx.first_step - 1,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def _say(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        if jax.process_index() != 0:
            return
        row = (
            ctx.rows[-1]
            if ctx.rows and ctx.rows[-1]["step"] == step and "loss" in ctx.rows[-1]
            else None
        )
        if self.bar is not None:
            self.bar.update(1)
            if row is not None:
                self.bar.set_postfix_str(f"loss {row['loss']:.4f}, {_rate(row)}")
            return
        if row is None:
            return
        parts = [f"step {step}/{ctx.last_step}", f"loss {row['loss']:.4f}"]
        if "lr" in row:
            parts.append(f"lr {row['lr']:.3g}")
        parts.append(_rate(row))
        if "data_wait" in row:
            parts.append(f"data wait {row['data_wait']:.0%}")
        if self.timed:  # the first interval holds the step's compilation: no estimate
            parts.append(f"ETA {_duration((ctx.last_step - step) * row['step_time_s'])}")
        self.timed = True
        self._say("  ".join(parts))

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        if jax.process_index() != 0 or self.bar is not None:
            return
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "eval_time_s")
        self._say(f"eval at step {step}: {shown}  ({metrics['eval_time_s']:.1f} s)")

    def on_end(self, ctx: Context) -> None:
        if self.bar is not None:
            self.bar.close()
