"""The sub-mesh pipeline executor (``pipeline.executor=mpmd``): any model split by layer over
stages of different shapes equals one device running the same microbatches with
``train.grad_accum`` — losses, parameters, optimizer state, BatchNorm statistics, RNG
counts and evaluation — under every schedule; bad cuts are one-line errors."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
import signal

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import LayoutError, TaskError
from tests.helpers import assert_params_close, grid, one_device_steps, run_steps

M = 4  # microbatches per step
BATCH = 16


def _mlp(*widths: int):
    """The texts' model: Dense(784→512) → relu → Dense(512→10), or any widths."""

    def model_fn(rngs: nnx.Rngs) -> nnx.Sequential:
        layers = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers += [nnx.Linear(a, b, rngs=rngs)] + ([nnx.relu] if i < len(widths) - 2 else [])
        return nnx.Sequential(*layers)

    return model_fn


def _sparse_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _digits(step: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "x": rng.normal(size=(n, 784)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }


MLP = jaxpar.Task(
    _mlp(784, 512, 10),
    batch_axes={"x": ("batch", None), "y": ("batch",)},
    layers=jaxpar.Layers(inputs="x", loss=_sparse_ce),
    data=_digits,
    name="two_device_mlp",
)


def _cnn(rngs: nnx.Rngs) -> nnx.Sequential:
    """A stock NNX CNN as a sequence: Conv, BatchNorm, relu, Dropout, flatten, Dense ×2."""
    return nnx.Sequential(
        nnx.Conv(1, 8, (3, 3), rngs=rngs),
        nnx.BatchNorm(8, rngs=rngs),
        nnx.relu,
        nnx.Dropout(0.2, rngs=rngs),
        lambda x: x.reshape(x.shape[0], -1),
        nnx.Linear(8 * 8 * 8, 32, rngs=rngs),
        nnx.relu,
        nnx.Linear(32, 4, rngs=rngs),
    )


def _images(step: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    labels = rng.integers(0, 4, n)
    images = rng.normal(size=(n, 8, 8, 1)).astype(np.float32)
    images[np.arange(n), labels * 2, labels * 2] += 3.0
    return {"images": images, "labels": labels.astype(np.int32)}


def _ce_accuracy(logits, batch):
    labels = batch["labels"]
    return (
        optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
        {"accuracy": (logits.argmax(-1) == labels).mean()},
    )


CNN = jaxpar.Task(
    _cnn,
    batch_axes={"images": ("batch", None, None, None), "labels": ("batch",)},
    layers=jaxpar.Layers(inputs="images", loss=_ce_accuracy),
    data=_images,
    eval_data=lambda step, n: _images(10**6 + step, n),
    name="bn_cnn",
)


def _host(tree):
    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _train(task, overrides, optimizer, devices=8, steps=3):
    config = jaxpar.load_config(
        [], [*overrides, f"train.batch_size={BATCH}", f"run.devices={devices}"]
    )
    run = jaxpar.build(config, task, optimizer)
    state, losses = run.trainer.init(), []
    for step in range(steps):
        state, metrics = run.trainer.step(state, run.trainer.shard_batch(task.data(step, BATCH)))
        losses.append(float(metrics["loss"]))
    return run, state, np.array(losses)


def _one_device(task, optimizer):
    return _train(task, ["mesh.data=1", f"train.grad_accum={M}"], optimizer, devices=1)


#: the CNN's optimizer in the tests that compare it with one device (one object, so that
#: its one-device reference is trained once per test process: :func:`_cnn_reference`)
SGD = optax.sgd(0.1, momentum=0.9)


@functools.cache
def _cnn_reference():
    """:func:`_one_device` of the CNN with :data:`SGD` (its run and state are only read)."""
    return _one_device(CNN, SGD)


def _staged(task, optimizer, stages, schedule, virtual=1, extra=()):
    return _train(
        task,
        [
            f"mesh.stage={stages}",
            f"mesh.data={8 // stages}",
            f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={M}",
            f"pipeline.virtual_stages={virtual}",
            *extra,
        ],
        optimizer,
    )


@pytest.mark.parametrize(
    "schedule,widths,virtual",
    grid(
        [
            pytest.param("gpipe", (784, 512, 10), 1, id="gpipe"),
            pytest.param("1f1b", (784, 512, 10), 1, id="1f1b"),
            pytest.param("zb_h1", (784, 512, 10), 1, id="zb_h1"),
            # 2 chunks per device: 4 chunks, 7 layers
            pytest.param("interleaved", (784, 256, 128, 64, 10), 2, id="interleaved"),
        ],
        # every suite: 1F1B (Adam's moments against one device). The executor's other
        # schedules run its same chunk programs in another order: against one device in
        # every suite on the BatchNorm + Dropout CNN (zb_h1's split backward, the
        # interleaved chunks: test_batchnorm_and_dropout_live_in_their_stage; GPipe's
        # order of the same F and B programs: extended there too)
        {"1f1b"},
    ),
)
def test_the_two_device_model_equals_one_device(schedule, widths, virtual):
    """The texts' 784→512→10 model split by layer over 2 stages of 4 devices, with Adam:
    losses, parameters and optimizer state equal one device accumulating 4 microbatches."""
    task = dataclasses.replace(MLP, model_fn=_mlp(*widths))
    adam = optax.adam(1e-3)
    _ref_run, ref, ref_losses = _one_device(task, adam)
    run, got, losses = _staged(task, adam, 2, schedule, virtual)
    assert type(run.plan.gradients).__name__ == "SubMeshPipeline"
    assert len(run.plan.gradients.cut.chunks) == 2 * virtual
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_params_close(_host(got.params), _host(ref.params), elementwise=False)
    assert_params_close(_host(got.opt_state), _host(ref.opt_state), elementwise=False)


def test_each_layer_lives_on_its_stage():
    run, state, _ = _staged(MLP, optax.sgd(0.1, momentum=0.9), 2, "1f1b")
    meshes = run.plan.gradients.meshes
    first, second = (set(m.devices.flat) for m in meshes)
    assert state.params["layers"][0]["kernel"].sharding.device_set == first
    assert state.params["layers"][2]["kernel"].sharding.device_set == second
    assert state.opt_state[0].trace["layers"][2]["kernel"].sharding.device_set == second
    assert state.step.sharding.device_set == first | second  # read in place by every stage


@pytest.mark.parametrize(
    "stages,schedule,virtual",
    grid(
        [
            pytest.param(*c, id="-".join(map(str, c)))
            for c in ((2, "1f1b", 1), (2, "zb_h1", 1), (4, "gpipe", 1), (2, "interleaved", 2))
        ],
        # every suite: zb_h1 (its I and W programs) and the interleaved chunks (two a
        # stage). 1F1B and GPipe play the same F and B programs in another order (1F1B
        # against one device in every suite: test_the_two_device_model_equals_one_device;
        # GPipe's table in tests/test_pipeline.py's suite case); 4 stages: each stage's
        # programs take and send what they do with 2 (a chunk's neighbours by c ± 1): extended
        {"2-zb_h1-1", "2-interleaved-2"},
    ),
)
def test_batchnorm_and_dropout_live_in_their_stage(stages, schedule, virtual):
    """A BatchNorm + Dropout CNN in 2 and 4 stages equals one device with 4 accumulated
    microbatches: losses, parameters, running statistics, RNG counts, and evaluation on the
    running averages without dropout."""
    ref_run, ref, ref_losses = _cnn_reference()
    run, got, losses = _staged(CNN, SGD, stages, schedule, virtual)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_params_close(_host(got.params), _host(ref.params))
    got_state, ref_state = _host(got.model_state), _host(ref.model_state)
    assert jax.tree.structure(got_state) == jax.tree.structure(ref_state)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got_state), jax.tree.leaves(ref_state)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(path))
    assert int(got_state["layers"][3]["rngs"]["count"]) == 3 * M  # one draw per microbatch
    held_out = _images(10**6, BATCH)
    evals = [
        r.trainer.evaluate(s, r.trainer.shard_batch(held_out))
        for r, s in ((run, got), (ref_run, ref))
    ]
    np.testing.assert_allclose(float(evals[0]["loss"]), float(evals[1]["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(evals[0]["accuracy"]), float(evals[1]["accuracy"]))


def test_balanced_and_explicit_cuts():
    """The cut balances parameter bytes; pipeline.split overrides it."""
    from jaxpar.pipeline.cut import _balanced

    assert _balanced([401_408, 1, 5_130], 2) == [1, 2]  # the big layer alone
    assert _balanced([1, 1, 1, 1], 2) == [2, 2]
    config = jaxpar.load_config(
        [],
        [
            "mesh.stage=2",
            "mesh.data=4",
            f"pipeline.microbatches={M}",
            "pipeline.split=[2, 6]",
            f"train.batch_size={BATCH}",
        ],
    )
    run = jaxpar.build(config, CNN, optax.sgd(0.1))  # the cut is the plan's: nothing to train
    assert run.plan.gradients.cut.chunks == ((0, 2), (2, 8))


@pytest.mark.parametrize(
    "extra,task,error,message",
    [
        (
            ["pipeline.split=[1, 1]"],
            MLP,
            LayoutError,
            (
                r"pipeline.split=\[1, 1\] must give 2 chunks .* summing to the model's 3 layers; "
                r"e.g. pipeline.split=\[2, 1\]"
            ),
        ),
        (["pipeline.split=[3, 0]"], MLP, LayoutError, r"each of at least one layer"),
        (
            ["mesh.stage=4", "mesh.data=2"],
            MLP,
            LayoutError,
            r"the model has 3 layers, fewer than the 4 chunks",
        ),
        (
            [],
            dataclasses.replace(MLP, layers=None, loss_fn=lambda m, b: (0.0, {})),
            LayoutError,
            r"mesh.stage=2, but this model cannot be split into pipeline stages",
        ),
        (
            ["pipeline.executor=mpmd"],
            dataclasses.replace(MLP, layers=None, loss_fn=lambda m, b: (0.0, {})),
            TaskError,
            (
                r"pipeline.executor=mpmd cuts a model by layer, but this task declares no "
                r"layers; give the Task layers=jaxpar.Layers"
            ),
        ),
    ],
)
def test_a_cut_that_cannot_be_made_is_one_line(extra, task, error, message):
    overrides = ["mesh.stage=2", "mesh.data=4", *extra]
    with pytest.raises(error, match=message) as err:
        jaxpar.build(
            jaxpar.load_config([], [*overrides, f"train.batch_size={BATCH}"]), task, optax.sgd(0.1)
        )
    assert "\n" not in str(err.value)


def test_clipping_spans_the_stages():
    """jaxpar's global-norm clip reads the whole model's norm on every stage: clipped steps
    equal one device's; optax's own clip inside a chain would see one stage's norm, and is
    refused in one line naming the fix."""
    clipped = optax.chain(jaxpar.clip_by_global_norm(0.05), optax.sgd(0.1))
    _, ref, ref_losses = _one_device(MLP, clipped)
    run, got, losses = _staged(MLP, clipped, 2, "1f1b")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_params_close(_host(got.params), _host(ref.params))
    norm = float(run.trainer.step(got, run.trainer.shard_batch(_digits(3, BATCH)))[1]["grad_norm"])
    assert norm > 0.05  # the clip was active
    with pytest.raises(
        LayoutError,
        match=r"this optimizer's update of layers/0/bias depends on "
        r"other stages' gradients .* jaxpar.clip_by_global_norm",
    ):
        _staged(MLP, optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)), 2, "1f1b")


@pytest.mark.heavy  # 12 s: the sub-mesh executor's steps equal one device in every suite
def test_checkpoints_resume_bitwise_and_restore_onto_another_layout(tmp_path):
    """The train state spans the sub-meshes as one tree: a run stopped at a checkpoint and
    resumed ends bitwise where the uninterrupted run does, and its checkpoint restores onto
    a layout without stages (and that one's back onto the stages) with equal values."""
    from jaxpar.resume import restore_state

    adam = optax.adam(1e-3)
    common = [
        "train.log_every=1",
        "train.eval_every=0",
        "train.progress=false",
        "checkpoint.every_steps=2",
        "checkpoint.async_save=false",
        f"train.batch_size={BATCH}",
    ]
    staged = ["mesh.stage=2", "mesh.data=4", f"pipeline.microbatches={M}"]

    def train(steps, run_dir, layout=staged):
        config = jaxpar.load_config(
            [], [*common, *layout, f"train.steps={steps}", f"run.dir={run_dir}"]
        )
        return jaxpar.train(config, task=CNN, optimizer=adam, echo=False)

    whole = train(4, tmp_path / "whole")
    first = train(2, tmp_path / "split")
    resumed = train(4, tmp_path / "split")
    assert [r["loss"] for r in resumed.train_rows] == [r["loss"] for r in whole.train_rows[2:]]
    for a, b in zip(jax.tree.leaves(_host(whole.state)), jax.tree.leaves(_host(resumed.state))):
        np.testing.assert_array_equal(a, b)
    flat = ["mesh.data=8", "train.grad_accum=2"]
    # from the stages: the split run's checkpoint of step 2 (its first run's state); from
    # the layout without them: a run of 2 steps
    for source, target, run_dir, done in (
        (staged, flat, tmp_path / "split", first),
        (flat, staged, tmp_path / "flat", None),
    ):
        done = done or train(2, run_dir, source)
        config = jaxpar.load_config([], [*common, *target, "train.steps=2", f"run.dir={run_dir}"])
        restored = restore_state(jaxpar.build(config, CNN, adam), 2, "test")
        for a, b in zip(jax.tree.leaves(_host(done.state)), jax.tree.leaves(_host(restored))):
            np.testing.assert_array_equal(a, b)
        assert restored.params["layers"][0]["kernel"].sharding.mesh.shape["stage"] == 1


GPT = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.d_ff=32",
    "model.max_seq_len=8",
    "data.seq_len=8",
    "train.batch_size=32",
    "model.n_layers=4",
    "optim.name=adamw",
    "optim.lr=3e-3",
    "optim.weight_decay=0.1",
    "optim.clip_norm=1.0",
    "optim.warmup_steps=0",
]


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.stage=2", "mesh.data=4", "pipeline.schedule=1f1b"], id="data4"),
            pytest.param(
                ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2", "pipeline.schedule=gpipe"],
                id="data2-tensor2",
            ),
            pytest.param(
                ["mesh.stage=4", "mesh.data=2", "pipeline.schedule=zb_h1"], id="stage4-zb_h1"
            ),
            # two chunks a stage: each runs away from its slab of the stack and comes back
            # (4 stages ≠ 2 chunks a stage, one layer each: slab c div v, stage c mod p)
            pytest.param(
                [
                    "mesh.stage=4",
                    "mesh.data=2",
                    "model.n_layers=8",
                    "pipeline.schedule=interleaved",
                    "pipeline.virtual_stages=2",
                ],
                id="interleaved",
            ),
            # two layers a chunk: the second chunk of a slab starts inside it
            pytest.param(
                [
                    "mesh.stage=2",
                    "mesh.data=4",
                    "model.n_layers=8",
                    "pipeline.schedule=interleaved",
                    "pipeline.virtual_stages=2",
                ],
                id="interleaved-2-layers-a-chunk",
            ),
        ],
        # all in the extended tier: the suite runs the sub-mesh executor's interleaved
        # schedule on the BatchNorm + Dropout CNN (test_batchnorm_and_dropout_live_in_their_stage),
        # the GPT's interleaved stack on the spmd executor (tests/test_pipeline.py), a
        # transformer under the sub-mesh executor in MoE's pipelines (the overlap's and
        # context's pipelines, with tensor inside its stages: extended)
        set(),
    ),
)
def test_gpt_under_both_executors_equals_one_device(layout):
    """The GPT (a StageSplit stack, AdamW with clipping and weight decay) under the sub-mesh
    executor = under the spmd executor = one device: losses and parameters; the two
    executors' states are laid out alike (a checkpoint of one restores onto the other)."""
    model = [o for o in layout if o.startswith("model.")]
    one = one_device_steps([*GPT, *model, "train.grad_accum=4"])
    common = [*GPT, *layout, "pipeline.microbatches=4"]
    spmd = run_steps([*common, "pipeline.executor=spmd"])
    mpmd = run_steps([*common, "pipeline.executor=mpmd"])
    assert type(mpmd[2].plan.gradients).__name__ == "SubMeshPipeline"
    assert type(spmd[2].plan.gradients).__name__ == "Pipelined"
    for losses, params, _ in (spmd, mpmd):
        np.testing.assert_allclose(losses, one[0], rtol=1e-5)
        assert_params_close(params, one[1], elementwise=False, rtol=1e-4)
    assert_params_close(mpmd[1], spmd[1], elementwise=False, rtol=1e-4)
    specs = lambda run: jax.tree.map(lambda s: (s.spec, s.mesh.shape), run.plan.state_shardings)
    assert specs(mpmd[2]) == specs(spmd[2])


#: one chunk a stage and two, interleaved, both in the extended tier: the suite runs dropout
#: in the sub-mesh executor's stages (test_batchnorm_and_dropout_live_in_their_stage), and
#: BERT's masked, pipelined loss on the spmd executor is heavy (tests/test_pack_families.py)
SCHEDULES = [
    pytest.param([], id="1f1b", marks=pytest.mark.exhaustive),
    pytest.param(
        ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
        id="interleaved",
        marks=pytest.mark.exhaustive,
    ),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bert_dropout_and_masks_under_both_executors(schedule):
    """BERT (dropout and masks keyed by the RNG stream's count and the example id) under the
    sub-mesh executor: losses and parameters equal the spmd executor's (the same dropout
    and masks; interleaved, each chunk draws as its layers do there); evaluation through
    the stages agrees."""
    common = [
        *GPT,
        "model.name=bert",
        "mesh.stage=2",
        "mesh.data=4",
        "pipeline.microbatches=4",
        *schedule,
    ]
    spmd = run_steps([*common, "pipeline.executor=spmd"])
    mpmd = run_steps([*common, "pipeline.executor=mpmd"])
    np.testing.assert_allclose(mpmd[0], spmd[0], rtol=1e-5)
    assert_params_close(mpmd[1], spmd[1], elementwise=False, rtol=1e-4)
    run = mpmd[2]
    batch = run.trainer.shard_batch(run.data.batch(0, 32, "eval"))
    state = run.trainer.init()
    got = run.trainer.evaluate(state, batch)
    want = spmd[2].trainer.evaluate(state, batch)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)


def test_inspect_and_the_lab_measure_each_stage(capsys):
    """``jaxpar inspect`` and ``sweep`` read the sub-mesh step: per stage, one device's
    state (the first stage holds the 784×512 layer, the second the 512×10 one), gradient
    sums the size of its parameters, and the activations and gradients it sends — a
    microbatch's 512-wide hidden activation, every microbatch."""
    from jaxpar.lab import hardware, sweep
    from jaxpar.report import layout_totals

    config = jaxpar.load_config(
        [],
        ["mesh.stage=2", "mesh.data=4", f"train.batch_size={BATCH}", f"pipeline.microbatches={M}"],
    )
    run = jaxpar.build(config, MLP)
    totals = layout_totals(run)
    first, second = totals.stages
    assert first.grad_sum_bytes == (784 * 512 + 512) * 4
    assert second.grad_sum_bytes == (512 * 10 + 10) * 4
    rows = BATCH // M // 4  # a microbatch's rows on one device (data=4)
    assert first.sent_bytes == second.sent_bytes == M * rows * 512 * 4
    assert totals.params_bytes == first.grad_sum_bytes  # the most loaded device's
    row = sweep.measure(config, "stage=2,data=4", hardware.get_profile("h100"), task=MLP)
    assert row.ok, row.error
    assert row.mem_args_bytes == row.predicted_mem_args_bytes
    # each microbatch's backward all-reduces its chunk's gradients over data (4 per step)
    assert row.all_reduce_bytes == pytest.approx(M * 2 * 3 / 4 * first.grad_sum_bytes, rel=0.01)
    assert row.comm_ratio == pytest.approx(1.0, abs=0.01)
    # the stages' programs summed: arrays and participants as well as counts (each
    # all-reduce waits for the 4 devices of data)
    assert row.collective_arrays >= row.collective_ops > 0
    assert row.collective_participants == 4 * row.collective_ops


def test_sweep_all_leaves_out_stage_layouts_of_a_model_that_cannot_be_split():
    from jaxpar.lab import sweep

    config = jaxpar.load_config([], [])
    plain = dataclasses.replace(MLP, layers=None, loss_fn=lambda m, b: (0.0, {}))
    kept, note = sweep.default_layouts(config, 8, plain)
    no_context = [x for x in sweep.all_layouts(8) if "context=" not in x]
    # beside data=8 its other gradient reduction (here XLA's: auto is buckets on the CPU)
    other = "data=8,train.grad_bucket_mb=0"
    assert kept == [*(x for x in no_context if "stage=" not in x), other] and len(kept) == 11
    assert note.startswith(f"note: 15 layouts with mesh.stage > 1 left out: {MLP.name} cannot")
    assert note.splitlines()[1].startswith(
        f"note: 10 layouts with mesh.context > 1 left out: {MLP.name} does not run"
    )
    assert sweep.default_layouts(config, 8, MLP)[0] == [*no_context, other]


class _StopAt(jaxpar.Hook):
    """Sends this process a SIGTERM when it sees ``step``'s metrics (a preemption)."""

    def __init__(self, step):
        self.step = step

    def on_step(self, ctx, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


# Extended tier: the handler is the loop's whatever the executor (every suite sends SIGTERM
# to a user's task and resumes it bitwise in tests/test_user_task.py, Ctrl-C in
# tests/test_faults.py), and the sub-mesh state — parameters, Adam's moments, BatchNorm
# statistics and the dropout stream on their stages — resumes bitwise from a checkpoint in
# every CI (test_checkpoints_resume_bitwise_and_restore_onto_another_layout, heavy)
@pytest.mark.exhaustive
def test_sigterm_then_resume_is_bitwise(tmp_path):
    """A SIGTERM mid-run checkpoints the step it stopped at; resuming ends bitwise where
    the uninterrupted run does: parameters, Adam's moments, BatchNorm statistics and the
    dropout stream's key and count, each on its stage."""
    common = [
        "train.log_every=1",
        "train.eval_every=0",
        "train.progress=false",
        "checkpoint.every_steps=100",
        f"train.batch_size={BATCH}",
        "mesh.stage=2",
        "mesh.data=4",
        f"pipeline.microbatches={M}",
        "pipeline.schedule=zb_h1",
        "train.steps=8",
    ]
    config = lambda run_dir: jaxpar.load_config([], [*common, f"run.dir={run_dir}"])
    adam = optax.adam(1e-3)
    whole = jaxpar.train(config(tmp_path / "whole"), task=CNN, optimizer=adam, echo=False)
    with pytest.raises(jaxpar.loop.Preempted) as stop:
        jaxpar.train(
            config(tmp_path / "cut"), task=CNN, optimizer=adam, hooks=[_StopAt(3)], echo=False
        )
    assert 3 <= stop.value.step < 8
    resumed = jaxpar.train(config(tmp_path / "cut"), task=CNN, optimizer=adam, echo=False)
    assert resumed.train_rows[0]["step"] == stop.value.step + 1
    for a, b in zip(jax.tree.leaves(_host(whole.state)), jax.tree.leaves(_host(resumed.state))):
        np.testing.assert_array_equal(a, b)
    assert int(_host(resumed.state.model_state)["layers"][3]["rngs"]["count"]) == 8 * M


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_checkpoint_restores_across_executors(tmp_path, schedule):
    """A GPT checkpoint of the sub-mesh executor restores under the spmd executor (and one
    of the spmd executor under the sub-mesh one) with identical values — interleaved too,
    whose stack the sub-mesh executor keeps stored as the spmd one does."""
    from jaxpar.resume import restore_state

    common = [
        *GPT,
        *schedule,
        "mesh.stage=2",
        "mesh.data=4",
        "pipeline.microbatches=4",
        "train.steps=2",
        "train.eval_every=0",
        "train.progress=false",
        "checkpoint.async_save=false",
    ]
    for source, target in (("mpmd", "spmd"), ("spmd", "mpmd")):
        run_dir = tmp_path / source
        config = lambda executor, run_dir=run_dir: jaxpar.load_config(
            [], [*common, f"pipeline.executor={executor}", f"run.dir={run_dir}"]
        )
        done = jaxpar.train(config(source), echo=False)
        restored = restore_state(jaxpar.build(config(target)), 2, "test")
        for a, b in zip(jax.tree.leaves(_host(done.state)), jax.tree.leaves(_host(restored))):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "schedule",
    # every suite: 1F1B (a backward program from the residuals). zb_h1's I and W programs
    # from the residuals are the same chunk_program grads over the stash (with residuals:
    # the forward's vjp, called by each half) as 1F1B's B here, and run from a recomputed
    # forward in every suite in test_batchnorm_and_dropout_live_in_their_stage[2-zb_h1-1]:
    # extended
    grid([pytest.param("1f1b", id="1f1b"), pytest.param("zb_h1", id="zb_h1")], {"1f1b"}),
)
def test_a_backward_from_kept_residuals_equals_one_device(schedule):
    """``pipeline.backward=residuals``: each forward keeps its backward's residuals (no
    second forward): the BatchNorm + Dropout CNN still equals one device accumulating —
    losses, parameters, statistics, RNG counts."""
    _, ref, ref_losses = _cnn_reference()
    run, got, losses = _staged(CNN, SGD, 2, schedule, extra=["pipeline.backward=residuals"])
    assert run.plan.gradients.residuals
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_params_close(_host(got.params), _host(ref.params))
    for a, b in zip(
        jax.tree.leaves(_host(got.model_state)), jax.tree.leaves(_host(ref.model_state))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mpmd_settings_under_the_spmd_executor_are_refused():
    """``pipeline.backward`` and ``pipeline.split`` are the sub-mesh executor's; a split is a
    model-by-layers' only (a stack is cut into equal chunks under either executor: it was
    silently ignored under mpmd); ring attention inside the spmd executor deadlocks on the
    CPU, so it is refused there (and planned for a GPU: the lab compiles it)."""
    base = [*GPT, "mesh.stage=2", "mesh.data=4"]
    for setting, said in (
        ("pipeline.backward=residuals", "applies to pipeline.executor=mpmd, but this layout "),
        ("pipeline.split=[2,2]", "under pipeline.executor=mpmd, but this layout runs the spmd"),
    ):
        with pytest.raises(LayoutError, match=re.escape(said)):
            jaxpar.build(jaxpar.load_config([], [*base, setting]))
    with pytest.raises(LayoutError, match=r"this model is a stack of layers .* leave pipeline"):
        mpmd = [*base, "pipeline.executor=mpmd", "pipeline.split=[1,1]"]
        jaxpar.build(jaxpar.load_config([], mpmd))
    ring = jaxpar.load_config(
        [], [*GPT, "mesh.stage=2", "mesh.data=2", "mesh.context=2", "context.attention=ring"]
    )
    with pytest.raises(LayoutError, match="deadlocks on XLA:CPU.*use context.attention=all_ga"):
        jaxpar.build(ring)
    assert jaxpar.build(ring, platform="gpu").plan.layout.table is not None


def test_a_skipped_step_logs_and_counts_as_on_one_device():
    """A non-finite step under the mpmd executor: skipped on every stage (parameters and
    optimizer state kept), counted, and the logged ``lr`` is the rate its update would have
    applied — the same metrics as one device's."""

    def data(step, n):
        batch = _digits(step, n)
        return {**batch, "x": batch["x"] * np.nan} if step == 1 else batch

    warmup = jaxpar.load_config([], ["optim.warmup_steps=4"]).optim
    tx, lr = jaxpar.optim.make_optimizer(warmup, 8)
    rows = []
    for layout in (
        ["mesh.data=1", f"train.grad_accum={M}", "run.devices=1"],
        ["mesh.stage=2", "mesh.data=4", f"pipeline.microbatches={M}", "pipeline.executor=mpmd"],
    ):
        run = jaxpar.build(
            jaxpar.load_config([], [*layout, f"train.batch_size={BATCH}"]),
            dataclasses.replace(MLP, data=data),
            tx,
        )
        state, logged = run.trainer.init(), []
        for step in range(3):
            state, metrics = run.trainer.step(state, run.trainer.shard_batch(data(step, BATCH)))
            logged.append((float(metrics["lr"]), int(metrics["skipped"])))
        rows.append(logged)
    assert [s for _, s in rows[0]] == [s for _, s in rows[1]] == [0, 1, 1]
    np.testing.assert_allclose([r for r, _ in rows[1]], [r for r, _ in rows[0]], rtol=0)
    np.testing.assert_allclose([r for r, _ in rows[0]], [lr(0), lr(1), lr(1)], rtol=1e-6)
