"""Tests for jaxpar.optim: schedules, the weight-decay mask and the optax chain.

Expected values are computed with plain Python math, independently of optax.
Everything runs on one device.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar.config import OptimConfig as _OptimConfig
from jaxpar.optim import decay_mask, make_optimizer, make_schedule


def OptimConfig(**fields):  # noqa: N802 - stands in for the dataclass
    """An OptimConfig with no warmup and no weight decay unless a test sets them,
    so each test states every setting it relies on."""
    return _OptimConfig(**{"warmup_steps": 0, "weight_decay": 0.0, **fields})


REL = 1e-5  # float32 schedules


def lr_at(schedule: optax.Schedule, step: int) -> float:
    return float(schedule(jnp.asarray(step, jnp.int32)))


# ---------------------------------------------------------------- schedules


def test_warmup_then_constant():
    sched = make_schedule(OptimConfig(lr=2.0, warmup_steps=10, schedule="constant"), 100)
    assert lr_at(sched, 0) == 0.0
    assert lr_at(sched, 5) == pytest.approx(1.0, rel=REL)  # warmup midpoint
    assert lr_at(sched, 10) == pytest.approx(2.0, rel=REL)  # warmup end
    assert lr_at(sched, 99) == pytest.approx(2.0, rel=REL)


def test_constant_without_warmup():
    sched = make_schedule(OptimConfig(lr=0.3, warmup_steps=0, schedule="constant"), 10)
    assert [lr_at(sched, t) for t in (0, 5, 1000)] == pytest.approx([0.3] * 3, rel=REL)


def cosine_closed_form(lr: float, ratio: float, s: int, d: int) -> float:
    frac = min(s, d) / d
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def test_cosine_until_total_steps():
    lr, warm, total, ratio = 2.0, 10, 110, 0.1
    cfg = OptimConfig(lr=lr, warmup_steps=warm, schedule="cosine", min_lr_ratio=ratio)
    sched = make_schedule(cfg, total)
    d = total - warm
    assert lr_at(sched, 5) == pytest.approx(1.0, rel=REL)
    assert lr_at(sched, warm) == pytest.approx(lr, rel=REL)
    for s in (25, 50, 100):  # 25%, 50%, end of decay
        want = cosine_closed_form(lr, ratio, s, d)
        assert lr_at(sched, warm + s) == pytest.approx(want, rel=REL)
    assert lr_at(sched, warm + 50) == pytest.approx(lr * (ratio + (1 - ratio) / 2), rel=REL)
    assert lr_at(sched, total) == pytest.approx(lr * ratio, rel=REL)
    assert lr_at(sched, 10 * total) == pytest.approx(lr * ratio, rel=REL)  # stays at the floor


def test_cosine_explicit_decay_steps():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", decay_steps=40, min_lr_ratio=0.0)
    sched = make_schedule(cfg, 1000)
    assert lr_at(sched, 4 + 10) == pytest.approx(cosine_closed_form(1.0, 0.0, 10, 40), rel=REL)
    assert lr_at(sched, 4 + 20) == pytest.approx(0.5, rel=REL)
    assert lr_at(sched, 4 + 40) == pytest.approx(0.0, abs=1e-7)
    assert lr_at(sched, 500) == pytest.approx(0.0, abs=1e-7)


def test_linear_decay():
    lr, warm, total, ratio = 1.0, 20, 220, 0.25
    cfg = OptimConfig(lr=lr, warmup_steps=warm, schedule="linear", min_lr_ratio=ratio)
    sched = make_schedule(cfg, total)
    d = total - warm
    for s in (0, 50, 100, 150, 200):
        want = lr * (1 - (1 - ratio) * s / d)
        assert lr_at(sched, warm + s) == pytest.approx(want, rel=REL)
    assert lr_at(sched, 10) == pytest.approx(0.5, rel=REL)
    assert lr_at(sched, 5000) == pytest.approx(lr * ratio, rel=REL)


def test_step_lr_boundaries():
    lr, warm, every, gamma = 1.0, 5, 10, 0.5
    cfg = OptimConfig(lr=lr, warmup_steps=warm, schedule="step", step_every=every, step_gamma=gamma)
    sched = make_schedule(cfg, 1000)
    for t in (5, 14, 15, 24, 25, 34, 35, 105):
        want = lr * gamma ** math.floor((t - warm) / every)
        assert lr_at(sched, t) == pytest.approx(want, rel=REL), t
    assert lr_at(sched, 14) == pytest.approx(1.0, rel=REL)
    assert lr_at(sched, 15) == pytest.approx(0.5, rel=REL)


def test_rsqrt_continuous_after_warmup():
    lr, warm = 0.8, 16
    sched = make_schedule(OptimConfig(lr=lr, warmup_steps=warm, schedule="rsqrt"), 1000)
    assert lr_at(sched, 8) == pytest.approx(lr * 8 / 16, rel=REL)
    assert lr_at(sched, 15) == pytest.approx(lr * 15 / 16, rel=REL)
    assert lr_at(sched, 16) == pytest.approx(lr, rel=REL)  # continuous at the end of warmup
    for t in (17, 64, 400):
        assert lr_at(sched, t) == pytest.approx(lr * math.sqrt(warm / t), rel=REL)
    assert lr_at(sched, 64) == pytest.approx(lr / 2, rel=REL)


def test_rsqrt_without_warmup():
    sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=0, schedule="rsqrt"), 1000)
    for t in (0, 1, 4, 100):
        assert lr_at(sched, t) == pytest.approx(1.0 / math.sqrt(max(t, 1)), rel=REL)


def test_schedule_under_jit():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.0)
    sched = make_schedule(cfg, 110)
    got = jax.jit(sched)(jnp.asarray(60, jnp.int32))
    assert float(got) == pytest.approx(0.5, rel=REL)


# ---------------------------------------------------------------- decay mask

L, D, F, V = 3, 4, 6, 5


def stacked_params() -> tuple[dict, dict]:
    params = {
        "embed": {"embedding": jnp.ones((V, D))},
        "blocks": {
            "norm": {"scale": jnp.ones((L, D))},
            "mlp": {"kernel": jnp.ones((L, D, F)), "bias": jnp.zeros((L, F))},
        },
        "final_norm": {"scale": jnp.ones((D,))},
    }
    axes = {
        "embed": {"embedding": ("vocab", "embed")},
        "blocks": {
            "norm": {"scale": ("layers", "embed")},
            "mlp": {"kernel": ("layers", "embed", "mlp"), "bias": ("layers", "mlp")},
        },
        "final_norm": {"scale": ("embed",)},
    }
    return params, axes


def test_decay_mask_with_logical_axes():
    params, axes = stacked_params()
    mask = decay_mask(params, axes)
    assert mask == {
        "embed": {"embedding": True},
        "blocks": {"norm": {"scale": False}, "mlp": {"kernel": True, "bias": False}},
        "final_norm": {"scale": False},
    }


def test_decay_mask_without_axes_uses_ndim():
    params, _ = stacked_params()
    mask = decay_mask(params, None)
    assert mask["blocks"]["norm"]["scale"] is True  # [L, D]: ndim 2, no axis names to tell
    assert mask["blocks"]["mlp"]["kernel"] is True
    assert mask["final_norm"]["scale"] is False


def test_decay_mask_structure_mismatch():
    params, axes = stacked_params()
    del axes["final_norm"]
    with pytest.raises(ValueError, match="same structure"):
        decay_mask(params, axes)


def test_decay_mask_with_nnx_state():
    nnx = pytest.importorskip("flax.nnx")

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((D, F)))
            self.b = nnx.Param(jnp.ones((F,)))

    state = nnx.state(Tiny(), nnx.Param)
    mask = decay_mask(state, None)
    tx, _ = make_optimizer(
        OptimConfig(name="adamw", lr=0.1, weight_decay=0.5, clip_norm=0, schedule="constant"),
        10,
        mask,
    )
    grads = jax.tree.map(jnp.zeros_like, state)
    updates, _ = tx.update(grads, tx.init(state), state)
    np.testing.assert_allclose(updates["w"][...], -0.1 * 0.5 * np.ones((D, F)), rtol=1e-6)
    np.testing.assert_array_equal(updates["b"][...], np.zeros(F))


# ---------------------------------------------------------------- optimizers


def quad_loss(params: dict) -> jax.Array:
    return sum(jnp.sum((p - 0.5) ** 2) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lamb", "adafactor"])
def test_each_optimizer_moves_downhill(name):
    params = {"w": jnp.full((3, 4), 2.0), "b": jnp.full((4,), -1.0)}
    mask = decay_mask(params, {"w": ("embed", "mlp"), "b": ("mlp",)})
    wd = 0.0 if name == "adam" else 0.01
    cfg = OptimConfig(name=name, lr=0.05, schedule="constant", weight_decay=wd)
    tx, sched = make_optimizer(cfg, 100, mask)
    assert lr_at(sched, 0) == pytest.approx(0.05, rel=REL)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(quad_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    new_params, _ = step(params, tx.init(params))
    assert float(quad_loss(new_params)) < float(quad_loss(params))


def test_sgd_momentum_zero_is_plain_sgd():
    params = {"w": jnp.ones((2, 2))}
    cfg = OptimConfig(name="sgd", lr=0.1, momentum=0.0, clip_norm=0, schedule="constant")
    tx, _ = make_optimizer(cfg, 10, None)
    grads = {"w": jnp.full((2, 2), 3.0)}
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.3 * np.ones((2, 2)), rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_weight_decay_skips_masked_params(name):
    lr, wd = 0.1, 0.5
    params = {"w": jnp.arange(6.0).reshape(2, 3) + 1.0, "b": jnp.arange(3.0) + 1.0}
    mask = decay_mask(params, {"w": ("embed", "mlp"), "b": ("mlp",)})
    cfg = OptimConfig(
        name=name, lr=lr, weight_decay=wd, clip_norm=0, schedule="constant", momentum=0.0
    )
    tx, _ = make_optimizer(cfg, 10, mask)
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], np.asarray(params["w"]) * (1 - lr * wd), rtol=1e-6)
    np.testing.assert_array_equal(new["b"], params["b"])


def test_clipping_bounds_sgd_update_norm():
    lr = 0.1
    params = {"w": jnp.zeros((3, 3)), "b": jnp.zeros((3,))}
    grads = {"w": jnp.full((3, 3), 1e6), "b": jnp.arange(3.0) * 1e6}
    cfg = OptimConfig(name="sgd", lr=lr, momentum=0.0, clip_norm=1.0, schedule="constant")
    tx, _ = make_optimizer(cfg, 10, None)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(lr * 1.0, rel=1e-5)


def test_no_clipping_when_disabled():
    params = {"w": jnp.zeros((2,))}
    grads = {"w": jnp.array([3e3, 4e3])}
    cfg = OptimConfig(name="sgd", lr=1.0, momentum=0.0, clip_norm=0.0, schedule="constant")
    tx, _ = make_optimizer(cfg, 10, None)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(5e3, rel=1e-6)


# ---------------------------------------------------------------- short runs


def test_warmup_as_a_fraction_of_the_run():
    sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=0.1, schedule="constant"), 200)
    assert lr_at(sched, 10) == pytest.approx(0.5, rel=REL)  # 20 warmup steps
    assert lr_at(sched, 20) == pytest.approx(1.0, rel=REL)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_warmup_longer_than_the_run_is_clamped_with_a_warning(schedule):
    with pytest.warns(
        UserWarning,
        match=r"optim.warmup_steps=100 is not shorter than "
        r"train.steps=10: warming up for 9 steps",
    ):
        sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=100, schedule=schedule), 10)
    assert lr_at(sched, 3) == pytest.approx(1 / 3, rel=REL)  # 9 warmup steps
    assert lr_at(sched, 9) == pytest.approx(1.0, rel=REL)


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"lr": 0.0}, "optim.lr"),
        ({"lr": -1e-3}, "optim.lr"),
        ({"lr": float("nan")}, "optim.lr"),
        ({"warmup_steps": -1}, "optim.warmup_steps"),
        ({"warmup_steps": 2.5}, "optim.warmup_steps"),
        ({"decay_steps": -5}, "optim.decay_steps"),
        ({"min_lr_ratio": 1.5}, "optim.min_lr_ratio"),
        ({"step_every": 0}, "optim.step_every"),
        ({"step_gamma": 0.0}, "optim.step_gamma"),
        ({"step_gamma": 1.5}, "optim.step_gamma"),
        ({"clip_norm": -1.0}, "optim.clip_norm"),
        ({"b1": 1.0}, "optim.b1"),
        ({"b1": -0.1}, "optim.b1"),
        ({"b2": 1.0}, "optim.b2"),
        ({"momentum": 1.0}, "optim.momentum"),
        ({"eps": -1e-8}, "optim.eps"),
        ({"weight_decay": -0.1}, "optim.weight_decay"),
        ({"name": "adam", "weight_decay": 0.1}, "optim.weight_decay"),
        ({"name": "sgd", "momentum": 0.0, "nesterov": True}, "optim.nesterov"),
        ({"name": "rmsprop"}, "optim.name"),
        ({"schedule": "exponential"}, "optim.schedule"),
    ],
)
def test_bad_values_name_the_key(fields, key):
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")):
        make_optimizer(OptimConfig(**fields), 100, None)


def test_adam_weight_decay_points_to_adamw():
    with pytest.raises(ValueError, match="optim.name=adamw"):
        make_optimizer(OptimConfig(name="adam", weight_decay=0.1), 100, None)


def test_bad_total_steps():
    with pytest.raises(ValueError, match="train.steps"):
        make_schedule(OptimConfig(), 0)


def test_constant_schedule_allows_long_warmup():
    sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=20, schedule="constant"), 10)
    assert lr_at(sched, 9) == pytest.approx(9 / 20, rel=REL)


def test_adafactor_weight_decay_is_decoupled_like_adamw():
    """With zero gradients, Adafactor's update is exactly -lr·wd·p on matrices only."""
    cfg = OptimConfig(
        name="adafactor",
        lr=0.1,
        weight_decay=0.5,
        schedule="constant",
        warmup_steps=0,
        clip_norm=0.0,
    )
    params = {"w": jnp.full((4, 4), 2.0), "b": jnp.full((4,), 2.0)}
    tx, _ = make_optimizer(cfg, total_steps=10, mask=decay_mask(params))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(updates["b"], 0.0)
