"""Train-step behaviour: gradient accumulation, memory under FSDP, non-finite handling."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar import guard
from jaxpar.config import load_config
from jaxpar.loop import build, fit
from jaxpar.optim import make_schedule
from jaxpar.report import layout_totals
from tests.helpers import CONVNET_SMALL, GPT_SMALL, assert_params_close, grid, run_steps
from tests.test_families import RESNET
from tests.test_optimizer_state import LAYOUT, TASK

OPTIM = ["optim.name=sgd", "optim.lr=0.05", "optim.momentum=0.9"]


@pytest.mark.parametrize(
    "mesh",
    grid(
        [
            pytest.param(["mesh.data=1"], id="mesh0"),
            pytest.param(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], id="mesh1"),
            # the data-local accumulation path (one all-reduce over data per step)
            pytest.param(["mesh.data=8", "train.batch_size=32"], id="mesh2"),
            pytest.param(["mesh.data=4", "mesh.fsdp=2", "train.batch_size=32"], id="mesh3"),
            pytest.param(["mesh.data=4", "mesh.tensor=2"], id="mesh4"),
        ],
        # mesh1's accumulation: test_fsdp_gather_once_trades_memory_for_gathers
        {"mesh3"},
    ),
)
def test_grad_accumulation_equals_full_batch(mesh):
    devices = 1 if mesh == ["mesh.data=1"] else 8
    full = run_steps([*GPT_SMALL, *OPTIM, *mesh], steps=2, devices=devices)
    accum = run_steps([*GPT_SMALL, *OPTIM, *mesh, "train.grad_accum=4"], steps=2, devices=devices)
    np.testing.assert_allclose(accum[0], full[0], rtol=1e-5)
    assert_params_close(accum[1], full[1])


def test_grad_accumulation_all_reduces_over_data_once_per_step():
    from jaxpar import hlo
    from jaxpar.plan import global_batch_shapes

    def all_reduce_bytes(accum):
        # one collective per array (train.grad_bucket_mb=0): without accumulation, XLA's
        # automatic reduction
        overrides = ["mesh.data=8", "train.batch_size=32", "train.grad_bucket_mb=0"]
        run = build(load_config([], [*GPT_SMALL, *overrides, f"train.grad_accum={accum}"]))
        batch = global_batch_shapes(run.data.batch(0, run.config.train.batch_size), 1)
        text = run.trainer.compile_step(batch).as_text()
        return run.plan.accumulates_per_data_shard, hlo.collective_stats(text)["all-reduce"]

    (local, accumulated), (plain_local, plain) = all_reduce_bytes(4), all_reduce_bytes(1)
    assert local and not plain_local
    # the same bytes as without accumulation (not 4×): the sums stay local until the end
    assert accumulated.wire_bytes == pytest.approx(plain.wire_bytes, rel=1e-3)


@pytest.mark.parametrize(
    "mesh",
    grid(
        [
            pytest.param(["mesh.fsdp=8"], id="mesh0"),
            pytest.param(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], id="mesh1"),
        ],
        {"mesh1"},
    ),
)
def test_fsdp_gather_once_trades_memory_for_gathers(mesh):
    """train.fsdp_gather with grad_accum=4 over FSDP-sharded weights: per_microbatch gathers
    the weights in each of the 4 microbatches, once gathers them once per step and keeps them
    (more temporaries). Both train the same numbers as the full batch, and `jaxpar inspect`
    shows the trade, this run's setting first."""
    from jaxpar.report import format_report

    common = [*GPT_SMALL, *OPTIM, "mesh.data=1", *mesh, "train.batch_size=32", "train.grad_accum=4"]
    full = run_steps([*GPT_SMALL, *OPTIM, "mesh.data=1", *mesh, "train.batch_size=32"], steps=2)
    once = run_steps([*common, "train.fsdp_gather=once"], steps=2)
    per_mb = run_steps([*common, "train.fsdp_gather=per_microbatch"], steps=2)
    for losses, params, _ in (once, per_mb):
        np.testing.assert_allclose(losses, full[0], rtol=1e-5)
        assert_params_close(params, full[1])
    totals = layout_totals(once[2])
    first, other = totals.fsdp_gather
    assert (first.setting, other.setting) == ("once", "per_microbatch")
    assert first.collective_bytes == totals.collective_bytes
    # the weight gathers: 4 per step (forward) become 1; their bytes at most a third
    assert first.collective_bytes["all-gather"] < other.collective_bytes["all-gather"] / 3
    assert first.step_temp_bytes > other.step_temp_bytes  # the kept whole weights
    report = format_report(once[2], totals)
    assert "FSDP weight gathers with train.grad_accum=4" in report
    assert "once (this run)" in report and "per_microbatch" in report


def test_fsdp_gather_without_effect_warns():
    with pytest.warns(
        UserWarning, match="'train.fsdp_gather' has no effect with train.grad_accum=1"
    ):
        build(load_config([], [*GPT_SMALL, "mesh.data=1", "mesh.fsdp=8", "train.fsdp_gather=once"]))
    with pytest.warns(UserWarning, match="no parameter sharded over data or fsdp"):
        build(
            load_config(
                [],
                [
                    *GPT_SMALL,
                    "mesh.data=8",
                    "train.batch_size=32",
                    "train.grad_accum=4",
                    "train.fsdp_gather=once",
                ],
            )
        )


def test_grad_accumulation_batch_must_split():
    """Caught when the run is built (and again for any batch handed to the trainer)."""
    message = r"global batch 24 must be divisible by train.grad_accum \(4\) × the 8 devices"
    with pytest.raises(ValueError, match=message):
        build(load_config([], [*GPT_SMALL, "train.batch_size=24", "train.grad_accum=4"]))
    run = build(load_config([], [*GPT_SMALL, "train.batch_size=32", "train.grad_accum=4"]))
    with pytest.raises(ValueError, match=message):
        run.trainer.shard_batch(run.data.batch(0, 24))


def test_fsdp_argument_bytes_near_one_eighth_of_state():
    cfg = load_config(["configs/gpt_tiny.yaml"], ["mesh.data=1", "mesh.fsdp=8"])
    totals = layout_totals(build(cfg))
    state_total = totals.params_total_bytes + totals.opt_state_total_bytes
    assert totals.step_argument_bytes <= 1.10 * state_total / 8
    # and data parallel really holds everything on each device
    dp = layout_totals(build(load_config(["configs/gpt_tiny.yaml"], ["mesh.data=8"])))
    assert dp.step_argument_bytes >= state_total


class _PoisonedLoader:
    """A loader whose batch ``bad`` (0-based) is all NaN images; the rest passes through."""

    def __init__(self, loader, bad):
        self.loader, self.bad = loader, bad

    def __next__(self):
        index = self.loader.batches_consumed
        return _poison(next(self.loader), index == self.bad)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _poison(batch, bad):
    if bad:
        batch = {**batch, "images": np.full_like(batch["images"], np.nan)}
    return batch


def _poisoned_run(policy, bad=2):
    """A convnet run whose training batch of step 3 (batch index 2) is all NaN."""
    cfg = load_config(
        [],
        [
            *CONVNET_SMALL,
            "train.steps=4",
            "train.log_every=2",
            "train.eval_every=0",
            f"train.nonfinite={policy}",
        ],
    )
    run = build(cfg)
    make_loader = run.data.loader
    run.data.loader = lambda *args: _PoisonedLoader(make_loader(*args), bad)
    run.poisoned_batch = lambda step: _poison(run.data.batch(step, 16), step == bad)
    return run


def test_nonfinite_stop_names_the_step():
    with pytest.raises(FloatingPointError, match="non-finite loss at step 3"):
        fit(_poisoned_run("stop"))


def test_nonfinite_skip_leaves_state_unchanged_and_counts():
    run = _poisoned_run("skip")
    trainer = run.trainer
    state = trainer.init()
    before = None
    for step in range(4):
        if step == 2:
            before = jax.tree.map(np.asarray, state.params)
        batch = trainer.shard_batch(run.poisoned_batch(step))
        state, metrics = trainer.step(state, batch)
        if step == 2:
            assert not bool(metrics["finite"])
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
                np.testing.assert_array_equal(np.asarray(a), b)
    assert int(state.skipped) == 1
    # the logged lr is the one the optimizer applied: its count excludes the skipped step
    schedule = make_schedule(run.config.optim, run.config.train.steps)
    assert float(metrics["lr"]) == pytest.approx(float(schedule(2)))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    history = fit(_poisoned_run("skip"))
    assert history.train_rows[-1]["skipped"] == 1


def _guarded_steps(guard):
    """Every state leaf before and after each of 3 ResNet steps (BatchNorm statistics, SGD
    momentum, ``data=2,fsdp=2,tensor=2``) under ``train.nonfinite_guard=guard``, the
    batch of step 2 all NaN; and each step's ``finite``."""
    run = build(
        load_config(
            [],
            [
                *RESNET,
                "mesh.data=2",
                "mesh.fsdp=2",
                "mesh.tensor=2",
                "train.nonfinite=skip",
                f"train.nonfinite_guard={guard}",
            ],
        )
    )
    state = run.trainer.init()
    states, finite = [jax.tree.map(np.asarray, state)], []
    for step in range(3):
        batch = _poison(run.data.batch(step, run.config.train.batch_size), step == 1)
        state, metrics = run.trainer.step(state, run.trainer.shard_batch(batch))
        states.append(jax.tree.map(np.asarray, state))
        finite.append(bool(metrics["finite"]))
    return states, finite


@pytest.fixture(scope="module")
def guarded():
    return {guard: _guarded_steps(guard) for guard in ("cond", "where")}


@pytest.mark.parametrize("guard", ["cond", "where"])
def test_a_skipped_step_leaves_every_state_leaf_unchanged(guarded, guard):
    """Parameters, momentum and BatchNorm statistics after the NaN step equal those before
    it; the step count advances and the skip is counted; the next step applies."""
    states, finite = guarded[guard]
    assert finite == [True, False, True]
    before, after = states[1], states[2]
    for name in ("params", "opt_state", "model_state"):
        leaves = jax.tree.leaves(getattr(before, name))
        assert leaves, name
        for a, b in zip(jax.tree.leaves(getattr(after, name)), leaves, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert jax.tree.leaves(before.model_state) != [] and (after.step, after.skipped) == (2, 1)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(states[3].params), jax.tree.leaves(after.params), strict=True
        )
    )


def test_both_nonfinite_guards_give_the_same_numbers_without_optimizer_reductions(guarded):
    """``cond`` computes the update inside a conditional, ``where`` selects after it; with
    an optimizer that reduces nothing (SGD with momentum, no clipping): the same state,
    BatchNorm statistics included, bit for bit after every step."""
    for cond, where in zip(guarded["cond"][0], guarded["where"][0], strict=True):
        for a, b in zip(jax.tree.leaves(cond), jax.tree.leaves(where), strict=True):
            np.testing.assert_array_equal(a, b)


def _guarded_states(optim: list[str], name: str) -> list:
    run = build(
        load_config(
            [],
            [
                *LAYOUT,
                *optim,
                "optim.lr=0.05",
                "optim.warmup_steps=0",
                f"train.nonfinite_guard={name}",
            ],
        ),
        TASK,
    )
    state, out = run.trainer.init(), []
    for step in range(3):
        state, metrics = run.trainer.step(state, run.trainer.shard_batch(run.data.batch(step, 16)))
        assert bool(metrics["finite"])
        out.append(jax.tree.map(np.asarray, (state.params, state.opt_state)))
    return out


@pytest.mark.parametrize(
    "optim",
    grid(
        [
            pytest.param(
                ["optim.name=adam", "optim.weight_decay=0", "optim.clip_norm=0.5"], id="adam"
            ),
            pytest.param(["optim.name=adamw", "optim.weight_decay=0.1"], id="adamw"),
            pytest.param(["optim.name=lamb"], id="lamb"),
            pytest.param(["optim.name=adafactor", "optim.clip_norm=0.5"], id="adafactor"),
        ],
        # the suite: Adam under an active clip (the global norm reduced again inside the
        # conditional: the 1 ulp seen) and Adafactor (per-leaf RMS norms reduced again:
        # the one seen apart under the tests' compiler flags). AdamW's moments and clip
        # are Adam's, and LAMB's trust ratios are per-leaf norms of sharded leaves
        # reduced again inside the conditional, as Adafactor's: extended
        {"adam", "adafactor"},
    ),
)
def test_both_nonfinite_guards_agree_to_float32_rounding_for_every_optimizer(optim):
    """Under ``data=2,fsdp=2,tensor=2`` (sharded moments; the clipping, trust-ratio and
    factored norms reduced across devices): after every step, the parameters and optimizer
    state of ``cond`` and ``where`` differ by at most 8 float32 ulps of each leaf's largest
    value. ``cond`` runs the optimizer's own reductions again inside the conditional, and
    XLA may sum them in another order (seen: Adam with active clipping, 1 ulp; Adafactor
    under the tests' compile-for-speed flags)."""
    cond, where = _guarded_states(optim, "cond"), _guarded_states(optim, "where")
    assert not np.array_equal(cond[0][0]["a"], cond[-1][0]["a"])  # the steps applied
    for a, b in zip(jax.tree.leaves(cond), jax.tree.leaves(where), strict=True):
        ulp = np.finfo(np.float32).eps * np.abs(b).max() if b.dtype == np.float32 else 0
        np.testing.assert_allclose(a, b, rtol=0, atol=8 * ulp)


def _updates_turn_nan(first: int) -> optax.GradientTransformation:
    """Finite gradients in, NaN updates out from its own ``first`` step on."""

    def update(updates, state, params=None):
        count = state + 1
        return jax.tree.map(lambda u: jnp.where(count >= first, jnp.nan, u), updates), count

    return optax.GradientTransformation(lambda params: jnp.zeros((), jnp.int32), update)


@pytest.mark.parametrize("name", ["cond", "where"])
def test_a_nonfinite_update_of_finite_gradients_is_skipped(name):
    """The setting reaches the trainer; an optimizer that makes NaN of finite gradients
    (finite loss and grad norm) has its step skipped: every state leaf as before it."""
    run = build(
        load_config([], [*LAYOUT, "train.nonfinite=skip", f"train.nonfinite_guard={name}"]),
        TASK,
        optax.chain(optax.adam(0.01), _updates_turn_nan(2)),
    )
    assert run.trainer.keep is {"cond": guard.keep_cond, "where": guard.keep_where}[name]
    state = run.trainer.init()
    batches = [run.trainer.shard_batch(run.data.batch(step, 16)) for step in range(2)]
    state, first = run.trainer.step(state, batches[0])
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, second = run.trainer.step(state, batches[1])
    assert bool(first["finite"]) and not bool(second["finite"])
    assert np.isfinite(float(second["loss"])) and np.isfinite(float(second["grad_norm"]))
    for a, b in zip(
        jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(before), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert (int(state.step), int(state.skipped)) == (2, 1)


def test_auto_guard_is_where_on_a_gpu_and_cond_elsewhere():
    assert guard.choose("auto", "gpu") is guard.keep_where
    assert guard.choose("auto", "cpu") is guard.keep_cond
    assert guard.choose("auto", "tpu") is guard.keep_cond


def _state_turns_float() -> optax.GradientTransformation:
    """An optimizer whose state is born int32 and comes back float32."""
    return optax.GradientTransformation(
        lambda params: {"count": jnp.zeros((), jnp.int32)},
        lambda u, state, params=None: (u, {"count": state["count"] + 1.0}),
    )


@pytest.mark.parametrize("name", ["cond", "where"])
def test_an_optimizer_that_changes_its_state_dtype_is_a_one_line_error(name):
    run = build(
        load_config([], [*LAYOUT, f"train.nonfinite_guard={name}"]),
        TASK,
        optax.chain(optax.sgd(0.01), _state_turns_float()),
    )
    with pytest.raises(ValueError) as raised:
        run.trainer.step(run.trainer.init(), run.trainer.shard_batch(run.data.batch(0, 16)))
    assert re.fullmatch(
        r"the train step changed state leaf \['opt_state'\]\[1\]\['count'\] "
        r"from int32\[\] to float32\[\]: .*dtypes of its init",
        str(raised.value),
    ), str(raised.value)


def test_vocab_smaller_than_bytes_is_an_error():
    with pytest.raises(ValueError, match="has vocab_size 256 but model.vocab_size=100"):
        build(load_config([], [*GPT_SMALL, "model.vocab_size=100"]))


def test_throughput_leaves_out_evaluation_and_checkpoints(tmp_path, monkeypatch):
    """Evaluation made to take 0.5 s: no logged interval's step time holds it, the
    evaluation rows carry their own duration, and the summary reports the median of the
    steady intervals and the time left out."""
    import statistics
    import time as clock

    import jaxpar.run
    from jaxpar.loop import summarize, train

    slow = jaxpar.run.evaluate

    def evaluate(run, state):
        clock.sleep(0.5)
        return slow(run, state)

    monkeypatch.setattr(jaxpar.run, "evaluate", evaluate)
    cfg = load_config(
        [],
        [
            *GPT_SMALL,
            "train.steps=8",
            "train.log_every=2",
            "train.eval_every=3",
            "train.eval_batches=1",
            "train.progress=false",
            f"run.dir={tmp_path}",
            "checkpoint.every_steps=4",
        ],
    )
    history = train(cfg, echo=False)
    train_rows, eval_rows = history.train_rows, history.eval_rows
    assert [r["step"] for r in eval_rows] == [3, 6, 8]
    assert all(r["eval_time_s"] >= 0.5 for r in eval_rows)
    assert all(r["step_time_s"] < 0.25 for r in train_rows[1:]), train_rows
    assert history.paused["eval"] >= 1.5 and history.paused["checkpoint"] > 0
    text = summarize(build(cfg), history)
    median = statistics.median(r["examples_per_s"] for r in train_rows[1:])
    assert f"throughput: {median:,.1f} examples/s" in text
    assert "not counted: eval" in text and "checkpoint" in text


def test_progress_lines_give_an_eta_once_steps_are_timed_and_echo_false_is_silent(tmp_path, capsys):
    """Without a terminal, a line per logged row: the first (its interval holds the
    compilation) without an ETA, the later ones with it; ``echo=False`` prints nothing."""
    from jaxpar import load_config, train
    from tests.helpers import GPT_SMALL

    # the schedule's horizon of test_throughput_leaves_out_evaluation_and_checkpoints's 8
    # steps: the same init and train step, read back from the compile cache
    base = [
        *GPT_SMALL,
        "optim.decay_steps=8",
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
    ]
    train(load_config([], [*base, f"run.dir={tmp_path / 'a'}"]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "ETA" not in lines[0] and all("ETA" in line for line in lines[1:])
    train(load_config([], [*base, f"run.dir={tmp_path / 'b'}"]), echo=False)
    assert capsys.readouterr().out == ""
