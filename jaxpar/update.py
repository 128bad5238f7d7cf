"""The optimizer half of a train step: the update, the non-finite check, the guard that
keeps the old state of a bad step, and the step's metrics.

:class:`Update` is what a gradient strategy composes with its loss and gradients into the
train step (:meth:`jaxpar.gradients.Traced.build_step`); the sub-mesh executor
(:mod:`jaxpar.pipeline.mpmd`) runs its pieces on each stage's share of the state, with
the gradient norm and the finiteness of the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar import guard
from jaxpar.optim import injected_lr
from jaxpar.state import TrainState


def optimizer_update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    global_norm: jax.Array | None = None,
) -> tuple[Any, Any]:
    """New parameters and optimizer state. ``global_norm``: the gradient norm of the whole
    model, for an update that sees only part of it (jaxpar's clipping reads it)."""
    extra = {} if global_norm is None else {"global_norm": global_norm}
    updates, opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state


@dataclass(frozen=True)
class Update:
    """The optimizer step: ``tx`` updates, ``keep`` (:mod:`jaxpar.guard`) keeps the old
    state when anything is not finite. ``offloaded``: the shardings of an optimizer state
    held in host memory between steps (``train.optimizer_offload``), moved to the devices
    for the update and back for the step's output; None: held on the devices."""

    tx: optax.GradientTransformation
    keep: guard.Keep
    offloaded: Any = None

    def __call__(
        self, state: TrainState, loss: jax.Array, aux: dict, grads: Any, model_state: Any
    ) -> tuple[TrainState, dict]:
        """The state after the step and its metrics (traceable)."""
        state = self._moved(state, to_device=True)
        grad_norm = optax.tree.norm(grads)

        def update() -> dict[str, Any]:
            params, opt_state = optimizer_update(self.tx, grads, state.opt_state, state.params)
            return {"params": params, "opt_state": opt_state, "model_state": model_state}

        # The loss and the gradient norm miss what the optimizer makes of finite gradients
        # (a huge lr or weight decay, a user's transformation): the new parameters are
        # checked too, reduced on device with the rest (no host sync); the guard keeps
        # the old state when anything is not finite (jaxpar/guard.py).
        new = update()
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & guard.all_finite(new["params"])
        kept = self.keep(finite, new, update, old_parts(state))
        new_state = advance(state, kept, finite)
        metrics = self.metrics(new_state, new["opt_state"], loss, grad_norm, finite, aux)
        return self._moved(new_state, to_device=False), metrics

    def _moved(self, state: TrainState, to_device: bool) -> TrainState:
        """``state`` with an offloaded optimizer state moved to device memory, or back to
        where it is held between steps."""
        if self.offloaded is None:
            return state
        to = self.offloaded
        if to_device:
            to = jax.tree.map(lambda s: s.with_memory_kind("device"), to)
        return replace(state, opt_state=jax.device_put(state.opt_state, to))

    def metrics(
        self,
        new_state: TrainState,
        new_opt_state: Any,
        loss: jax.Array,
        grad_norm: jax.Array,
        finite: jax.Array,
        aux: dict,
    ) -> dict:
        """The step's metrics; ``lr`` is the rate ``inject_hyperparams`` recorded for the
        step's update (jaxpar's optimizers record it), when there is one."""
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "finite": finite,
            "skipped": new_state.skipped,
            **aux,
        }
        lr = injected_lr(new_opt_state)
        if lr is not None:
            metrics["lr"] = jnp.asarray(lr, jnp.float32)
        return metrics


def old_parts(state: TrainState) -> dict[str, Any]:
    """The parts of ``state`` a step replaces (what the guard keeps of a bad step)."""
    return {"params": state.params, "opt_state": state.opt_state, "model_state": state.model_state}


def advance(state: TrainState, kept: dict[str, Any], finite: jax.Array) -> TrainState:
    """The state after a step that kept ``kept`` (a non-finite step counted)."""
    return TrainState(
        state.step + 1,
        kept["params"],
        kept["opt_state"],
        state.skipped + (~finite).astype(jnp.int32),
        kept["model_state"],
    )
