"""A user's own model gets the layouts and precisions the built-in transformers get
(docs/own-model.md): sequence parallelism (``tensor.sequence``) when it names its residual
stream ``act_seq``, and a one-line error when it does not; FP8 matmuls through
``jaxpar.models.fp8.einsum``; the named remat policies through ``checkpoint_name`` tags with
the public names. Each equals one device.

A user's task does not read the ``model`` section (``model.precision``, ``model.remat``
warn that they have no effect for it): the model takes its precision and its
``jax.checkpoint`` policy as its own arguments, here ``UserLM(precision=, remat=)``."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxpar
from jaxpar.models import fp8
from jaxpar.models.transformer import MLP_IN, MLP_OUT, REMAT_POLICIES
from tests.test_fp8 import E4M3, E5M2, _dot_dtypes

V, D, F, T, B = 64, 32, 64, 16, 8  # vocabulary, width, MLP width, tokens, rows
#: the residual stream's logical names: ``act_seq`` is what sequence parallelism splits
RESIDUAL = ("batch", "act_seq", "act_embed")
BASE = ["train.batch_size=8", "optim.name=adamw", "optim.lr=3e-3", "optim.warmup_steps=0"]
LAYOUT = ["mesh.data=2", "mesh.tensor=2"]
SP = "tensor.sequence=true"


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple, scale: float) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape) * scale, out_sharding=names)


def mlp(x_BTD, w_in_DF, w_out_FD, precision: str):
    """A user's MLP: both projections through ``fp8.einsum`` at ``precision``, their outputs
    tagged with the public names the remat policies save (``MLP_IN``, ``MLP_OUT``)."""
    u_BTF = checkpoint_name(fp8.einsum("btd,df->btf", x_BTD, w_in_DF, precision=precision), MLP_IN)
    u_BTF = jaxpar.constrain(u_BTF, ("batch", "seq", "mlp"))  # tensor-parallel, as Megatron's
    out_BTD = fp8.einsum("btf,fd->btd", jax.nn.gelu(u_BTF), w_out_FD, precision=precision)
    return checkpoint_name(out_BTD, MLP_OUT)


def _constrained(x_BTD, stream: bool):
    """The residual stream pinned to :data:`RESIDUAL` (``stream``), else to ``("batch",
    "seq", "act_embed")``: the same layout, but one sequence parallelism does not split."""
    return jaxpar.constrain(x_BTD, RESIDUAL if stream else ("batch", "seq", "act_embed"))


class UserLM(nnx.Module):
    """A one-block LM a user might write: embedding, a normed MLP added to the residual
    stream, an output projection. ``stream``: the residual stream is constrained to
    :data:`RESIDUAL` (else to ``seq``: :func:`_constrained`); ``precision``: the MLP's
    (``default`` or ``fp8``); ``remat``: a ``model.remat`` policy name the MLP runs under
    (``jax.checkpoint``)."""

    def __init__(self, rngs: nnx.Rngs, stream: bool = True, precision="default", remat="none"):
        self.table = _param(rngs, (V, D), (None, "embed"), 0.02)
        self.w_in = _param(rngs, (D, F), ("embed", "mlp"), D**-0.5)
        self.w_out = _param(rngs, (F, D), ("mlp", "embed"), F**-0.5)
        self.head = _param(rngs, (D, V), ("embed", "vocab"), D**-0.5)
        self.stream = stream
        self.precision = precision
        self.remat = remat

    def __call__(self, tokens_BT):
        x_BTD = _constrained(jnp.take(self.table[...], tokens_BT, axis=0), self.stream)
        h_BTD = x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD**2, -1, keepdims=True) + 1e-6)
        block = functools.partial(mlp, precision=self.precision)
        if self.remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat])
        x_BTD = _constrained(x_BTD + block(h_BTD, self.w_in[...], self.w_out[...]), self.stream)
        return jnp.einsum("btd,dv->btv", x_BTD, self.head[...])


def _loss(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), {}


def _tokens(step, n):
    return {"tokens": np.random.default_rng(step).integers(0, V, (n, T + 1)).astype(np.int32)}


TASK = jaxpar.Task(
    UserLM, _loss, {"tokens": ("batch", None)}, tokens_per_example=T, data=_tokens, name="user_lm"
)


def _task(**model) -> jaxpar.Task:
    """:data:`TASK` with the model built with ``model``'s arguments."""
    return dataclasses.replace(TASK, model_fn=lambda rngs: UserLM(rngs, **model))


def _build(task: jaxpar.Task, overrides: list[str], devices: int):
    config = jaxpar.load_config([], [*BASE, f"run.devices={devices}", *overrides])
    return jaxpar.build(config, task)


def _train(task: jaxpar.Task, overrides: list[str], devices: int, steps: int = 2):
    """The losses of ``steps`` AdamW steps, the gradients at the initial parameters and
    the run."""
    run = _build(task, overrides, devices)
    state = run.trainer.init()
    first = run.trainer.shard_batch(_tokens(0, B))
    grads = jax.tree.map(np.asarray, run.trainer.grads(state.params, first)[2])
    losses = []
    for step in range(steps):
        state, metrics = run.trainer.step(state, run.trainer.shard_batch(_tokens(step, B)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), grads, run


@functools.cache
def _one_device(**model):
    return _train(_task(**model), ["mesh.data=1"], 1)


def _assert_grads_close(grads, ref):
    """Every gradient element agrees with one device's to 1e-5 of its tensor's scale (as
    tests/test_sequence_parallel.py compares the built-in models')."""
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(
            g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=jax.tree_util.keystr(path)
        )


# ---- sequence parallelism --------------------------------------------------------------------
def test_sequence_parallelism_on_a_model_that_never_names_act_seq_is_one_line():
    """The model constrains its residual stream, but as ``seq``, not ``act_seq``: under
    ``tensor.sequence=true`` tracing its step refuses it, naming the loss and the fix."""
    run = _build(_task(stream=False), [*LAYOUT, SP], 4)
    state = jax.eval_shape(run.trainer.init)
    batch = run.trainer.shard_batch(_tokens(0, B))
    with pytest.raises(jaxpar.errors.TaskError) as err:
        jax.eval_shape(run.trainer.step, state, batch)
    message = str(err.value)
    assert "\n" not in message
    assert re.match(
        r"loss_fn \(test_user_gpu_layouts\.py:_loss\) ran with sequence parallelism "
        r"\(tensor\.sequence=true, mesh\.tensor=2\), but its model never constrained an "
        r"activation with the logical axis act_seq.*"
        r'jaxpar\.constrain\(x, \("batch", "act_seq", "act_embed"\)\).*'
        r"or set tensor\.sequence=false$",
        message,
    ), message


# the same check's pass and sequence parallelism's numbers for a user's model in every
# suite: test_a_model_whose_stream_is_named_in_a_cached_trace_is_not_refused (this file's
# model, data=2, tensor=2, its losses as one device's); the stream gathered before the
# tensor-parallel MLP and first gradients element by element: the built-in models' in
# tests/test_sequence_parallel.py
@pytest.mark.exhaustive
def test_a_users_model_naming_act_seq_is_sequence_parallel_as_one_device():
    """The same model naming its residual stream ``act_seq``: under data=2, tensor=2 with
    sequence parallelism its first gradients equal one device's elementwise and the losses
    of two AdamW steps to rtol 1e-5; the stream is split over ``tensor`` (the compiled
    step gathers it before the tensor-parallel MLP)."""
    ref_losses, ref_grads, _ = _one_device()
    losses, grads, run = _train(TASK, [*LAYOUT, SP], 4)
    assert run.plan.rules["act_seq"] == ("context", "tensor")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_grads_close(grads, ref_grads)
    # each device's rows, the whole sequence: the stream gathered over tensor for the MLP
    text = run.trainer.compile_step(_tokens(0, B)).as_text()
    assert re.search(rf"= f32\[{B // 2},{T},{D}\]\{{[\d,]*\}} all-gather\(", text)


class Blocks(nnx.Module):
    """Two MLP blocks' weights, stacked on a leading ``layers`` dim (pipeline stages)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w_in = _param(rngs, (2, D, F), ("layers", "embed", "mlp"), D**-0.5)
        self.w_out = _param(rngs, (2, F, D), ("layers", "mlp", "embed"), F**-0.5)


class StackedLM(nnx.Module):
    """:class:`UserLM` with two blocks stacked for the pipeline (``Task.stages``)."""

    def __init__(self, rngs: nnx.Rngs, stream: bool = True):
        self.table = _param(rngs, (V, D), (None, "embed"), 0.02)
        self.blocks = Blocks(rngs)
        self.head = _param(rngs, (D, V), ("embed", "vocab"), D**-0.5)
        self.stream = stream


def _embed(model, batch):
    return _constrained(jnp.take(model.table[...], batch["tokens"][:, :-1], axis=0), model.stream)


def _stage(model, x_BTD, batch, first_layer):
    for i in range(model.blocks.w_in.shape[0]):
        h_BTD = x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD**2, -1, keepdims=True) + 1e-6)
        u_BTD = mlp(h_BTD, model.blocks.w_in[i], model.blocks.w_out[i], "default")
        x_BTD = _constrained(x_BTD + u_BTD, model.stream)
    return x_BTD


def _head(model, x_BTD, batch):
    logits = jnp.einsum("btd,dv->btv", x_BTD, model.head[...])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]
    ).mean(), {}


def _stacked_loss(model, batch):
    return _head(model, _stage(model, _embed(model, batch), batch, 0), batch)


def _trace_pipelined_step(stream: bool) -> None:
    """Traces the step of :class:`StackedLM` in two spmd pipeline stages × data=2 ×
    tensor=2 with sequence parallelism (nothing compiled)."""
    task = dataclasses.replace(
        TASK,
        model_fn=lambda rngs: StackedLM(rngs, stream),
        loss_fn=_stacked_loss,
        stages=jaxpar.StageSplit("blocks", _embed, _stage, _head),
    )
    layout = ["mesh.stage=2", "pipeline.executor=spmd", "pipeline.microbatches=2"]
    run = _build(task, [*LAYOUT, *layout, SP], 8)
    state = jax.eval_shape(run.trainer.init)
    jax.eval_shape(run.trainer.step, state, run.trainer.shard_batch(_tokens(0, B)))


def test_the_spmd_pipeline_refuses_stages_that_never_name_act_seq():
    """Under the spmd pipeline executor, stages whose stream is ``seq`` are refused naming
    the stage function; named ``act_seq``, the step traces."""
    with pytest.raises(jaxpar.errors.TaskError, match=r"^the stages \(test_user_gpu.*:_stage\)"):
        _trace_pipelined_step(stream=False)
    _trace_pipelined_step(stream=True)


def _scanned_layer(x_BTD, w):
    """A layer a user scans at module level: JAX serves a later trace of it from its
    trace cache, running none of this Python."""
    h_BTD = x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD**2, -1, keepdims=True) + 1e-6)
    return _constrained(x_BTD + mlp(h_BTD, w["w_in"], w["w_out"], "default"), True), None


class ScannedLM(UserLM):
    """:class:`UserLM` with its block run by ``lax.scan`` over a module-level function,
    the only place that names ``act_seq``."""

    def __call__(self, tokens_BT):
        x_BTD = _constrained(jnp.take(self.table[...], tokens_BT, axis=0), False)
        stacked = {"w_in": self.w_in[...][None], "w_out": self.w_out[...][None]}
        x_BTD, _ = jax.lax.scan(_scanned_layer, x_BTD, stacked)
        return jnp.einsum("btd,dv->btv", x_BTD, self.head[...])


def test_a_model_whose_stream_is_named_in_a_cached_trace_is_not_refused():
    """With ``train.grad_accum=2`` the step traces the loss twice (the microbatch's shapes,
    then the loop); the second trace of a module-level scan body runs no Python, so it
    names no ``act_seq`` (measured: ``lax.scan`` and ``jax.checkpoint`` cache module-level
    functions). The check remembers what an earlier trace of the same loss did: the model
    trains, as one device does."""
    task = dataclasses.replace(TASK, model_fn=ScannedLM)
    accum = ["train.grad_accum=2"]
    ref, _, _ = _train(task, ["mesh.data=1", *accum], 1)
    losses, _, run = _train(task, [*LAYOUT, SP, *accum], 4)
    assert run.plan.tensor.sequence
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


# ---- FP8 -------------------------------------------------------------------------------------
def _dot_counts(run, grad: bool) -> dict[tuple[str, str], int]:
    """The operand element types of the lowered loss's (or its gradient's) dots, counted."""
    state = jax.eval_shape(run.trainer.init)
    loss = lambda p, b: run.trainer.loss(p, b)[0]  # noqa: E731
    fn = jax.grad(loss) if grad else loss
    text = jax.jit(fn).lower(state.params, run.trainer.shard_batch(_tokens(0, B))).as_text()
    counts: dict[tuple[str, str], int] = {}
    for pair in _dot_dtypes(text):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def test_a_users_fp8_einsum_multiplies_e4m3_and_trains_as_one_device():
    """``fp8.einsum(..., precision="fp8")`` in a user's MLP: the lowered forward takes its
    two projections from E4M3 operands (the output projection stays float32), the backward
    has an E5M2 gradient dot for each input and weight gradient; under data=2, tensor=2 the
    losses of two AdamW steps equal one device's to rtol 1e-5 (tests/test_fp8.py's
    tolerance)."""
    task = _task(precision="fp8")
    ref_losses, _, ref_run = _train(task, ["mesh.data=1"], 1)
    forward = _dot_counts(ref_run, grad=False)
    assert forward.pop((E4M3, E4M3)) == 2 and set(forward) == {("f32", "f32")}, forward
    backward = _dot_counts(ref_run, grad=True)
    assert backward.pop((E4M3, E4M3)) == 2 and backward.pop((E5M2, E4M3)) == 4, backward
    assert set(backward) == {("f32", "f32")}, backward
    losses, _, _ = _train(task, LAYOUT, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


class DelayedLM(UserLM):
    """:class:`UserLM` with FP8 delayed scaling: a history per projection, each read once
    per forward pass (``fp8.einsum(..., history=)``), as model state."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs, precision="fp8")
        self.h_in = fp8.Fp8History(fp8.empty_history((), 4), out_sharding=(None, None))
        self.h_out = fp8.Fp8History(fp8.empty_history((), 4), out_sharding=(None, None))

    def __call__(self, tokens_BT):
        x_BTD = _constrained(jnp.take(self.table[...], tokens_BT, axis=0), True)
        h_BTD = x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD**2, -1, keepdims=True) + 1e-6)
        kw = dict(precision="fp8")
        u_BTF = fp8.einsum("btd,df->btf", h_BTD, self.w_in[...], history=self.h_in[...], **kw)
        u_BTF = jaxpar.constrain(jax.nn.gelu(u_BTF), ("batch", "seq", "mlp"))
        y_BTD = fp8.einsum("btf,fd->btd", u_BTF, self.w_out[...], history=self.h_out[...], **kw)
        x_BTD = _constrained(x_BTD + y_BTD, True)
        return jnp.einsum("btd,dv->btv", x_BTD, self.head[...])


# an Fp8History is model state whose gradient is its next value for every model alike
# (jaxpar.state.FromGradient): in every suite in
# tests/test_fp8.py::test_every_projection_keeps_a_history_that_advances[llama] and
# tests/test_fp8.py::test_delayed_scaling_layouts_match_one_device[data=2,fsdp=2,tensor=2]
@pytest.mark.exhaustive
def test_a_users_delayed_scaling_histories_advance_as_one_devices():
    """A user's model holding its own ``fp8.Fp8History`` variables: the step keeps each
    history's gradient as its next value (three steps push three amaxes for x, w and g,
    after scale 1 at the first); under data=2, tensor=2 the losses and the histories equal
    one device's to rtol 1e-5."""
    task = dataclasses.replace(TASK, model_fn=DelayedLM)
    states = []
    for overrides, devices in ((["mesh.data=1"], 1), (LAYOUT, 4)):
        run = _build(task, overrides, devices)
        state, losses = run.trainer.init(), []
        for step in range(3):
            state, metrics = run.trainer.step(state, run.trainer.shard_batch(_tokens(step, B)))
            losses.append(float(metrics["loss"]))
        states.append((np.array(losses), jax.tree.map(np.asarray, state.model_state)))
    (ref_losses, ref), (losses, ours) = states
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert set(ref) == {"h_in", "h_out"}
    for name in ref:
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-5)
        assert (ref[name][:, 1:4] > 0).all() and (ref[name][:, 4] == 0).all(), name


# ---- the named remat policies ----------------------------------------------------------------
def _puts(jaxpr, memory: str) -> list[str]:
    """Shapes of the ``device_put``s into ``memory`` (``<host>`` or ``""``: the device) in a
    jaxpr, nested ones included (as tests/test_offload.py reads them)."""
    return re.findall(rf"\w+:f32{memory}(\[[\d,]*\]) = device_put", str(jaxpr))


# REMAT_POLICIES["offload"] is the policy the built-in models run (applied here by the
# user's own jax.checkpoint: no jaxpar code of its own): the named residuals moved to the
# host in every suite in
# tests/test_offload.py::test_remat_offload_moves_the_named_residuals_to_the_host, offload
# against one device in tests/test_offload.py::test_offload_through_a_pipeline
@pytest.mark.exhaustive
def test_a_users_checkpoint_names_are_offloaded_and_train_as_one_device():
    """The MLP under ``REMAT_POLICIES["offload"]``: the step's traced program moves the one
    tagged activation its backward reads, ``MLP_IN`` [B, T, F], to host memory and back
    (``MLP_OUT`` is no residual: the stream's sum is); under data=2, tensor=2 its first
    gradients and two steps' losses equal one device's without remat."""
    ref_losses, ref_grads, _ = _one_device()
    losses, grads, run = _train(_task(remat="offload"), LAYOUT, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_grads_close(grads, ref_grads)
    state = jax.eval_shape(run.trainer.init)
    jaxpr = jax.make_jaxpr(run.trainer._step)(state, run.trainer.shard_batch(_tokens(0, B)))
    assert (_puts(jaxpr, "<host>"), _puts(jaxpr, "")) == ([f"[{B},{T},{F}]"], [f"[{B},{T},{F}]"])
