"""Evaluation every ``train.eval_every`` steps and after the last step."""

from __future__ import annotations

from jaxpar.hooks.base import Context, Hook


def is_eval_step(step: int, cfg: object) -> bool:
    """Whether ``step`` evaluates (every ``train.eval_every`` and the last step)."""
    return bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)


class Evaluation(Hook):
    """Evaluates the state after each eval step on ``train.eval_batches`` held-out batches
    in NNX's evaluation mode (no dropout, BatchNorm's running averages)."""

    def on_start(self, ctx: Context) -> None:
        """Held-out data that cannot give a batch is refused before the first step, not
        after ``train.eval_every`` steps of training (its ``train.eval_batches`` batches,
        made once: every evaluation reads them)."""
        cfg = ctx.config.train
        if ctx.can_evaluate and cfg.eval_every and ctx.first_step <= ctx.last_step:
            ctx.run.data.batch(cfg.eval_batches - 1, cfg.batch_size, "eval")

    def on_state(self, ctx: Context, step: int) -> None:
        if ctx.can_evaluate and is_eval_step(step, ctx.config.train):
            ctx.evaluate(step)
