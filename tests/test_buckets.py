"""Gradients summed over ``data`` in buckets (``train.grad_bucket_mb``, :mod:`jaxpar.buckets`):
the same sums as one collective per array, a collective per bucket in the compiled step,
training equal to one device, the lab's count of the reductions."""

import warnings
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import hlo
from jaxpar.buckets import auto_bytes, groups, psum_in_buckets
from jaxpar.config import apply_overrides, load_config
from jaxpar.errors import ConfigError
from jaxpar.gradients import AccumulatedPerDataShard, Pipelined, Plain
from jaxpar.lab import hardware, predict, sweep
from jaxpar.lab.measure import Lowered, Row, read
from jaxpar.run import build
from tests.helpers import GPT_SMALL, assert_params_close, measured_once

ADAMW = ["optim.name=adamw", "optim.lr=3e-3", "optim.weight_decay=0.1"]
BUCKETS = ["train.grad_bucket_mb=25"]  # PyTorch DDP's size: the whole small GPT in one
PER_ARRAY = ["train.grad_bucket_mb=0"]  # XLA's reduction (the default on GPUs)


def _shapes(*specs):
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]


def test_groups_lay_consecutive_arrays_of_one_dtype_up_to_the_bucket_size():
    """Consecutive leaves of one dtype share a bucket while they fit; a dtype change or
    a full bucket starts the next; a leaf larger than a bucket is one alone; 0 bytes is
    one leaf a bucket."""
    leaves = _shapes(
        ((10,), jnp.float32),  # 40 B
        ((5,), jnp.float32),  # 20 B
        ((3,), jnp.int32),
        ((100,), jnp.float32),  # 400 B: over the bucket
        ((2,), jnp.float32),
        ((4,), jnp.float32),
    )
    assert groups(leaves, 64) == [[0, 1], [2], [3], [4, 5]]
    assert groups(leaves, 10**6) == [[0, 1], [2], [3, 4, 5]]
    assert groups(leaves, 0) == [[i] for i in range(6)]


def _summed(tree, bucket_bytes):
    mesh = jax.make_mesh((8,), ("data",))
    tree = jax.device_put(tree, NamedSharding(mesh, PartitionSpec("data")))

    def local(t):
        t = jax.tree.map(lambda x: x[0], t)
        if bucket_bytes is None:
            return jax.lax.psum(t, "data")
        return psum_in_buckets(t, "data", bucket_bytes)

    fn = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec())
    )
    return fn(tree), hlo.collective_stats(fn.lower(tree).compile().as_text())["all-reduce"]


@pytest.mark.parametrize("bucket_bytes", [0, 600, 10**6])
def test_buckets_sum_bit_for_bit_as_a_psum_per_array(bucket_bytes):
    """Each element is the same sum of the same 8 values: the buckets' results equal a
    ``psum`` of each array bit for bit, floats and integers. With buckets larger than the
    tree the compiled program reduces one array per dtype (2), where a psum per array
    reduces 3 or 4 (XLA concatenates some)."""
    keys = jax.random.split(jax.random.key(0), 3)
    tree = {
        "a": jax.random.normal(keys[0], (8, 33, 7)),
        "b": jax.random.normal(keys[1], (8, 5)),
        "c": jax.random.normal(keys[2], (8, 30, 3)),
        "n": jnp.arange(8 * 4, dtype=jnp.int32).reshape(8, 4),
    }
    ours, stat = _summed(tree, bucket_bytes)
    ref, per_array = _summed(tree, None)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    assert per_array.arrays >= 3  # XLA may combine a few; never into one buffer
    if bucket_bytes == 10**6:
        assert (stat.count, stat.arrays) == (2, 2)


def _steps(overrides: list[str], devices: int, steps: int = 3, grads: bool = True):
    """Losses of ``steps`` steps, the first batch's gradients (``grads``; else None: one
    program fewer to compile), the parameters after the first step, the run."""
    cfg = load_config([], [*GPT_SMALL, *ADAMW, *overrides, f"run.devices={devices}"])
    run = build(cfg)
    state = run.trainer.init()
    first = run.trainer.shard_batch(run.data.batch(0, cfg.train.batch_size))
    if grads:
        grads = jax.tree.map(np.asarray, run.trainer.grads(state.params, first)[2])
    else:
        grads = None
    losses, after_first = [], None
    for step in range(steps):
        batch = run.trainer.shard_batch(run.data.batch(step, cfg.train.batch_size))
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        after_first = after_first or jax.tree.map(np.asarray, state.params)
    return np.array(losses), grads, after_first, run


@pytest.mark.parametrize(
    "accum",
    [1, pytest.param(2, marks=pytest.mark.exhaustive)],  # accumulation's own test: test_train
    ids=["plain", "accum2"],
)
def test_bucketed_data_parallelism_equals_one_device_and_the_per_array_step(accum):
    """GPT on ``data=8`` (with ``train.grad_accum`` 1 and 2): 25 MiB buckets sum its
    gradients, loss and metrics in one bucket (one all-reduce of one array in the compiled
    step, where one collective per array reduces 10 arrays a layer inside the layer scan
    and 6 outside); the first-step gradients equal one device's elementwise (1e-5 of each
    tensor's scale), the losses of 3 AdamW steps to rtol 1e-5 and the parameters after the
    first per tensor to 1e-4 (tests/test_equivalence.py's AdamW tolerances); against the
    per-array step the losses agree to rtol 1e-6 (float32 summation order: bit for bit in
    the runs measured)."""
    extra = [f"train.grad_accum={accum}"]
    ref_losses, ref_grads, ref_params, _ = _steps(["mesh.data=1", *extra], 1)
    losses, grads, params, run = _steps(["mesh.data=8", *extra, *BUCKETS], 8)
    assert isinstance(run.plan.gradients, AccumulatedPerDataShard)
    assert run.plan.gradients.bucket_bytes == 25 * 2**20
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
    assert_params_close(params, ref_params, elementwise=False, rtol=1e-4)
    per_array, _, _, per_array_run = _steps(["mesh.data=8", *extra, *PER_ARRAY], 8, grads=False)
    np.testing.assert_allclose(losses, per_array, rtol=1e-6)
    batch = run.data.batch(0, run.config.train.batch_size)
    stat = hlo.program_cost(run.trainer.compile_step(batch).as_text()).collectives["all-reduce"]
    assert (stat.count, stat.arrays) == (1, 1)
    if accum == 1:
        assert isinstance(per_array_run.plan.gradients, Plain)
        text = per_array_run.trainer.compile_step(batch).as_text()
        assert hlo.program_cost(text).collectives["all-reduce"].arrays == 10 * 2 + 6


@pytest.mark.exhaustive  # the per-shard step under context: tests/test_context.py's too
def test_buckets_compose_with_context_parallelism():
    """``data=4,context=2``: the parameters are whole on every device, so the step sums
    its gradients in buckets over ``data`` (the context axis's sums stay XLA's, inside the
    per-shard step); its losses and first gradients equal one device's."""
    ref_losses, ref_grads, _, _ = _steps(["mesh.data=1"], 1)
    losses, grads, _, run = _steps(["mesh.data=4", "mesh.context=2", *BUCKETS], 8)
    assert run.plan.gradients.bucket_bytes > 0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_the_lab_counts_one_reduction_per_bucket():
    """The lab's prediction of the bucketed step: the gradients' all-reduce bytes are the
    per-array step's, and its count is the buckets' (1), as compiled."""
    config = load_config([], [*GPT_SMALL, "run.devices=8", "mesh.data=8", *BUCKETS])
    bucketed = predict.predict_comm(build(config), "cpu")
    per_array = predict.predict_comm(build(apply_overrides(config, PER_ARRAY)), "cpu")
    reductions = [t for t in bucketed.terms if t.kind == "all-reduce"]
    assert [t.times for t in reductions] == [1]
    assert reductions[0].wire_bytes == pytest.approx(per_array.by_kind()["all-reduce"])
    assert len([t for t in per_array.terms if t.kind == "all-reduce"]) > 10


@pytest.mark.parametrize(
    "layout,strategy",
    [
        (["mesh.fsdp=8"], Plain),
        (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], Plain),
        (["mesh.data=4", "mesh.tensor=2"], Plain),
        (["mesh.data=4", "mesh.stage=2", "pipeline.microbatches=2"], Pipelined),
    ],
    ids=["fsdp=8", "data=2,fsdp=2,tensor=2", "data=4,tensor=2", "data=4,stage=2"],
)
def test_layouts_that_split_parameters_keep_one_reduction_per_array(layout, strategy):
    """Buckets lay whole arrays end to end: where a parameter is split (fsdp, tensor) or
    the pipeline reduces, the step keeps XLA's reduction of each array (today's strategy,
    unchanged), and the key set says in a warning that it has no effect; with
    accumulation over a split parameter the per-shard step sums each array apart."""
    cfg = load_config([], [*GPT_SMALL, "run.devices=8", *layout, *BUCKETS])
    with pytest.warns(UserWarning, match="train.grad_bucket_mb' has no effect"):
        assert type(build(cfg).plan.gradients) is strategy
    accum = build(
        apply_overrides(cfg, ["train.grad_accum=2", "train.batch_size=32"])
    ).plan.gradients
    assert getattr(accum, "bucket_bytes", 0) == 0


def _read_trained(run, layout: str, hw) -> Row:
    """The lab's row of ``run``'s compiled train step (the one its steps ran: compiling it
    again for the shapes of a batch finds it in JAX's cache), read for ``hw``."""
    batch = run.data.batch(0, run.config.train.batch_size)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    lowered = Lowered(Row(layout, hardware=hw.key), run, shapes, run.trainer.lower_step(shapes))
    return read(lowered, run.trainer.compile_step(shapes), 0.0, hw)


@pytest.mark.heavy  # 15 s: the bucketed per-shard step equals one device in every suite
def test_a_split_gradient_is_summed_over_data_where_it_lies():
    """``data=4,tensor=2`` with accumulation: the per-shard step sums each array apart,
    and a gradient split over ``tensor`` as it lies — the compiled step gathers nothing
    (laid out flat, each was gathered whole over ``tensor`` first and summed whole: 1.66×
    the bytes of the lab's prediction), its collective bytes equal the prediction to 1%,
    and its losses and first gradients equal one device's."""
    layout = ["mesh.data=4", "mesh.tensor=2", "train.grad_accum=2"]
    ref_losses, ref_grads, _, _ = _steps(["mesh.data=1", "train.grad_accum=2"], 1)
    losses, grads, _, run = _steps(layout, 8)
    assert isinstance(run.plan.gradients, AccumulatedPerDataShard)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
    # the lab's reading (jaxpar.lab.measure.read) of the step just trained: the layout's
    # step as measure(config, "data=4,tensor=2,train.grad_accum=2", h100) builds it (the
    # same plan: buckets apply on neither platform here), not built and compiled again
    row = _read_trained(run, "data=4,tensor=2,train.grad_accum=2", hardware.get_profile("h100"))
    assert row.all_gather_bytes == 0
    assert row.comm_ratio == pytest.approx(1.0, abs=0.01)


def test_auto_means_buckets_on_the_cpu_and_xla_reduction_on_gpus():
    """``train.grad_bucket_mb=auto`` (the default): 25 MiB buckets on the CPU, where each
    array of a combined all-reduce is a gloo call of its own; XLA's reduction inside the
    backward scan on GPUs and TPUs. Where buckets cannot apply, auto says nothing (only a
    size the user set warns). Under ``context`` auto keeps XLA's reduction: the per-shard
    step there held the position embeddings' gradient whole over the sequence
    (tests/test_context.py -k full_sequence)."""
    assert (auto_bytes("cpu"), auto_bytes("gpu"), auto_bytes("tpu")) == (25 * 2**20, 0, 0)
    config = load_config([], [*GPT_SMALL, "run.devices=8", "mesh.data=8"])
    assert config.train.grad_bucket_mb == "auto"
    gradients = build(config).plan.gradients
    assert isinstance(gradients, AccumulatedPerDataShard)
    assert gradients.bucket_bytes == 25 * 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split = build(apply_overrides(config, ["mesh.data=1", "mesh.fsdp=8"]))
        context = build(apply_overrides(config, ["mesh.data=4", "mesh.context=2"]))
    assert type(split.plan.gradients) is Plain and type(context.plan.gradients) is Plain


def test_plan_reads_auto_for_the_profile_and_shows_the_other_reduction_beside_it():
    """``jaxpar plan`` predicts for the profile's platform: on an H100 auto compiles XLA's
    reduction (3 all-reduces of 26 arrays: one of 10 in the scan over the 2 layers, one of
    6 outside), and the planner's layouts add the bucketed
    variant (1 of 1) beside each layout whose parameters stay whole — not for split ones
    or a model with state. A profile whose latency is paid per array (gloo) prices 26
    calls where one per instruction prices 3; the bucketed step costs one either way."""
    config = load_config([], GPT_SMALL)
    h100 = hardware.get_profile("h100")
    layouts, _ = sweep.default_layouts(config, 8, platform=h100.platform)
    assert "data=8,train.grad_bucket_mb=25" in layouts
    with_bucket_variant = [x.rsplit(",", 1)[0] for x in layouts if "grad_bucket" in x]
    assert with_bucket_variant == ["data=8"]  # not beside split parameters or context
    assert "data=8,train.grad_bucket_mb=0" in sweep.default_layouts(config, 8, platform="cpu")[0]
    resnet = load_config([], ["model.name=resnet"])  # BatchNorm statistics: state
    assert not any("grad_bucket" in x for x in sweep.default_layouts(resnet, 8)[0])

    gloo = replace(h100, key="gloo", latency_per="array")
    measure = measured_once()  # one program per layout, read for both profiles
    rows = {
        (x, hw.key): measure(config, x, hw)
        for x in ("data=8", "data=8,train.grad_bucket_mb=25")
        for hw in (h100, gloo)
    }
    per_array = rows["data=8", "h100"]
    assert (per_array.collective_ops, per_array.collective_arrays) == (3, 10 * 2 + 6)
    assert per_array.predicted_latency_s == pytest.approx(3 * h100.collective_latency)
    assert rows["data=8", "gloo"].predicted_latency_s == pytest.approx(26 * h100.collective_latency)
    for hw in ("h100", "gloo"):
        bucketed = rows["data=8,train.grad_bucket_mb=25", hw]
        assert (bucketed.collective_ops, bucketed.collective_arrays) == (1, 1)
        assert bucketed.predicted_latency_s == pytest.approx(h100.collective_latency)
        assert bucketed.predicted_comm_bytes == pytest.approx(per_array.predicted_comm_bytes)


def test_a_profile_names_what_its_latency_is_paid_for(tmp_path):
    """``latency_per`` and ``platform`` are optional profile fields with a closed set of
    values: anything else is a one-line error naming the profile, field and choices."""
    path = tmp_path / "hw.yaml"
    entry = {f: getattr(hardware.get_profile("h100"), f) for f in ("name", "flops_bf16")}
    numbers = ("flops_f32", "hbm_bandwidth", "memory_bytes", "link_bandwidth", "links")
    entry |= {f: getattr(hardware.get_profile("h100"), f) for f in numbers}
    entry |= {"network_bandwidth": 1e9, "collective_latency": 4e-3, "platform": "cpu"}
    path.write_text(yaml.safe_dump({"mine": {**entry, "latency_per": "array"}}))
    mine = hardware.get_profile("mine", path)
    assert (mine.platform, mine.latency_per) == ("cpu", "array")
    assert hardware.get_profile("h100").latency_per == "collective"
    path.write_text(yaml.safe_dump({"mine": {**entry, "latency_per": "bucket"}}))
    with pytest.raises(ConfigError, match="'mine': latency_per='bucket'; choose one of"):
        hardware.get_profile("mine", path)


@pytest.mark.parametrize("value", ["-1", "big", "1e-9"])
def test_a_bucket_size_that_is_not_one_is_one_line(value):
    """A negative size, a word other than auto, or less than a byte (which would round to
    0, XLA's reduction, unasked): one line naming the key and the choices."""
    with pytest.raises(
        ConfigError, match=r"train.grad_bucket_mb=.*a bucket size in MiB .* or auto"
    ):
        load_config([], [f"train.grad_bucket_mb={value}"])
