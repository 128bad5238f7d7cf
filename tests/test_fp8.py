"""FP8 matmuls (``model.precision=fp8``, :mod:`jaxpar.models.fp8`): the dtypes the program
multiplies in, agreement with Flax's quantize-dequantize reference, the loss within a bound
derived from E4M3's rounding, layouts equal to one device, one-line config errors."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.models import fp8
from jaxpar.run import build
from tests.helpers import GPT_SMALL, assert_params_close
from tests.test_gemma import GEMMA
from tests.test_llama import LLAMA

FP8 = ["model.precision=fp8"]
ADAMW = ["optim.name=adamw", "optim.lr=3e-3", "optim.weight_decay=0.1"]

# E4M3 keeps 3 mantissa bits: neighbours are 2^-3 of the leading bit apart, so rounding to
# nearest moves a normal number by at most half of that, 2^-4 of its magnitude (the unit
# roundoff u). Below its smallest normal 2^-6 the spacing is the subnormal 2^-9, so a
# number moves by at most 2^-10 there (in units of the tensor's scale amax / 448).
U_E4M3 = 2.0**-4
SUBNORMAL_E4M3 = 2.0**-10
MAX_E4M3 = 448.0


def _run(overrides: list[str], devices: int = 1):
    cfg = load_config([], [*overrides, f"run.devices={devices}", "train.steps=20"])
    return cfg, build(cfg)


def _batch(cfg, run, step: int = 0):
    return run.trainer.shard_batch(run.data.batch(step, cfg.train.batch_size))


# ---- (a) what the program multiplies -----------------------------------------------------
def _dot_dtypes(text: str) -> list[tuple[str, str]]:
    """The element types of each ``stablehlo.dot_general``'s two operands."""
    pairs = re.findall(r"stablehlo\.dot_general[^\n]*: \(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
    return [(a.split("x")[-1], b.split("x")[-1]) for a, b in pairs]


def _lowered_dots(overrides: list[str], grad: bool) -> dict[tuple[str, str], int]:
    cfg, run = _run([*overrides, "mesh.data=1"])
    state = run.trainer.init()
    loss = lambda p, b: run.trainer.loss(p, b)[0]  # noqa: E731
    fn = jax.grad(loss) if grad else loss
    text = jax.jit(fn).lower(state.params, _batch(cfg, run)).as_text()
    counts: dict[tuple[str, str], int] = {}
    for pair in _dot_dtypes(text):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


E4M3, E5M2 = "f8E4M3FN", "f8E5M2"


def test_gpt_multiplies_e4m3_forward_and_e5m2_gradients():
    """The lowered StableHLO (``jax.jit(...).lower(...).as_text()``; XLA:CPU's compiled
    program converts FP8 operands to f32 before its dots, so the compiled text would not
    show them) of a GPT's loss and gradient: the blocks (one scan body) hold 4 dots of two
    E4M3 operands (q/k/v, attention output, MLP in, MLP out) and 8 of an E5M2 gradient and
    an E4M3 operand (dx and dw of each); every other dot (attention's QK^T and PV, the
    logits, and their gradients) is float32. The default precision has no FP8 dot."""
    counts = _lowered_dots([*GPT_SMALL, *FP8], grad=True)
    assert counts.pop((E4M3, E4M3)) == 4
    assert counts.pop((E5M2, E4M3)) == 8
    assert set(counts) == {("f32", "f32")}, counts
    forward = _lowered_dots([*GPT_SMALL, *FP8], grad=False)
    assert forward.pop((E4M3, E4M3)) == 4 and set(forward) == {("f32", "f32")}, forward
    assert set(_lowered_dots(GPT_SMALL, grad=True)) == {("f32", "f32")}


@pytest.mark.parametrize("family", [LLAMA, GEMMA], ids=["llama", "gemma"])
def test_llama_and_gemma_projections_are_fp8(family):
    """Llama and Gemma: each scan body's 7 projections (q, k, v, o, gate, up, down) take
    E4M3 operands, and each has two E5M2 × E4M3 gradient dots; the rest stays float32."""
    counts = _lowered_dots([*family, *FP8], grad=True)
    forward, backward = counts.pop((E4M3, E4M3)), counts.pop((E5M2, E4M3))
    assert forward > 0 and forward % 7 == 0 and backward == 2 * forward
    assert set(counts) == {("f32", "f32")}, counts


# ---- the FP8 dot against Flax's quantize-dequantize reference ----------------------------
def _qdq(t: jax.Array, dtype) -> jax.Array:
    """``t`` rounded to ``dtype`` at its per-tensor current scale, back in float32: Flax's
    ``qdq`` with the scale ``compute_scale`` gives this step's amax."""
    fmax = fp8_ops.get_fp8_max(dtype, jnp.float32)
    scale = fp8_ops.compute_scale(jnp.max(jnp.abs(t)), jnp.ones(()), fmax)
    return fp8_ops.qdq(t, dtype, scale, jnp.float32)


@pytest.mark.parametrize(
    "spec,x_shape,w_shape",
    [
        ("btd,dcnh->btcnh", (2, 5, 8), (8, 3, 2, 4)),
        ("btnh,nhd->btd", (2, 5, 2, 4), (2, 4, 8)),
        ("bnd,bdf->bnf", (3, 4, 8), (3, 8, 6)),
        ("btd,df->bft", (2, 5, 8), (8, 6)),
    ],
)
def test_fp8_einsum_matches_flax_qdq_reference(spec, x_shape, w_shape):
    """y = qdq(x)·qdq(w) with E4M3 operands, dx = qdq_E5M2(g)·qdq(w)^T and dw =
    qdq(x)^T·qdq_E5M2(g), computed in float32 from Flax's ``qdq``: the FP8 dot agrees to
    float32 rounding (FP8 products are exact in float32; only the order of the scale
    multiplications differs), 1e-6 of each tensor's largest entry."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    g = jax.random.normal(kg, jnp.einsum(spec, x, w).shape)
    e4 = jnp.float8_e4m3fn
    y, vjp = jax.vjp(lambda x, w: fp8.einsum(spec, x, w, precision="fp8"), x, w)
    y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), _qdq(x, e4), _qdq(w, e4))
    g_ref = _qdq(g, jnp.float8_e5m2)
    for got, want in zip((y, *vjp(g)), (y_ref, *vjp_ref(g_ref))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


# ---- (b) the loss within E4M3's rounding ---------------------------------------------------
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tapped_einsum(spec, x, w, probe):
    """``jnp.einsum(spec, x, w)``, whose backward pass adds to the gradient of ``probe`` the
    two sums the bounds below need of this matmul's operands' rounding."""
    return jnp.einsum(spec, x, w)


def _tapped_fwd(spec, x, w, probe):
    return jnp.einsum(spec, x, w), (x, w)


def _tapped_bwd(spec, res, g):
    """dL/dx̃ = g·w^T and dL/dw̃ = x^T·g (the loss's sensitivity to the operands as this
    matmul reads them), times the largest rounding error α of each element: their sum of
    absolute values and sum of squares."""
    x, w = res
    dx, dw = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)[1](g)
    cx, cw = dx * _rounding(x), dw * _rounding(w)
    worst = jnp.sum(jnp.abs(cx)) + jnp.sum(jnp.abs(cw))
    squares = jnp.sum(cx**2) + jnp.sum(cw**2)
    return dx, dw, jnp.stack([worst, squares])


_tapped_einsum.defvjp(_tapped_fwd, _tapped_bwd)
_PROBE: list = []


def _rounding(t: jax.Array) -> jax.Array:
    """The most rounding ``t`` to E4M3 at its scale s = amax/448 moves each element:
    u|t| (normal range) plus 2^-10 s (half the subnormal spacing)."""
    return U_E4M3 * jnp.abs(t) + SUBNORMAL_E4M3 * jnp.max(jnp.abs(t)) / MAX_E4M3


def _probed_einsum(spec, x, w, *, precision="default"):
    return _tapped_einsum(spec, x, w, _PROBE[-1])


#: Hoeffding's bound holds but with this probability per step
FAILURE = 1e-9


def test_fp8_loss_within_bounds_of_e4m3_rounding(monkeypatch):
    """At each of 20 AdamW steps of a small GPT trained in FP8, its loss differs from the
    default precision's loss at the same parameters and batch by no more than E4M3's
    rounding allows, to first order in u:

    each FP8 matmul reads its operands rounded: element i moves by δ_i, |δ_i| ≤ α_i =
    u|x_i| + 2^-10 s (u = 2^-4: E4M3's 3 mantissa bits put neighbours 2^-3 of the
    leading bit apart, and rounding to nearest moves at most half that; 2^-10 s: half the
    subnormal spacing 2^-9 at the tensor's scale s = amax/448). To first order the loss
    moves by ΔL = Σ_i c_i δ_i, c_i = ∂L/∂x̃_i over every operand element of every FP8
    matmul (computed at the default precision by tapping each matmul). So

    * worst case (every error aligned): |ΔL| ≤ Σ_i |c_i| α_i;
    * rounding errors as independent zero-mean variables (the probabilistic model of
      rounding error analysis, Higham & Mary 2019), by Hoeffding's inequality
      |ΔL| ≤ sqrt(2 ln(2/p) Σ_i c_i² α_i²) but with probability p = 1e-9 per step.

    Measured: |ΔL| ≤ 1.6e-4, 3-8% of the Hoeffding bound (about 1e-3) and under 1% of
    the worst case (2-6e-2), i.e. about one standard deviation of uniform rounding errors.
    """
    cfg, run = _run([*GPT_SMALL, *ADAMW, *FP8, "mesh.data=1"])
    fp8_loss = jax.jit(lambda p, b: run.trainer.loss(p, b)[0])
    state = run.trainer.init()

    def tapped(probe, params, batch):
        _PROBE.append(probe)
        return run.trainer.loss(params, batch)[0]

    # only this program traces the tapped float32 einsum; the train step and fp8_loss,
    # traced later, run the FP8 one
    with monkeypatch.context() as patch:
        patch.setattr(fp8, "einsum", _probed_einsum)
        default_loss_and_sums = (
            jax.jit(jax.value_and_grad(tapped))
            .lower(jnp.zeros(2), state.params, _batch(cfg, run))
            .compile()
        )
    for step in range(20):
        batch = _batch(cfg, run, step)
        loss, (worst, squares) = default_loss_and_sums(jnp.zeros(2), state.params, batch)
        diff = abs(float(fp8_loss(state.params, batch)) - float(loss))
        likely = np.sqrt(2 * np.log(2 / FAILURE) * float(squares))
        where = f"step {step + 1}: |ΔL| {diff:.2e}, bounds {likely:.2e}, {worst:.2e}"
        assert 0 < diff <= likely and diff <= worst, where
        state, _ = run.trainer.step(state, batch)


# ---- (c) layouts equal one device ----------------------------------------------------------
LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


def _steps(overrides: list[str], devices: int, steps: int = 3):
    """Losses of ``steps`` AdamW steps and the parameters after the first."""
    cfg, run = _run(overrides, devices)
    state = run.trainer.init()
    losses, after_first = [], None
    for step in range(steps):
        state, metrics = run.trainer.step(state, _batch(cfg, run, step))
        losses.append(float(metrics["loss"]))
        if step == 0:
            after_first = jax.tree.map(np.asarray, state.params)
    return np.array(losses), after_first, run


@pytest.fixture(scope="module")
def one_device():
    return _steps([*GPT_SMALL, *ADAMW, *FP8, "mesh.data=1"], devices=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_layouts_match_one_device(layout, one_device):
    """FP8 under a layout equals FP8 on one device: a per-tensor scale is the max over
    the whole tensor (XLA all-reduces it), so sharding changes only the order of float32
    sums. The losses of 3 AdamW steps agree to rtol 1e-5; the parameters after the first
    step per tensor to 1e-4, as in tests/test_equivalence.py's AdamW test (Adam divides each
    gradient element by its own magnitude). Later steps' parameters are not compared at
    that tolerance: a 1e-6 parameter difference can move a weight across an E4M3 rounding
    boundary, a change of 2^-3 of that element, not summation-order noise (measured after
    3 steps under data=2,fsdp=2,tensor=2: 1.3e-4 on wv; losses still 5e-7)."""
    ref_losses, ref_params, _ = one_device
    losses, params, run = _steps([*GPT_SMALL, *ADAMW, *FP8, *LAYOUTS[layout]], devices=8)
    assert run.plan.mesh.devices.size == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params, ref_params, elementwise=False, rtol=1e-4)


# ---- (e) config errors ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,message",
    [
        ("model.precision=fp16", "model.precision' must be one of default, fp8"),
        ("model.fp8_scaling=delayed", "model.fp8_scaling=delayed .* use model.fp8_scaling=current"),
        ("model.fp8_scaling=amax", "model.fp8_scaling' must be one of current,"),
    ],
)
def test_bad_fp8_settings_are_one_line_config_errors(override, message):
    """A bad value names the key and the fix in one line; delayed scaling (an amax
    history kept as model state) is not built and says what to use instead."""
    with pytest.raises(ConfigError, match=message) as err:
        load_config([], [*FP8, override])
    assert "\n" not in str(err.value)
