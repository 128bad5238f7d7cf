"""A Flax Linen CNN (Conv, BatchNorm, Dropout, Dense, annotated only with
``nn.with_partitioning``) through jaxpar as ``jaxpar.Linen``: ``model.train()`` /
``model.eval()`` reach the Linen module; every layout equals one device — losses,
parameters, BatchNorm statistics, RNG state; eval runs on running averages without dropout;
a resume is bitwise identical; misuse is a one-line error."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import load_config
from jaxpar.run import build
from tests.helpers import assert_params_close, grid
from tests.test_research import (
    BATCH,
    LAYOUTS,
    _hand_eval,
    host,
    research_run,
    train_steps,
)
from tests.test_research import TASK as NNX_TASK

LECUN_NORMAL = nn.initializers.lecun_normal()


def named(*names, init=LECUN_NORMAL):
    return nn.with_partitioning(init, names)


class CNN(nn.Module):
    """The NNX example's CNN (``examples/research_cnn.py``) written in Linen."""

    @nn.compact
    def __call__(self, images, train: bool):
        zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
        x = nn.Conv(
            16,
            (3, 3),
            kernel_init=named(None, None, "conv_in", "conv_out"),
            bias_init=named("conv_out", init=zeros),
            name="conv",
        )(images)
        x = nn.BatchNorm(
            use_running_average=not train,
            name="bn",
            scale_init=named("conv_out", init=ones),
            bias_init=named("conv_out", init=zeros),
        )(x)
        x = nn.Dropout(0.2, deterministic=not train, name="drop")(nn.relu(x))
        x = nn.Dense(
            64, kernel_init=named("embed", "mlp"), bias_init=named("mlp", init=zeros), name="hidden"
        )(x.reshape(x.shape[0], -1))
        return nn.Dense(
            4,
            kernel_init=named("mlp", "classes"),
            bias_init=named("classes", init=zeros),
            name="out",
        )(nn.relu(x))


EXAMPLE = np.zeros((1, 8, 8, 1), np.float32)
TASK = dataclasses.replace(  # the NNX example's loss, data and optimizer
    NNX_TASK, model_fn=lambda rngs: jaxpar.Linen(CNN(), EXAMPLE, rngs=rngs), name="linen_cnn"
)
STEPS = 3

_trained = {}


def trained(layout):
    """(run, losses, state) after STEPS SGD steps on ``layout`` ("one": one device)."""
    if layout not in _trained:
        run = (
            research_run(["mesh.data=1"], devices=1, task=TASK)
            if layout == "one"
            else research_run(LAYOUTS[layout], task=TASK)
        )
        _trained[layout] = (run, *train_steps(run, STEPS))
    return _trained[layout]


def linen_variables(model):
    """The model's variables as the Linen module's ``apply`` takes them."""
    return {
        name: nnx.to_pure_dict(nnx.state(model, kind)).get("linen", {})
        for name, kind in (("params", nnx.Param), ("batch_stats", nnx.BatchStat))
    }


def test_model_train_and_eval_reach_the_linen_module():
    """eval(): the Linen call with train=False, RNG untouched; train(): batch statistics
    updated as Linen's own train=True apply updates them, a new dropout mask each call."""
    images = NNX_TASK.data(0, BATCH)["images"]
    with nnx.use_eager_sharding(False):
        model = jaxpar.Linen(CNN(), EXAMPLE, rngs=nnx.Rngs(0))
    before = linen_variables(model)
    count = lambda: int(
        nnx.state(model, nnx.RngCount)["linen"]["to_nnx__rngs"]["default"]["count"][...]
    )
    assert count() == 1  # lazy_init drew once
    model.eval()
    evaluated = model(images)
    np.testing.assert_array_equal(evaluated, CNN().apply(before, images, train=False))
    assert count() == 1
    model.train()
    first = model(images)
    _, updates = CNN().apply(
        before, images, train=True, rngs={"dropout": jax.random.key(0)}, mutable=["batch_stats"]
    )
    for key in ("mean", "var"):
        np.testing.assert_allclose(
            linen_variables(model)["batch_stats"]["bn"][key],
            updates["batch_stats"]["bn"][key],
            rtol=1e-6,
            err_msg=key,
        )
    assert not np.allclose(
        before["batch_stats"]["bn"]["mean"], updates["batch_stats"]["bn"]["mean"]
    )
    second = model(images)
    assert count() == 3
    assert not np.allclose(first, evaluated) and not np.allclose(first, second)


# the suite: data × fsdp × tensor (the layout the tests below read too); data=8 and fsdp=8
# alone in the extended tier (the same wrapped module, its batch and parameters split by
# the three-axis case)
@pytest.mark.parametrize(
    "layout", grid([pytest.param(x, id=x) for x in LAYOUTS], {"data=2,fsdp=2,tensor=2"})
)
def test_linen_cnn_matches_one_device(layout):
    """Losses, parameters, BatchNorm statistics and the RNG state after 3 SGD steps equal
    the one-device run's."""
    _, ref_losses, ref = trained("one")
    _, losses, state = trained(layout)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(host(state.params), host(ref.params))
    got, want = host(state.model_state)["linen"], host(ref.model_state)["linen"]
    for key in ("mean", "var"):
        np.testing.assert_allclose(
            got["bn"][key], want["bn"][key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    assert not np.allclose(got["bn"]["mean"], 0.0), "the running mean never moved"
    rngs, ref_rngs = got["to_nnx__rngs"]["default"], want["to_nnx__rngs"]["default"]
    np.testing.assert_array_equal(rngs["key"], ref_rngs["key"])
    assert int(rngs["count"]) == int(ref_rngs["count"]) == 1 + STEPS  # lazy_init drew once


def test_linen_sharding_names_are_read_by_the_rules():
    run = trained("data=2,fsdp=2,tensor=2")[0]
    specs, state_specs = run.plan.param_specs["linen"], run.plan.state_specs["linen"]
    assert specs["hidden"]["kernel"] == P("fsdp", "tensor")
    assert specs["out"]["kernel"] == P("tensor", None)
    assert specs["conv"]["kernel"] == P(None, None, None, None)
    assert state_specs["bn"]["mean"] == P(None)
    assert run.plan.model.state_kinds == ("BatchStat", "RngCount", "RngKey")


def test_eval_uses_running_averages_and_no_dropout():
    """Eval equals the CNN written out with BatchNorm on its running averages and no
    dropout; the training-mode loss of the same batch differs."""
    run, _, state = trained("data=2,fsdp=2,tensor=2")
    params, model_state = host(state.params)["linen"], host(state.model_state)["linen"]
    held_out = run.data.batch(0, BATCH, "eval")
    sharded = run.trainer.shard_batch(held_out)
    got = run.trainer.evaluate(state, sharded)
    loss, accuracy = _hand_eval(params, model_state, held_out)
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    assert float(got["accuracy"]) == accuracy
    apply = jax.jit(run.trainer.apply, static_argnames="train")
    in_training, _, _ = apply(state.params, state.model_state, sharded, train=True)
    assert abs(float(in_training) - loss) > 1e-3


SHORT = [
    "train.batch_size=16",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.every_steps=2",
]


def _train(run_dir, steps):
    jaxpar.train(
        load_config([], [*SHORT, f"train.steps={steps}", f"run.dir={run_dir}"]),
        task=TASK,
        echo=False,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _final(run_dir, layout=()):
    run = build(load_config([], [*SHORT, *layout]), TASK)
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    state, meta = ckpt.restore()
    ckpt.close()
    return run, state, meta


# Extended tier: checkpoints hold the wrapped module's state as they hold an NNX model's
# (the same kinds: parameters, BatchStat, RngKey, RngCount); the suite's bitwise resume and
# restore onto data=2×fsdp=2×tensor=2 of such a state is tests/test_user_task.py's SIGTERM test
@pytest.mark.exhaustive
def test_resume_is_bitwise_identical_and_restores_onto_another_layout(tmp_path):
    """4 steps, stop, 2 more = 6 straight: losses and final state (parameters, optimizer
    state, BatchNorm statistics, RNG key and count) bit for bit; the state restores onto
    data=2×fsdp=2×tensor=2 with identical values."""
    _train(tmp_path / "resumed", 4)
    resumed_losses = _train(tmp_path / "resumed", 6)
    assert resumed_losses == _train(tmp_path / "straight", 6)
    assert [s for s, _ in resumed_losses] == list(range(1, 7))
    _, resumed, meta = _final(tmp_path / "resumed")
    _, straight, _ = _final(tmp_path / "straight")
    assert meta["step"] == 6
    assert int(resumed.model_state["linen"]["to_nnx__rngs"]["default"]["count"]) == 1 + 6
    for a, b in zip(jax.tree.leaves(host(resumed)), jax.tree.leaves(host(straight))):
        np.testing.assert_array_equal(a, b)
    other, moved, _ = _final(tmp_path / "straight", LAYOUTS["data=2,fsdp=2,tensor=2"])
    for a, b in zip(jax.tree.leaves(host(moved)), jax.tree.leaves(host(straight))):
        np.testing.assert_array_equal(a, b)
    assert moved.params["linen"]["hidden"]["kernel"].sharding.spec == P("fsdp", "tensor")


class Frozen(nn.Module):
    """BatchNorm and Dropout whose mode does not come from the call."""

    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.1, deterministic=False)(nn.BatchNorm(use_running_average=False)(x))


class Inference(nn.Module):
    """A mode argument of another name: True in evaluation."""

    @nn.compact
    def __call__(self, x, inference: bool):
        return nn.Dropout(0.5, deterministic=inference)(nn.Dense(4)(x))


def _refused(model_fn):
    task = dataclasses.replace(TASK, model_fn=model_fn)
    with pytest.raises(jaxpar.errors.TaskError) as err:
        build(load_config([], ["train.batch_size=16"]), task)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_misuse_is_a_one_line_error_naming_the_fix():
    err = _refused(lambda rngs: jaxpar.Linen(Frozen(), EXAMPLE, rngs=rngs))
    assert (
        "jaxpar.Linen(Frozen): BatchNorm 'BatchNorm_0' stays in training mode under "
        "model.eval(); give Frozen.__call__ a `train: bool` argument and build the layer "
        "with use_running_average=not train"
    ) in err
    assert "needs example inputs" in _refused(lambda rngs: jaxpar.Linen(CNN(), rngs=rngs))
    assert _refused(lambda rngs: CNN()).endswith(
        "model_fn returned a CNN, not a flax.nnx.Module; wrap the Linen module: "
        "jaxpar.Linen(CNN(...), example_input, rngs=rngs)"
    )
    with nnx.use_eager_sharding(False):
        model = jaxpar.Linen(CNN(), EXAMPLE, rngs=nnx.Rngs(0))
    with pytest.raises(
        jaxpar.errors.TaskError,
        match=r"^jaxpar.Linen sets train itself from "
        r"model.train\(\)/model.eval\(\); call the "
        r"model without it$",
    ):
        model(EXAMPLE, train=True)


def test_a_mode_argument_of_another_name():
    """`mode=` names the call's mode argument: eval() then gives inference=True."""
    x = np.ones((2, 3), np.float32)
    model = jaxpar.Linen(
        Inference(), x, rngs=nnx.Rngs(0), mode=lambda train: {"inference": not train}
    )
    model.eval()
    expected = Inference().apply(linen_variables(model), x, inference=True)
    np.testing.assert_array_equal(model(x), expected)
    model.train()
    assert not np.allclose(model(x), expected)
