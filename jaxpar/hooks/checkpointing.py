"""Checkpoints every ``checkpoint.every_steps``, after the last step and at a preemption."""

from __future__ import annotations

import time

from jaxpar.checkpoint import Checkpointer
from jaxpar.hooks.base import Context, Hook
from jaxpar.hooks.evaluation import is_eval_step
from jaxpar.resume import save_checkpoint


class Checkpointing(Hook):
    """Saves the state after each checkpoint step with the loader's position, the seed,
    the step's metrics and the config (see :func:`jaxpar.resume.save_checkpoint`).

    With ``checkpoint.keep_best`` every save is evaluated (the metric ranks the
    checkpoints). After a preemption the save is waited for, so it is complete before
    the process exits.
    """

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def on_state(self, ctx: Context, step: int) -> None:
        every = ctx.config.checkpoint.every_steps
        if not ((every and step % every == 0) or step == ctx.last_step or ctx.stopping):
            return
        evals = None
        if self.ckpt.best_metric or (ctx.can_evaluate and is_eval_step(step, ctx.config.train)):
            evals = ctx.evaluate(step)
        # the step's row first: waiting for the step to finish is its time, not the save's
        ctx.flush()
        start = time.perf_counter()
        save_checkpoint(
            ctx.run, self.ckpt, step, ctx.state, ctx.step_metrics, ctx.stream.get_state(), evals
        )
        ctx.pause("checkpoint", time.perf_counter() - start)  # the copy to host; the write
        ctx.emit("on_save", step)  # goes on in the background
        if ctx.stopping:
            self.ckpt.wait()
