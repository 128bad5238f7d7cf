"""A JAX profiler trace of the steps ``train.profile_steps`` names."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax

from jaxpar import config as config_lib
from jaxpar.hooks.base import Context, Hook


def _warn_profile_span(cfg: config_lib.TrainConfig, has_run_dir: bool) -> None:
    """Warns when ``train.profile_steps`` traces less than it names, or nothing."""
    start, stop = config_lib.parse_profile_steps(cfg.profile_steps)
    setting = f"train.profile_steps={cfg.profile_steps!r}"
    if not has_run_dir:
        message = f"{setting} has no effect without a run dir: pass run_dir to fit()"
    elif start > cfg.steps:
        message = (
            f"{setting} has no effect: it starts after the last step (train.steps="
            f"{cfg.steps}); lower START to trace"
        )
    elif stop > cfg.steps + 1:
        message = (
            f"{setting} reaches past the last step (train.steps={cfg.steps}): steps "
            f"{start} to {cfg.steps} are traced, until the end of the run"
        )
    else:
        return
    warnings.warn(message, stacklevel=4)


class Profiler(Hook):
    """Traces the steps ``train.profile_steps`` names into ``<run.dir>/profile``.

    The trace starts before the first traced step fetches its batch and stops once the
    last traced step's device work is done (its logging, evaluation and checkpoint are
    left out). Without a run dir (processes other than 0) nothing is traced.
    """

    def __init__(self, run_dir: Path | None, cfg: config_lib.TrainConfig):
        span = config_lib.parse_profile_steps(cfg.profile_steps)
        self.directory = Path(run_dir) / "profile" if run_dir is not None and span else None
        self.start, self.stop = span or (0, 0)
        self.active = False
        if span and jax.process_index() == 0:
            _warn_profile_span(cfg, run_dir is not None)
        self.stop = min(self.stop, cfg.steps + 1)

    def before_step(self, ctx: Context, step: int) -> None:
        """Starts the trace when ``step`` is the first traced one (or a resumed run's first)."""
        if self.directory is not None and not self.active and self.start <= step < self.stop:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def on_state(self, ctx: Context, step: int) -> None:
        """Stops the trace after the last traced step, once its device work is done."""
        if self.active and step + 1 >= self.stop:
            jax.block_until_ready(ctx.state)
            self.on_end(ctx)

    def on_end(self, ctx: Context) -> None:
        """Stops (and writes) the trace if it is running — also when the run ends early."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
