"""The GPT's dropout (``model.dropout``: embeddings, attention and MLP outputs;
``model.attention_dropout``: the attention probabilities): on in training, off in
evaluation, each example's draws keyed by its id, so every layout and pipeline schedule
trains to the numbers of one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.errors import ConfigError, LayoutError
from jaxpar.models import dropout
from jaxpar.models.transformer import dropped_attention
from jaxpar.run import build
from tests.helpers import GPT_SMALL, assert_params_close, grid
from tests.test_families import train

DROPS = [*GPT_SMALL, "model.dropout=0.1", "model.attention_dropout=0.1", "optim.name=sgd"]
_ONE_F_ONE_B = ["mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "pipeline.schedule=1f1b"]
_INTERLEAVED = [
    "mesh.data=4",
    "mesh.stage=2",
    "model.n_layers=4",
    "pipeline.schedule=interleaved",
    "pipeline.virtual_stages=2",
    "pipeline.executor=mpmd",
]
#: 2 microbatches in each of 2 accumulation steps, where the other pipelines run 4 at once
_ACCUMULATED = ["pipeline.microbatches=2", "train.grad_accum=2"]
LAYOUTS = {
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "tensor=2,sequence": ["mesh.data=4", "mesh.tensor=2", "tensor.sequence=true"],
    "1f1b": _ONE_F_ONE_B,
    "1f1b,accumulated": [*_ONE_F_ONE_B, *_ACCUMULATED],
    "interleaved,mpmd": _INTERLEAVED,
    "interleaved,mpmd,accumulated": [*_INTERLEAVED, *_ACCUMULATED],
}
_one = {}


def _micro(layout):
    given = str(LAYOUTS[layout])
    if "grad_accum" in given:
        return []
    return ["pipeline.microbatches=4"] if "mesh.stage" in given else ["train.grad_accum=4"]


@pytest.mark.parametrize(
    # heavy (20 s): dropout keyed by example equals one device under data=8 with
    # accumulation and under context in every suite (below)
    "layout",
    grid([pytest.param(x, id=x) for x in LAYOUTS], set(), heavy={"1f1b,accumulated"}),
)
def test_dropout_layouts_and_pipelines_match_one_device(layout):
    """Dropout on: each layout and pipeline schedule (4 microbatches: a pipeline's 4, or 2
    in each of 2 accumulation steps) equals one device running the same 4 microbatches —
    losses, parameters and the RNG count."""
    extra = [x for x in LAYOUTS[layout] if x.startswith("model.")]
    key = tuple(extra)
    if key not in _one:
        _one[key] = train([*DROPS, *extra, "train.grad_accum=4", "mesh.data=1"], devices=1)
    ref = _one[key]
    losses, params, state, _ = train([*DROPS, *LAYOUTS[layout], *_micro(layout)])
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    assert_params_close(params, ref[1])
    assert int(state["noise"]["dropout"]["count"]) == 12 == int(ref[2]["noise"]["dropout"]["count"])


@pytest.mark.parametrize("by_example", [True, False])
def test_accumulation_reduces_once_a_step_where_the_draws_are_by_example(by_example):
    """Dropout keyed by example: a data shard draws what one device would, so the
    accumulated gradients are reduced over ``data`` once a step, as without dropout; a
    model whose draws are not declared so (``Task.draws_by_example`` false: an
    ``nnx.Dropout`` draws over the batch's shape) keeps the step that reduces each
    microbatch. Both equal one device."""
    import dataclasses

    import jaxpar

    wide = [*DROPS, "train.batch_size=32", "train.grad_accum=4"]
    config = load_config([], [*wide, "mesh.data=8"])
    task = dataclasses.replace(jaxpar.task_for(config), draws_by_example=by_example)
    run = build(config, task)
    assert run.plan.accumulates_per_data_shard == by_example
    key = ("train.batch_size=32",)
    if key not in _one:
        _one[key] = train([*wide, "mesh.data=1"], devices=1)
    state, losses = run.trainer.init(), []
    for step in range(3):
        batch = run.trainer.shard_batch(run.data.batch(step, run.config.train.batch_size))
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, _one[key][0], rtol=1e-5)
    assert_params_close(jax.device_get(state.params), _one[key][1])
    assert int(state.model_state["noise"]["dropout"]["count"]) == 12


def test_hidden_dropout_under_context_parallelism_matches_one_device():
    """A context-parallel layout runs the tokens in its load-balanced order; each token
    keeps its position's draws."""
    hidden = [*GPT_SMALL, "model.dropout=0.2", "optim.name=sgd"]
    ref = train([*hidden, "mesh.data=1"], devices=1)
    losses, params, state, run = train([*hidden, "mesh.data=4", "mesh.context=2"])
    assert run.plan.mesh.shape["context"] == 2
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    assert_params_close(params, ref[1])


def test_dropout_is_on_in_training_and_off_in_evaluation():
    """Training draws anew each microbatch (the count advances); evaluation drops nothing:
    its loss equals that of the same parameters without dropout. (On one device: the
    layouts' draws are test_dropout_layouts_and_pipelines_match_one_device's.)"""
    one = ["mesh.data=1", "run.devices=1"]
    run = build(load_config([], [*DROPS, *one]))
    trainer, state = run.trainer, run.trainer.init()
    batch = trainer.shard_batch(run.data.batch(0, 16))
    apply = jax.jit(trainer.apply, static_argnames="train")
    a, _, after = apply(state.params, state.model_state, batch, train=True)
    b, _, _ = apply(state.params, after, batch, train=True)
    assert float(a) != float(b)
    assert int(after["noise"]["dropout"]["count"]) == 1
    hidden = build(load_config([], [*DROPS, *one, "model.attention_dropout=0"]))
    c, _, _ = jax.jit(hidden.trainer.apply, static_argnames="train")(
        state.params, state.model_state, batch, train=True
    )
    assert float(c) != float(a)  # the probabilities drop too
    plain = build(load_config([], [*GPT_SMALL, "optim.name=sgd", *one]))
    assert "noise" not in plain.trainer.init().model_state  # no dropout: the state of before
    same = plain.trainer.init()
    assert_params_close(same.params, state.params)  # the RNG is drawn after the parameters
    unbatched = {k: v for k, v in batch.items() if k != "index"}
    evaluated = trainer.evaluate(state, batch)["loss"]
    assert float(evaluated) == pytest.approx(float(plain.trainer.evaluate(same, unbatched)["loss"]))


def test_a_mask_keeps_each_element_at_the_rate_and_scales_the_kept():
    """Inverted dropout: kept elements are x / (1 − rate), the rest 0, about a ``rate``
    share dropped; an example's mask is its own whichever row holds it, and a reordered
    sequence keeps each position's draws."""
    rate, x = 0.25, jnp.ones((4, 64, 32))
    keys = dropout.fold(jax.random.split(jax.random.key(0), 4), 7)
    y = np.asarray(dropout.dropout(x, keys, rate))
    assert set(np.unique(y)) == {0.0, np.float32(1 / (1 - rate))}
    dropped = (y == 0).mean()
    assert abs(dropped - rate) < 4 * np.sqrt(rate * (1 - rate) / y.size)  # 4 sigma
    flipped = np.asarray(dropout.dropout(x, keys[::-1], rate))
    np.testing.assert_array_equal(flipped, y[::-1])
    order = np.random.default_rng(0).permutation(64)
    reordered = np.asarray(dropout.dropout(x, keys, rate, order))
    np.testing.assert_array_equal(reordered, y[:, order])


@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (True, True)])
def test_the_written_out_attention_equals_jax_at_rate_zero(causal, packed):
    """The attention that drops its probabilities is JAX's XLA attention with nothing
    dropped (causal or not, packed documents too)."""
    q, k, v = jax.random.normal(jax.random.key(1), (3, 2, 12, 4, 8))
    segments = jnp.asarray(np.repeat([[0, 1, 2]], 4, axis=1).repeat(2, axis=0)) if packed else None
    noise = dropout.LayerNoise(jax.random.split(jax.random.key(2), 2), 0, 0.0, 0.0)
    got = dropped_attention(q, k, v, causal, segments, noise)
    mask = None
    if packed:
        mask = segments[:, None, :, None] == segments[:, None, None, :]
        mask &= jnp.tril(jnp.ones((12, 12), bool))[None, None]
    want = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal and not packed, implementation="xla"
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_dropout_across_the_context_axis_is_refused():
    """The probabilities of a split sequence are not dropped: the plan refuses such a layout
    in one line (and the planner leaves it out); a step that splits the sequence anyway
    (the model's blocks called under a context layout) is refused naming the key."""
    from jaxpar.lab.sweep import default_layouts

    config = load_config([], [*DROPS, "mesh.data=4", "mesh.context=2"])
    with pytest.raises(LayoutError, match="does not run across a split sequence.*mesh.context=1"):
        build(config)
    layouts, note = default_layouts(load_config([], DROPS), 8)
    assert not [x for x in layouts if "context" in x] and "context" in note
    assert "data=8,train.grad_bucket_mb=0" in layouts  # per data shard: both reductions
    plain = build(load_config([], [*GPT_SMALL, "mesh.data=4", "mesh.context=2"]))
    layout = plain.plan.layout
    q = jnp.zeros((4, 16, 4, 8))
    noise = dropout.LayerNoise(jax.random.split(jax.random.key(0), 4), 0, 0.0, 0.1)
    with layout.activation_rules(), pytest.raises(ConfigError, match=r"=0, or .*\(mesh.context=1"):
        jax.jit(lambda q: dropped_attention(q, q, q, True, None, noise))(q)


def test_a_gpt2_export_writes_the_rates_it_trained_with():
    """Hugging Face's GPT-2 config carries the model's dropout: ``resid_pdrop`` and
    ``embd_pdrop`` its ``model.dropout``, ``attn_pdrop`` its ``model.attention_dropout``."""
    from jaxpar.hf.gpt2 import hf_config
    from jaxpar.models.gpt import GPTConfig

    written = hf_config(GPTConfig(dropout=0.1, attention_dropout=0.2, attn_bias=True))
    assert (written["resid_pdrop"], written["embd_pdrop"], written["attn_pdrop"]) == (0.1, 0.1, 0.2)
    plain = hf_config(GPTConfig(attn_bias=True))
    assert (plain["resid_pdrop"], plain["embd_pdrop"], plain["attn_pdrop"]) == (0.0, 0.0, 0.0)


def test_a_training_call_without_the_examples_keys_is_refused():
    """A GPT that drops out keys its draws by example: called in training mode without
    them it says so in one line (it would otherwise drop nothing); after ``eval()`` it
    runs."""
    from flax import nnx

    from jaxpar.models.gpt import GPT, GPTConfig

    with nnx.use_eager_sharding(False):
        model = GPT(GPTConfig(dropout=0.1, d_model=32, n_heads=4, n_layers=1), rngs=nnx.Rngs(0))
        tokens = jnp.zeros((2, 8), jnp.int32)
        with pytest.raises(ConfigError, match=r"keys_B=model\.example_keys\(batch\)"):
            model(tokens)
        model.eval()
        assert model(tokens).shape == (2, 8, GPTConfig().vocab_size)
