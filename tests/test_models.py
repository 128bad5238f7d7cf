"""Model options: remat and rotary/tied variants keep the numbers; bfloat16 compute keeps
float32 master weights; the layer scan keeps the compiled program size flat in depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import GPT, GPTConfig
from tests.helpers import GPT_SMALL, assert_params_close, run_steps

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16)
TOKENS = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)


@pytest.fixture(autouse=True)
def logical_names_only():
    """The GPT's parameters carry logical names, not mesh axes: built outside jaxpar (no
    mesh), Flax must not try to shard them at construction."""
    with nnx.use_eager_sharding(False):
        yield


def _loss_and_grads(cfg):
    model = GPT(cfg, rngs=nnx.Rngs(0))

    def loss(m):
        logits = m(TOKENS[:, :-1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    return value, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_changes_memory_not_numbers(remat):
    ref_loss, ref_grads = _loss_and_grads(CFG)
    loss, grads = _loss_and_grads(GPTConfig(**{**CFG.__dict__, "remat": remat}))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_remat_lowers_compiled_temporaries():
    """Same numbers (above), less activation memory: full < save_dots < none."""
    from jaxpar.config import load_config
    from jaxpar.run import build

    def temp_bytes(remat):
        run = build(load_config(["configs/gpt_tiny.yaml"], [f"model.remat={remat}"]))
        batch = run.data.batch(0, run.config.train.batch_size)
        return run.trainer.compile_step(batch).memory_analysis().temp_size_in_bytes

    none, dots, full = temp_bytes("none"), temp_bytes("save_dots"), temp_bytes("full")
    assert full < dots < none, (full, dots, none)
    assert full < 0.5 * none


def test_rotary_needs_even_head_dim():
    with pytest.raises(ValueError, match="rotary positions need an even head dim"):
        GPT(GPTConfig(**{**CFG.__dict__, "positions": "rotary", "d_model": 40, "n_heads": 8}),
            rngs=nnx.Rngs(0))


def test_initial_loss_is_uniform_over_vocab():
    """Small init gives near-uniform logits: the first loss is ≈ ln(vocab)."""
    loss, _ = _loss_and_grads(CFG)
    assert abs(float(loss) - np.log(64)) < 0.05


def test_bfloat16_compute_keeps_float32_params_and_close_loss():
    ref_loss, _ = _loss_and_grads(CFG)
    model = GPT(GPTConfig(**{**CFG.__dict__, "dtype": "bfloat16"}), rngs=nnx.Rngs(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logits = model(TOKENS[:, :-1])
    assert logits.dtype == jnp.float32
    loss = -jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1).mean()
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)


def test_rotary_is_causal_and_position_dependent():
    cfg = GPTConfig(**{**CFG.__dict__, "positions": "rotary"})
    model = GPT(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(model, "pos")
    a = model(TOKENS)
    changed = TOKENS.at[:, 10].set((TOKENS[:, 10] + 1) % 64)
    b = model(changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-6)  # causal
    assert np.abs(np.asarray(a[:, 10:] - b[:, 10:])).max() > 1e-3


def test_sequence_longer_than_max_is_an_error():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 20 exceeds model.max_seq_len=16"):
        model(jnp.zeros((1, 20), jnp.int32))


def test_heads_must_divide_d_model():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by model.n_heads=4"):
        GPT(GPTConfig(**{**CFG.__dict__, "d_model": 30}), rngs=nnx.Rngs(0))


def test_rotary_tied_remat_layout_matches_single_device():
    variant = [*GPT_SMALL, "model.positions=rotary", "model.tie_embeddings=true",
               "model.remat=save_dots", "optim.name=sgd", "optim.lr=0.05"]
    ref_losses, ref_params, _ = run_steps([*variant, "mesh.data=1"], devices=1)
    losses, params, run = run_steps([*variant, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    assert "head" not in params
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params, ref_params)


def test_layer_scan_keeps_program_size_flat_in_depth():
    def hlo_size(layers):
        cfg = GPTConfig(**{**CFG.__dict__, "n_layers": layers})
        graphdef, state = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
        fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).sum())
        return len(fn.lower(state, TOKENS).as_text())

    assert hlo_size(16) < 1.1 * hlo_size(2)
