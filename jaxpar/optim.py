"""Optax optimizer chain and learning-rate schedules built from ``OptimConfig``.

The public entry points are:

* :func:`make_schedule` - linear warmup followed by constant, cosine, linear,
  StepLR or inverse-square-root decay.
* :func:`decay_mask` - which parameters get weight decay (matrix-like ones only).
* :func:`make_optimizer` - optional global-norm clipping, then the optimizer.

Gradient accumulation is deliberately not done here: the train step owns it, so
the optimizer always sees one (already averaged) gradient per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from pydantic import Field, field_validator, model_validator

from jaxpar.errors import ConfigError, TaskError
from jaxpar.logical import LAYERS
from jaxpar.schema import FLOAT32_MAX, Float, Float32, section

#: ``optim.name`` values.
Optimizer = Literal["sgd", "adam", "adamw", "lamb", "adafactor"]
#: ``optim.schedule`` values (after the warmup).
Schedule = Literal["constant", "cosine", "linear", "step", "rsqrt"]
OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)

Mask = Any  # a pytree of bools (a prefix of the params tree) or a callable


@section("optim")
class OptimConfig:
    """Optax chain: optimizer, learning-rate schedule, clipping, weight decay.

    Every schedule starts with ``warmup_steps`` of linear warmup from 0. Weight decay never
    applies to 1-D parameters.
    """

    name: Optimizer = Field(
        "adamw", description="the optimizer (adam has no weight decay: use adamw for it)"
    )
    lr: Float32 = Field(3e-3, gt=0, description="peak learning rate")
    warmup_steps: Float = Field(
        20,
        ge=0,
        description="steps of linear warmup from 0 (below 1: "
        "that fraction of the run; longer than the run: clamped, with "
        "a warning)",
    )
    schedule: Schedule = Field("cosine", description="the learning rate after the warmup")
    decay_steps: int = Field(
        0, ge=0, description="cosine/linear decay length (0: until the last training step)"
    )
    min_lr_ratio: Float32 = Field(
        0.1, ge=0, le=1, description="cosine/linear decay ends at lr × min_lr_ratio"
    )
    step_every: int = Field(1000, gt=0, description="step schedule: decay every this many steps")
    step_gamma: Float32 = Field(
        0.1, gt=0, le=1, description="step schedule: the factor of each decay"
    )
    momentum: Float32 = Field(0.9, ge=0, lt=1, description="sgd's momentum (0: none)")
    nesterov: bool = Field(False, description="sgd: Nesterov momentum")
    b1: Float32 = Field(0.9, ge=0, lt=1, description="first-moment decay (adam, adamw, lamb)")
    b2: Float32 = Field(0.95, ge=0, lt=1, description="second-moment decay (adam, adamw, lamb)")
    eps: Float32 = Field(1e-8, ge=0, description="denominator epsilon (adam, adamw, lamb)")
    weight_decay: Float32 = Field(
        0.1,
        ge=0,
        description="decoupled for adamw, lamb and adafactor, L2 for sgd; must be 0 for adam",
    )
    clip_norm: Float32 = Field(1.0, ge=0, description="global-norm gradient clipping (0: off)")

    @field_validator("warmup_steps")
    @classmethod
    def _whole_or_fraction(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ConfigError(
                f"config key 'optim.warmup_steps' must be a whole number of "
                f"steps, or a fraction of the run below 1, got {value!r}; set "
                "e.g. optim.warmup_steps=20 or optim.warmup_steps=0.1"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> OptimConfig:
        if self.name == "sgd" and self.nesterov and self.momentum == 0:
            raise ConfigError(
                "config key 'optim.nesterov' needs optim.momentum > 0 with "
                "optim.name=sgd; set optim.momentum (e.g. 0.9) or "
                "optim.nesterov=false"
            )
        if self.lr * self.weight_decay > FLOAT32_MAX:
            raise ConfigError(
                f"config keys 'optim.lr'={self.lr:g} × 'optim.weight_decay'="
                f"{self.weight_decay:g} overflow float32 (the decay step lr × weight_decay × "
                "parameter would be inf); lower one of them"
            )
        return self

    def check_weight_decay(self) -> None:
        """Raises for ``weight_decay`` > 0 with ``adam``. Checked when the optimizer is built,
        not with the other rules: ``optim.name=adam`` alone (the default weight decay is
        0.1) must load, so that the error names the key to change."""
        if self.name == "adam" and self.weight_decay > 0:
            raise ConfigError(
                f"config key 'optim.weight_decay' must be 0 with optim.name=adam (Adam has no "
                f"decoupled weight decay), got {self.weight_decay!r}; use optim.name=adamw for "
                "weight decay, or set optim.weight_decay=0"
            )


# --------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------


def _decay_length(cfg: OptimConfig, total_steps: int) -> int:
    """Steps over which cosine/linear decay runs after warmup."""
    if cfg.decay_steps > 0:
        return cfg.decay_steps
    # Decay exactly until the last training step; at least 1 so optax's
    # schedules never divide by zero.
    return max(total_steps - cfg.warmup_steps, 1)


def _rsqrt_after_warmup(lr: float, warmup_steps: int) -> optax.Schedule:
    """Inverse-sqrt decay as a function of steps since the end of warmup."""
    ref = float(max(warmup_steps, 1))

    def schedule(count: jax.Array) -> jax.Array:
        # join_schedules passes steps relative to the boundary; rsqrt is
        # defined on the absolute step, so shift back.
        step = jnp.asarray(count, jnp.float32) + warmup_steps
        return lr * jnp.sqrt(ref / jnp.maximum(step, ref))

    return schedule


def _after_warmup(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The schedule that starts at ``cfg.lr`` when warmup ends (relative steps)."""
    lr = cfg.lr
    if cfg.schedule == "constant":
        return optax.constant_schedule(lr)
    if cfg.schedule == "cosine":
        length = _decay_length(cfg, total_steps)
        return optax.cosine_decay_schedule(lr, length, alpha=cfg.min_lr_ratio)
    if cfg.schedule == "linear":
        length = _decay_length(cfg, total_steps)
        return optax.linear_schedule(lr, lr * cfg.min_lr_ratio, length)
    if cfg.schedule == "step":
        return optax.exponential_decay(lr, cfg.step_every, cfg.step_gamma, staircase=True)
    return _rsqrt_after_warmup(lr, cfg.warmup_steps)


@contextlib.contextmanager
def schedule_unread() -> Iterator[None]:
    """For a command that reads a run's weights and trains nothing (``export``,
    ``sample``, ``eval``): the schedule's warnings, which speak of training, are left
    unsaid."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"optim\.warmup_steps=.* is not shorter than")
        yield


def resolve_warmup(cfg: OptimConfig, total_steps: int) -> int:
    """Warmup steps for a run of ``total_steps``: ``warmup_steps`` below 1 is a fraction of
    the run (rounded); a warmup that would leave a decaying schedule no step to decay in is
    clamped to ``total_steps - 1``, with a warning saying so."""
    w = cfg.warmup_steps
    steps = round(w * total_steps) if 0 < w < 1 else int(w)
    if cfg.schedule != "constant" and steps >= total_steps:
        clamped = max(total_steps - 1, 0)
        warnings.warn(
            f"optim.warmup_steps={w:g} is not shorter than train.steps={total_steps}: "
            f"warming up for {clamped} steps instead (set optim.warmup_steps, e.g. "
            "0.1 for a tenth of the run)",
            stacklevel=3,
        )
        steps = clamped
    return steps


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the optimizer step count.

    With ``w`` the warmup steps (:func:`resolve_warmup`: ``cfg.warmup_steps``, or that
    fraction of ``total_steps`` when below 1), ``lr = cfg.lr`` and ``t`` the step count:

    * ``t < w``: linear warmup, ``lr * t / w`` (so step 0 uses lr 0).
    * ``t >= w``, with ``s = t - w`` and ``D = cfg.decay_steps`` or, when that
      is 0, ``max(total_steps - w, 1)``:

      - ``constant``: ``lr``.
      - ``cosine``: ``lr * (r + (1 - r) * 0.5 * (1 + cos(pi * min(s, D) / D)))``
        with ``r = cfg.min_lr_ratio``; it then stays at ``lr * r``.
      - ``linear``: ``lr * (1 - (1 - r) * min(s, D) / D)``.
      - ``step`` (StepLR): ``lr * cfg.step_gamma ** floor(s / cfg.step_every)``.
      - ``rsqrt``: ``lr * sqrt(max(w, 1) / max(t, w, 1))``; this equals ``lr``
        at the end of warmup (continuous) and ``lr * sqrt(w / t)`` after it.
        ``min_lr_ratio`` does not floor ``step`` or ``rsqrt``.

    Args:
      cfg: the optimizer config.
      total_steps: number of training (optimizer) steps, ``train.steps``.

    Returns:
      An optax schedule, usable inside ``jit``.

    Raises:
      ConfigError: for ``total_steps`` below 1 (``cfg`` was checked when it was built).
    """
    if not total_steps >= 1:
        raise ConfigError(
            f"total_steps must be >= 1, got {total_steps!r}; set train.steps to a positive count"
        )
    cfg = dataclasses.replace(cfg, warmup_steps=resolve_warmup(cfg, total_steps))
    after = _after_warmup(cfg, total_steps)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], boundaries=[cfg.warmup_steps])


# --------------------------------------------------------------------------
# Weight-decay mask
# --------------------------------------------------------------------------


def _is_param_leaf(x: Any) -> bool:
    # Arrays, ShapeDtypeStructs and nnx.Variable all expose `.shape`; stopping
    # at Variables keeps the mask a prefix of both raw and Variable-wrapped trees.
    return hasattr(x, "shape")


def _ndim(param: Any) -> int:
    return len(param.shape) if hasattr(param, "shape") else jnp.ndim(param)


def _matrix_like(names: Any, param: Any) -> bool:
    """True when a parameter has >= 2 dims besides the stacked-layers dim."""
    if names is None:
        return _ndim(param) >= 2
    if not isinstance(names, (tuple, list)):
        raise TaskError(
            f"decay_mask: logical axes must be a tuple of names per parameter, got {names!r}"
        )
    # None entries are unnamed (unsharded) dimensions and still count.
    return sum(1 for name in names if name != LAYERS) >= 2


def decay_mask(params: Any, axes: Any = None) -> Any:
    """Which parameters get weight decay: only matrix-like ones.

    Biases, norm scales and other vectors are never decayed, even when a
    stacked-layers transform gives them a leading ``layers`` dimension
    (``[L, D]`` is a stack of vectors, not a matrix).

    Args:
      params: a pytree of parameters (arrays, ``ShapeDtypeStruct`` or
        ``nnx.Variable`` leaves), e.g. a dict of dicts.
      axes: ``None``, or a pytree with the structure of ``params`` whose leaf
        per parameter is a tuple of logical axis names, e.g.
        ``("layers", "embed", "mlp")``. A parameter is matrix-like when it has
        at least 2 names other than ``"layers"``. With ``None`` the rule is
        ``ndim >= 2`` (a stacked ``[L, D]`` vector then counts as a matrix).

    Returns:
      A pytree of Python bools with one leaf per parameter (``True``: decay),
      usable as the ``mask`` of :func:`make_optimizer` / ``optax.masked``.

    Raises:
      TaskError: if ``axes`` does not match the structure of ``params``.
    """
    if axes is None:
        return jax.tree.map(lambda p: _matrix_like(None, p), params, is_leaf=_is_param_leaf)
    try:
        # params leads, so a whole tuple of names arrives as one argument.
        return jax.tree.map(lambda p, a: _matrix_like(a, p), params, axes, is_leaf=_is_param_leaf)
    except (ValueError, TypeError) as err:
        if "decay_mask" in str(err):
            raise
        raise TaskError(
            f"decay_mask: axes must have the same structure as params "
            f"(one tuple of logical axis names per parameter): {err}"
        ) from err


# --------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------


def _default_mask(params: Any) -> Any:
    return decay_mask(params, None)


def _sgd(cfg: OptimConfig, lr: jax.Array, mask: Mask) -> optax.GradientTransformation:
    # Coupled L2 (torch.optim.SGD style): decay is added to the gradient before
    # momentum and the lr scaling, so it is scaled by lr like the gradient.
    parts = []
    if cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=mask))
    momentum = cfg.momentum if cfg.momentum > 0 else None  # None: plain SGD, no state
    parts.append(optax.sgd(lr, momentum=momentum, nesterov=cfg.nesterov))
    return optax.chain(*parts)


def _base_optimizer(cfg: OptimConfig, lr: jax.Array, mask: Mask) -> optax.GradientTransformation:
    """The optimizer named by ``cfg.name`` at learning rate ``lr`` (this step's)."""
    if cfg.name == "sgd":
        return _sgd(cfg, lr, mask)
    if cfg.name == "adam":
        return optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if cfg.name == "adamw":
        return optax.adamw(
            lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
        )
    if cfg.name == "lamb":
        return optax.lamb(
            lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
        )
    # Adafactor keeps its own defaults for b2-like decay, eps and momentum:
    # cfg.b2/eps/momentum are tuned for Adam/SGD and would be wrong here.
    return optax.adafactor(
        learning_rate=lr,
        # Scale decay by the lr so it is decoupled like AdamW (lr·wd·p); optax adds it
        # after the lr scaling, where a bare rate would remove wd·p every step.
        weight_decay_rate=cfg.weight_decay * lr if cfg.weight_decay else None,
        weight_decay_mask=mask,
    )


def _scheduled(
    cfg: OptimConfig, schedule: optax.Schedule, mask: Mask
) -> optax.GradientTransformation:
    """The optimizer with ``optax.inject_hyperparams`` evaluating ``schedule`` at its own
    update count: the optimizer state records the rate each update applied, so ``lr`` is
    logged from the state wherever the chain ends up (inside ``optax.MultiSteps``, a
    ``masked`` or a user's ``chain``), the count excluding skipped steps and the
    accumulating steps of ``MultiSteps``."""

    def factory(learning_rate: jax.Array) -> optax.GradientTransformation:
        return _base_optimizer(cfg, learning_rate, mask)

    return optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(learning_rate=schedule)


def make_optimizer(
    cfg: OptimConfig, total_steps: int, mask: Mask = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds ``clip_by_global_norm`` (if ``cfg.clip_norm > 0``) then the optimizer.

    Weight decay per optimizer:

    * ``sgd``: coupled L2, ``g + wd * p`` before momentum and lr scaling.
    * ``adam``: none; ``weight_decay > 0`` is an error (use ``adamw``).
    * ``adamw`` / ``lamb``: decoupled, the update includes ``-lr * wd * p``.
    * ``adafactor``: decoupled like adamw, ``-lr(t) * wd * p`` per step.
      Adafactor ignores ``b1``, ``b2``, ``eps`` and ``momentum``.

    Args:
      cfg: the optimizer config.
      total_steps: number of optimizer steps (``train.steps``), for the schedule.
      mask: weight-decay mask, a pytree of bools that is a prefix of the params
        tree (see :func:`decay_mask`) or a callable params -> such a pytree.
        ``None`` means :func:`decay_mask` with ``axes=None`` (``ndim >= 2``).

    Returns:
      ``(tx, schedule)``: the gradient transformation and the lr schedule. The
      optimizer's state records the rate of its last update
      (``optax.inject_hyperparams``), which a run logs as ``lr`` (:func:`injected_lr`),
      also when ``tx`` is wrapped (``optax.MultiSteps(tx, k)``) or chained.

    Raises:
      ConfigError: for ``total_steps`` below 1, or weight decay with ``adam``.
    """
    cfg.check_weight_decay()
    schedule = make_schedule(cfg, total_steps)
    mask = _default_mask if mask is None else mask
    parts = []
    if cfg.clip_norm > 0:
        # Clip the raw gradient, before any optimizer statistics see it.
        parts.append(clip_by_global_norm(cfg.clip_norm))
    parts.append(_scheduled(cfg, schedule, mask))
    return optax.chain(*parts), schedule


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` (the same numbers) that also takes the norm as the
    extra argument ``global_norm``: an update that sees part of the model (one pipeline
    stage's parameters, ``jaxpar/pipeline/mpmd.py``) then clips by the whole model's."""

    def update(
        updates: Any, state: Any, params: Any = None, *, global_norm: Any = None, **extra: Any
    ) -> tuple[Any, Any]:
        del params, extra
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        trigger = jnp.squeeze(norm < max_norm)

        def clip(t: jax.Array) -> jax.Array:
            return jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def injected_lr(opt_state: Any) -> jax.Array | None:
    """The learning rate ``optax.inject_hyperparams`` recorded in ``opt_state`` (the one
    the last update used; :func:`make_optimizer`'s chain records it), or None when there
    is not exactly one."""
    found = [
        v
        for _, v in optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
        if getattr(v, "shape", None) == ()
    ]
    return found[0] if len(found) == 1 else None
