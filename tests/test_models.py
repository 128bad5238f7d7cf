"""Model options: remat and rotary/tied variants keep the numbers; bfloat16 compute keeps
float32 master weights; the layer scan keeps the compiled program size flat in depth;
attention through ``jax.nn.dot_product_attention`` computes what the hand-written
softmax(Q·Kᵀ)·V did, and ``model.attention`` picks its implementation per backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.attention_memory import reference_attention
from jaxpar.models import GPT, GPTConfig, gpt, transformer
from tests.helpers import GPT_SMALL, assert_params_close, grid, run_steps

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

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)  # one program, not op by op
    return value, nnx.to_pure_dict(grads)


@functools.cache
def _plain_loss_and_grads():
    """:func:`_loss_and_grads` of ``CFG`` with jaxpar's attention, computed (and compiled)
    once for the tests that compare with it (the arrays are the cached ones: read them
    only)."""
    with nnx.use_eager_sharding(False):
        return _loss_and_grads(CFG)


@pytest.mark.parametrize(
    "remat",
    # every suite: full. save_dots is another policy of the same table
    # (transformer.REMAT_POLICIES) through the same jax.checkpoint of the GPT's layer body:
    # extended (save_dots against one device under a layout, every suite:
    # test_rotary_tied_remat_layout_matches_single_device)
    grid([pytest.param("full", id="full"), pytest.param("save_dots", id="save_dots")], {"full"}),
)
def test_remat_changes_memory_not_numbers(remat):
    ref_loss, ref_grads = _plain_loss_and_grads()
    loss, grads = _loss_and_grads(GPTConfig(**{**CFG.__dict__, "remat": remat}))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_remat_lowers_compiled_temporaries():
    """Same numbers (above), less activation memory: full < save_dots < none."""
    from jaxpar.config import load_config
    from jaxpar.run import build

    def temp_bytes(remat):  # one device compiles quicker than 8; the policies are the same
        overrides = [f"model.remat={remat}", "run.devices=1"]
        run = build(load_config(["configs/gpt_tiny.yaml"], overrides))
        batch = run.data.batch(0, run.config.train.batch_size)
        return run.trainer.compile_step(batch).memory_analysis().temp_size_in_bytes

    none, dots, full = temp_bytes("none"), temp_bytes("save_dots"), temp_bytes("full")
    assert full < dots < none, (full, dots, none)
    assert full < 0.5 * none


def test_rotary_needs_even_head_dim():
    with pytest.raises(ValueError, match="rotary positions need an even head dim"):
        GPT(
            GPTConfig(**{**CFG.__dict__, "positions": "rotary", "d_model": 40, "n_heads": 8}),
            rngs=nnx.Rngs(0),
        )


def test_initial_loss_is_uniform_over_vocab():
    """Small init gives near-uniform logits: the first loss is ≈ ln(vocab)."""
    loss, _ = _plain_loss_and_grads()
    assert abs(float(loss) - np.log(64)) < 0.05


def test_bfloat16_compute_keeps_float32_params_and_close_loss():
    ref_loss, _ = _plain_loss_and_grads()
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
    variant = [
        *GPT_SMALL,
        "model.positions=rotary",
        "model.tie_embeddings=true",
        "model.remat=save_dots",
        "optim.name=sgd",
        "optim.lr=0.05",
    ]
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


# ---- attention through jax.nn.dot_product_attention ------------------------------------------
# jaxpar's attention before jax.nn.dot_product_attention: the reference the new form must
# reproduce (kept in the benchmark that measures both)
hand_written_attention = reference_attention


def _attention_inputs(dtype):
    D, N = CFG.d_model, CFG.n_heads
    H = D // N
    keys = jax.random.split(jax.random.key(3), 5)
    h = jax.random.normal(keys[0], (4, 16, D))
    p = {
        name: 0.2 * jax.random.normal(k, shape)
        for name, k, shape in (
            ("wq", keys[1], (D, N, H)),
            ("wk", keys[2], (D, N, H)),
            ("wv", keys[3], (D, N, H)),
            ("wo", keys[4], (N, H, D)),
        )
    }
    return h.astype(dtype), {k: v.astype(dtype) for k, v in p.items()}


def _attention_value_and_grads(fn, h, p, use_rotary, jit=False):
    """The output and the gradients of a loss on it; ``jit``: compiled as one program each
    (op by op, each primitive compiles apart: seconds). XLA:CPU rounds every op's result
    to its dtype inside the program too: the bfloat16 figures equal op-by-op ones (checked
    to the last bit when this was changed)."""
    jit = jax.jit if jit else (lambda f: f)
    loss = lambda h, p: jnp.sum(jnp.square(fn(h, p, use_rotary).astype(jnp.float32)))
    out = jit(lambda h, p: fn(h, p, use_rotary))(h, p)
    grads = jit(jax.grad(loss, argnums=(0, 1)))(h, p)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), (out, grads))


@pytest.mark.parametrize("use_rotary", [False, True], ids=["learned", "rotary"])
def test_attention_matches_the_hand_written_form_float32(use_rotary):
    h, p = _attention_inputs(jnp.float32)
    new = _attention_value_and_grads(transformer.attention, h, p, use_rotary, jit=True)
    ref = _attention_value_and_grads(hand_written_attention, h, p, use_rotary, jit=True)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
        # summation-order noise: relative to each tensor's scale (gradients reach ~20 here)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


# the suite: learned positions; rotary in bfloat16 in the extended tier (rotary is checked in
# float32 above, bfloat16's rounding here with learned positions)
@pytest.mark.parametrize(
    "use_rotary",
    [False, pytest.param(True, marks=pytest.mark.exhaustive)],
    ids=["learned", "rotary"],
)
def test_attention_matches_the_hand_written_form_bfloat16(use_rotary):
    """bfloat16 inputs: both forms agree to bfloat16 rounding, and the new one is at least as
    close to the float32 result. (They cannot agree to float32 tolerance: the hand-written
    form rounds Q·Kᵀ to bfloat16 before its float32 softmax, jax's keeps the float32
    accumulation.)"""
    h, p = _attention_inputs(jnp.bfloat16)
    new = _attention_value_and_grads(transformer.attention, h, p, use_rotary, jit=True)
    ref = _attention_value_and_grads(hand_written_attention, h, p, use_rotary, jit=True)
    exact = _attention_value_and_grads(
        hand_written_attention,
        h.astype(jnp.float32),
        jax.tree.map(lambda x: x.astype(jnp.float32), p),
        use_rotary,
        jit=True,
    )
    rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
    for a, b, e in zip(jax.tree.leaves(new), jax.tree.leaves(ref), jax.tree.leaves(exact)):
        scale = np.abs(e).max()
        np.testing.assert_allclose(a, b, rtol=0, atol=2**-6 * scale)  # 2 bf16 ulps of max
        assert rms(a - e) <= 1.1 * rms(b - e), (rms(a - e), rms(b - e))  # no less accurate


# the suite: the plain GPT. In the extended tier: rotary (the attention's rotary path:
# test_attention_matches_the_hand_written_form_float32[rotary]), tied embeddings (no
# attention code of their own) and the attention under remat (save_dots: the same attention
# code inside the layer's jax.checkpoint, which keeps the numbers in every suite:
# test_remat_changes_memory_not_numbers[full], and save_dots itself under a layout in
# test_rotary_tied_remat_layout_matches_single_device)
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({}, id="learned"),
        pytest.param({"positions": "rotary"}, id="rotary", marks=pytest.mark.exhaustive),
        pytest.param({"tie_embeddings": True}, id="tied", marks=pytest.mark.exhaustive),
        pytest.param({"remat": "save_dots"}, id="save_dots", marks=pytest.mark.exhaustive),
    ],
)
def test_gpt_loss_and_grads_unchanged_from_the_hand_written_attention(variant, monkeypatch):
    cfg = GPTConfig(**{**CFG.__dict__, **variant})
    loss, grads = _loss_and_grads(cfg)
    monkeypatch.setattr(transformer, "attention", hand_written_attention)
    ref_loss, ref_grads = _loss_and_grads(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_attention_implementation_per_backend():
    """``auto`` is cuDNN only on a GPU with bfloat16 compute and a head dim cuDNN takes."""

    def pick(backend, **kw):
        return gpt.attention_implementation(GPTConfig(**{**CFG.__dict__, **kw}), backend)

    bf16 = {"dtype": "bfloat16", "d_model": 256, "n_heads": 4}  # head dim 64
    assert pick("gpu", **bf16) == "cudnn"
    assert pick("cpu", **bf16) == pick("tpu", **bf16) == pick("rocm", **bf16) == "xla"
    assert pick("gpu", **{**bf16, "dtype": "float32"}) == "xla"
    assert pick("gpu", **{**bf16, "d_model": 48, "n_heads": 4}) == "xla"  # head dim 12
    assert pick("gpu", **{**bf16, "d_model": 1024, "n_heads": 4}) == "xla"  # head dim 256
    assert pick("cpu", attention="xla") == "xla"
    assert pick("gpu", **bf16, attention="cudnn") == "cudnn"
    assert GPT(CFG, rngs=nnx.Rngs(0)).attention_impl == "xla"  # auto, on this CPU


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"attention": "cudnn"}, "model.attention=cudnn needs an NVIDIA GPU.*model.attention=xla"),
        ({"attention": "flash"}, "model.attention' must be one of auto, xla, cudnn"),
    ],
)
def test_attention_setting_errors_name_the_key_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        GPT(GPTConfig(**{**CFG.__dict__, **kw}), rngs=nnx.Rngs(0))
    cfg = GPTConfig(**{**CFG.__dict__, "attention": "cudnn"})
    with pytest.raises(ValueError, match="needs bfloat16 compute, got model.dtype=float32"):
        gpt.attention_implementation(cfg, "gpu")


def test_attention_key_reaches_the_model():
    from jaxpar.config import load_config
    from jaxpar.run import build

    run = build(load_config(["configs/gpt_tiny.yaml"], ["model.attention=xla"]))
    assert nnx.eval_shape(lambda: run.plan.task.model_fn(nnx.Rngs(0))).attention_impl == "xla"
    with pytest.raises(ValueError, match="model.attention=cudnn needs an NVIDIA GPU"):
        build(load_config(["configs/gpt_tiny.yaml"], ["model.attention=cudnn"]))
    with pytest.raises(ValueError, match="'model.attention' must be one of auto, xla, cudnn"):
        load_config([], ["model.attention=flash"])
