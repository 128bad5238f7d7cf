"""A researcher's stock Flax NNX model (Conv, BatchNorm, Dropout, Linear, annotated only with
``nnx.with_partitioning``) through jaxpar: every layout equals one device — losses,
parameters, BatchNorm statistics and RNG state — and eval runs on running averages
without dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.config import load_config
from jaxpar.run import build
from jaxpar.user_code import load_task
from tests.helpers import assert_params_close, grid

TASK = load_task("examples/research_cnn.py:TASK")
SGD = optax.sgd(0.1, momentum=0.9)
LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}
BATCH = 16


def host(tree):
    """A state tree as numpy, typed PRNG keys as their key data."""

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def research_run(layout, devices=8, optimizer=SGD, task=TASK):
    return build(
        load_config([], [*layout, f"run.devices={devices}", f"train.batch_size={BATCH}"]),
        task,
        optimizer,
    )


def train_steps(run, steps=3):
    state = run.trainer.init()
    losses = []
    for step in range(steps):
        state, metrics = run.trainer.step(
            state, run.trainer.shard_batch(run.data.batch(step, BATCH))
        )
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


_reference = {}


def reference():
    if not _reference:
        run = research_run(["mesh.data=1"], devices=1)
        losses, state = train_steps(run)
        _reference.update(
            losses=losses, params=host(state.params), model_state=host(state.model_state)
        )
    return _reference


@pytest.mark.parametrize(
    "layout", grid([pytest.param(x, id=x) for x in LAYOUTS], {"data=2,fsdp=2,tensor=2"})
)
def test_stock_nnx_model_matches_one_device(layout):
    """Losses, parameters, BatchNorm statistics and the dropout RNG state after 3 SGD
    steps equal the one-device run's."""
    ref = reference()
    run = research_run(LAYOUTS[layout])
    losses, state = train_steps(run)
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    assert_params_close(host(state.params), ref["params"])
    got = host(state.model_state)
    for key in ("mean", "var"):
        np.testing.assert_allclose(
            got["bn"][key], ref["model_state"]["bn"][key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    assert not np.allclose(got["bn"]["mean"], 0.0), "the running mean never moved"
    np.testing.assert_array_equal(
        got["drop"]["rngs"]["key"], ref["model_state"]["drop"]["rngs"]["key"]
    )
    assert (
        int(got["drop"]["rngs"]["count"]) == int(ref["model_state"]["drop"]["rngs"]["count"]) == 3
    )


def test_flax_sharding_metadata_is_read_by_the_rules():
    """The names `nnx.with_partitioning` attached map through the rules table: nothing is
    written as path rules; the BatchNorm statistics and RNG state (no names) replicate."""
    run = research_run(LAYOUTS["data=2,fsdp=2,tensor=2"])
    specs, state_specs = run.plan.param_specs, run.plan.state_specs
    assert TASK.path_rules == ()
    assert specs["hidden"]["kernel"] == P("fsdp", "tensor")
    assert specs["out"]["kernel"] == P("tensor", None)
    assert specs["conv"]["kernel"] == P(None, None, None, None)
    assert state_specs["bn"]["mean"] == P(None) and state_specs["drop"]["rngs"]["count"] == P()
    shard = run.trainer.init().params["hidden"]["kernel"].addressable_shards[0]
    assert shard.data.shape == (16 * 8 * 8 // 2, 64 // 2)
    assert run.plan.model.state_kinds == ("BatchStat", "RngCount", "RngKey")


def test_dropout_masks_change_every_step_and_nothing_else_does():
    """Training mode: the same state gives the same loss (no hidden randomness); the next
    step's RNG count gives another mask. Eval mode: no dropout, so the RNG state does not
    matter."""
    run = research_run(["mesh.data=8"])
    trainer = run.trainer
    state = trainer.init()
    batch = trainer.shard_batch(run.data.batch(0, BATCH))
    apply = jax.jit(trainer.apply, static_argnames="train")
    a, _, after = apply(state.params, state.model_state, batch, train=True)
    b, _, _ = apply(state.params, state.model_state, batch, train=True)
    c, _, _ = apply(state.params, after, batch, train=True)
    assert float(a) == float(b) and float(a) != float(c)
    assert (
        int(after["drop"]["rngs"]["count"]) == int(state.model_state["drop"]["rngs"]["count"]) + 1
    )
    e1, _, kept = apply(state.params, state.model_state, batch, train=False)
    other_rng = {**state.model_state, "drop": after["drop"]}  # same statistics, next RNG
    e2, _, _ = apply(state.params, other_rng, batch, train=False)
    assert float(e1) == float(e2)
    for a, b in zip(jax.tree.leaves(host(kept)), jax.tree.leaves(host(state.model_state))):
        np.testing.assert_array_equal(a, b)  # eval updates nothing


def _hand_eval(params, model_state, batch):
    """The CNN in evaluation mode written out: BatchNorm on its running averages (Flax's
    default epsilon 1e-5), no dropout."""
    conv, bn = params["conv"], params["bn"]
    x = (
        jax.lax.conv_general_dilated(
            batch["images"],
            conv["kernel"],
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        + conv["bias"]
    )
    stats = model_state["bn"]
    x = np.maximum((x - stats["mean"]) / np.sqrt(stats["var"] + 1e-5) * bn["scale"] + bn["bias"], 0)
    h = np.maximum(x.reshape(len(x), -1) @ params["hidden"]["kernel"] + params["hidden"]["bias"], 0)
    logits = h @ params["out"]["kernel"] + params["out"]["bias"]
    loss = optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits), batch["labels"]
    ).mean()
    return float(loss), float((logits.argmax(-1) == batch["labels"]).mean())


def test_eval_uses_running_averages_and_no_dropout():
    run = research_run(LAYOUTS["data=2,fsdp=2,tensor=2"])
    _, state = train_steps(run, steps=2)
    params, model_state = host(state.params), host(state.model_state)
    held_out = run.data.batch(0, BATCH, "eval")
    got = run.trainer.evaluate(state, run.trainer.shard_batch(held_out))
    loss, accuracy = _hand_eval(params, model_state, held_out)
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    assert float(got["accuracy"]) == accuracy
    # the running averages are not the batch's statistics: the check above would fail on
    # batch statistics
    images = held_out["images"]
    conv = jax.lax.conv_general_dilated(
        images, params["conv"]["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    batch_mean = np.asarray(conv + params["conv"]["bias"]).mean((0, 1, 2))
    assert np.abs(batch_mean - model_state["bn"]["mean"]).max() > 1e-2


def test_accumulation_with_batchnorm_matches_one_device():
    """With train.grad_accum=2 each microbatch is normalized by its own statistics (the
    docs/own-model.md says so); every layout still gives the one-device numbers for that setting."""

    def accumulated(layout, devices):
        run = build(
            load_config(
                [],
                [
                    *layout,
                    f"run.devices={devices}",
                    f"train.batch_size={BATCH}",
                    "train.grad_accum=2",
                ],
            ),
            TASK,
            SGD,
        )
        losses, state = train_steps(run, steps=2)
        return losses, host(state.params), host(state.model_state), run

    one = accumulated(["mesh.data=1"], 1)
    many = accumulated(LAYOUTS["data=2,fsdp=2,tensor=2"], 8)
    assert not many[3].plan.accumulates_per_data_shard  # stateful: the automatic path
    np.testing.assert_allclose(many[0], one[0], rtol=1e-5)
    assert_params_close(many[1], one[1])
    np.testing.assert_allclose(many[2]["bn"]["var"], one[2]["bn"]["var"], rtol=1e-5)
    assert int(many[2]["drop"]["rngs"]["count"]) == 4  # one draw per microbatch
    full = reference()
    assert not np.allclose(one[0][:2], full["losses"][:2], rtol=1e-3)  # not the full batch


def test_pipeline_refuses_a_model_with_state():
    import dataclasses

    from jaxpar.task import StageSplit

    staged = dataclasses.replace(
        TASK, stages=StageSplit("hidden", lambda m, b: b, lambda m, x: x, lambda m, x, b: (0, {}))
    )
    with pytest.raises(
        ValueError,
        match=r"mesh.stage=2: the pipeline runs models whose "
        r"state besides nnx.Param is RNG streams only, but "
        r"this one also has BatchStat",
    ):
        research_run(["mesh.data=4", "mesh.stage=2"], task=staged)


def test_a_schedule_free_optimizer_evaluates_its_eval_params():
    """Task.eval_params: evaluation under a layout uses optax.contrib.schedule_free_eval_params
    of the state (the hand-written forward pass on those parameters), not the trained ones."""
    import dataclasses

    sf = optax.contrib.schedule_free_adamw(0.05, b1=0.5)
    task = dataclasses.replace(TASK, eval_params=optax.contrib.schedule_free_eval_params)
    run = research_run(LAYOUTS["data=2,fsdp=2,tensor=2"], optimizer=sf, task=task)
    _, state = train_steps(run, steps=4)
    held_out = run.data.batch(0, BATCH, "eval")
    got = run.trainer.evaluate(state, run.trainer.shard_batch(held_out))
    model_state = host(state.model_state)
    params = host(
        optax.contrib.schedule_free_eval_params(host(state.opt_state), host(state.params))
    )
    loss, _ = _hand_eval(params, model_state, held_out)
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    trained, _ = _hand_eval(host(state.params), model_state, held_out)
    assert abs(trained - loss) > 1e-3 * abs(loss)  # the other parameters would fail
    staged = dataclasses.replace(
        load_task("examples/two_device_mlp.py:TASK"),
        eval_params=optax.contrib.schedule_free_eval_params,
    )
    with pytest.raises(
        Exception,
        match=r"^Task.eval_params needs the whole optimizer state"
        r" .* pipeline.executor=mpmd splits by stage",
    ):
        build(load_config([], ["mesh.stage=2", "mesh.data=4"]), staged, sf)
