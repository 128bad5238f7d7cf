"""FP8 matmuls (``model.precision=fp8``, :mod:`jaxpar.models.fp8`): the dtypes the program
multiplies in, agreement with Flax's quantize-dequantize reference, the loss within a bound
derived from E4M3's rounding, layouts equal to one device, one-line config errors."""

import json
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.models import fp8
from jaxpar.run import build
from jaxpar.state import TrainState
from tests.helpers import GPT_SMALL, assert_params_close, grid
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
    """How many dots of each operand type pair the loss (or its gradient) lowers to. The
    parameters are the plan's shapes and dtypes (``ShapeDtypeStruct``): lowering reads
    only those, so no init program is compiled for a step that never runs."""
    cfg, run = _run([*overrides, "mesh.data=1"])
    params = run.plan.abstract_state.params
    loss = lambda p, b: run.trainer.loss(p, b)[0]  # noqa: E731
    fn = jax.grad(loss) if grad else loss
    text = jax.jit(fn).lower(params, _batch(cfg, run)).as_text()
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


@pytest.mark.parametrize(
    "family",
    [
        LLAMA,
        # extended: Gemma's layers call the Llama's attention projections and the same
        # `project` for their MLP (jaxpar/models/gemma_layers.py), checked in the Llama
        pytest.param(GEMMA, marks=pytest.mark.exhaustive),
    ],
    ids=["llama", "gemma"],
)
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
    # the operands drawn in one program, and each side below one program: op by op, every
    # primitive of the quantization and its transpose compiled apart
    draw = jax.jit(lambda k, shape: jax.random.normal(k, shape), static_argnums=1)
    x, w = draw(kx, x_shape), draw(kw, w_shape)
    g = draw(kg, jax.eval_shape(partial(jnp.einsum, spec), x, w).shape)
    e4 = jnp.float8_e4m3fn

    @jax.jit
    def ours(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp8.einsum(spec, x, w, precision="fp8"), x, w)
        return y, *vjp(g)

    @jax.jit
    def reference(x, w, g):
        y, vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), _qdq(x, e4), _qdq(w, e4))
        return y, *vjp(_qdq(g, jnp.float8_e5m2))

    for got, want in zip(ours(x, w, g), reference(x, w, g)):
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


def _probed_einsum(spec, x, w, *, precision="default", history=None):
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


# extended: the FP8 dots and their whole-tensor amax under this layout run in every suite
# in test_delayed_scaling_layouts_match_one_device[data=2,fsdp=2,tensor=2] (the same
# custom-VJP transposes and `_amax`, AdamW), and current scaling on 8 devices equals one
# device in test_a_step_that_sums_its_own_gradients_scales_by_the_whole_batch (data=8,
# heavy) and tests/test_user_gpu_layouts.py's user FP8 einsum (data=2 × tensor=2)
@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "layout",
    [pytest.param("data=8", marks=pytest.mark.exhaustive), "data=2,fsdp=2,tensor=2"],
)
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


@pytest.mark.heavy  # 11 s: FP8 layouts equal one device in every suite
def test_a_step_that_sums_its_own_gradients_scales_by_the_whole_batch():
    """With accumulation over ``data`` the step runs each data shard under ``shard_map``
    (``data`` manual) and sums the gradients itself; an activation's amax there is taken
    over every shard (a ``pmax``), so ``data=8`` with ``train.grad_accum=2`` equals one
    device with the same accumulation (losses to rtol 1e-5; each shard's own amax, before,
    gave 4.9e-5)."""
    base = [*GPT_SMALL, *ADAMW, *FP8, "train.grad_accum=2"]
    ref_losses, _, _ = _steps([*base, "mesh.data=1"], devices=1)
    losses, _, run = _steps([*base, "mesh.data=8"], devices=8)
    assert run.plan.accumulates_per_data_shard
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


# ---- (d) delayed scaling --------------------------------------------------------------------
DELAYED = [*FP8, "model.fp8_scaling=delayed", "model.fp8_history=4"]


@partial(jax.jit, static_argnums=0)
def _vjp_delayed(spec, x, w, g, history):
    """Delayed scaling's result and its gradients (of x, w and the history) for the
    incoming gradient ``g``: one program a spec and shape, where op by op every primitive
    of the quantization and its transpose compiled apart."""
    delayed = lambda x, w, h: fp8.einsum(spec, x, w, precision="fp8", history=h)  # noqa: E731
    y, vjp = jax.vjp(delayed, x, w, history)
    return y, *vjp(g)


@partial(jax.jit, static_argnums=0)
def _vjp_current(spec, x, w, g):
    """Current scaling's result and its gradients of x and w (one program, as above)."""
    y, vjp = jax.vjp(partial(fp8.einsum, spec, precision="fp8"), x, w)
    return y, *vjp(g)


def _amaxes(*ts):
    return [jnp.max(jnp.abs(t)).astype(jnp.float32) for t in ts]


def test_delayed_dot_equals_current_scaling_when_its_history_holds_the_amax():
    """Delayed scaling quantizes with the largest amax of its history: where that is
    the tensor's own amax (x, w and the incoming gradient g each), the result and both
    gradients are current scaling's, bit for bit (current scaling: checked against Flax's
    quantize-dequantize above). The history's "gradient" is its next value: per row the
    scale used (current scaling's amax / max(format)), then this step's amax in front of
    the history, the oldest dropped."""
    spec = "btd,dnh->btnh"
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (2, 8, 16)) * 3.0
    w = jax.random.normal(keys[1], (16, 4, 8)) * 0.02
    g = jax.random.normal(keys[2], (2, 8, 4, 8)) * 1e-3
    rows = [jnp.array([0.5, a, 0.5 * a, 0.25 * a, a / 8]) for a in _amaxes(x, w, g)]
    y, dx, dw, next_history = _vjp_delayed(spec, x, w, g, jnp.stack(rows))
    for ours, ref in zip((y, dx, dw), _vjp_current(spec, x, w, g)):
        np.testing.assert_array_equal(ours, ref)
    for row, old, amax, dtype in zip(
        next_history, rows, _amaxes(x, w, g), [E4M3_T, E4M3_T, E5M2_T]
    ):
        assert float(row[0]) == float(amax / fp8_ops.get_fp8_max(dtype, jnp.float32))
        np.testing.assert_array_equal(row[1:], jnp.concatenate([amax[None], old[1:-1]]))


E4M3_T, E5M2_T = jnp.float8_e4m3fn, jnp.float8_e5m2


def test_delayed_scale_is_the_largest_amax_of_the_last_n_steps():
    """Five steps through a history of 3: each step's x scale is the largest of the
    previous 3 steps' amaxes over 448 (a numpy reference), and 1 at the first step,
    while the history is empty (so the first step saturates what exceeds E4M3's range:
    the 600 in x there reads 448)."""
    spec = "td,df->tf"
    w = jnp.eye(4)
    g = jnp.ones((2, 4))
    peaks = [600.0, 2.0, 50.0, 3.0, 1.0]
    history = fp8.empty_history((), 3)
    for step, peak in enumerate(peaks):
        x = jnp.array([[peak, 1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
        y, _, _, history = _vjp_delayed(spec, x, w, g, history)
        window = peaks[max(0, step - 3) : step]
        expected = max(window) / 448.0 if window else 1.0
        assert float(history[fp8.X, 0]) == pytest.approx(expected, rel=1e-7), step
        if step == 0:
            assert float(y[0, 0]) == 448.0
    np.testing.assert_allclose(history[fp8.X, 1:], peaks[:-4:-1])


def _step_states(overrides: list[str], devices: int, steps: int = 3):
    """Losses of ``steps`` AdamW steps and the model state (the histories) after the
    first of them."""
    cfg, run = _run(overrides, devices)
    state = run.trainer.init()
    losses, first = [], None
    for step in range(steps):
        state, metrics = run.trainer.step(state, _batch(cfg, run, step))
        losses.append(float(metrics["loss"]))
        first = first or jax.tree.map(np.asarray, state.model_state)
    return np.array(losses), first, run


@pytest.mark.parametrize(
    "layout,extra",
    [
        (LAYOUTS["data=2,fsdp=2,tensor=2"], []),
        pytest.param(
            ["mesh.data=4", "mesh.tensor=2"],
            ["train.grad_accum=2", "model.remat=full"],
            marks=pytest.mark.exhaustive,
        ),
    ],
    ids=["data=2,fsdp=2,tensor=2", "data=4,tensor=2,accum=2,remat"],
)
def test_delayed_scaling_layouts_match_one_device(layout, extra):
    """Delayed scaling under a layout equals one device's (with the same accumulation:
    each microbatch pushes its amaxes): the losses of 3 AdamW steps to rtol 1e-5, as
    current scaling's, and every history after the first step (scales and the amaxes of
    x, w and g, from the same parameters) to rtol 1e-5. Later histories are not compared
    at that tolerance, for the reason the parameters are not (above): a gradient's amax
    passes through E5M2-rounded gradients, where a 1e-6 difference can cross a rounding
    boundary (measured on JAX 0.12: 0.2% on one gradient amax after 3 steps)."""
    base = [*GPT_SMALL, *ADAMW, *DELAYED, *extra]
    ref_losses, ref_state, _ = _step_states([*base, "mesh.data=1"], devices=1)
    losses, state, run = _step_states([*base, *layout], devices=8)
    assert run.plan.mesh.devices.size == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    for ours, ref in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5)


@pytest.mark.parametrize(
    "family,names",
    [
        (LLAMA, {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}),
        pytest.param(  # the Llama's projections (gemma_layers reuses them) and MLP
            GEMMA,
            {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"},
            marks=pytest.mark.exhaustive,
        ),
        pytest.param(  # a shared expert's names through the Llama's own plumbing
            [*LLAMA, "model.n_experts=4", "model.n_shared_experts=1", "model.moe_every=2"],
            {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"},
            marks=pytest.mark.exhaustive,
        ),
    ],
    ids=["llama", "gemma", "llama-moe-shared"],
)
def test_every_projection_keeps_a_history_that_advances(family, names):
    """Llama, Gemma and a mixture of experts with a shared expert: one history per FP8
    projection (a mixture's routed experts stay in the compute dtype), and after one step
    each holds, in every layer and for x, w and g alike, scale 1 (the empty history's)
    and a positive amax: every projection read its own history once."""
    _, state, _ = _step_states([*family, *DELAYED, "mesh.data=1"], devices=1, steps=1)
    histories = state["blocks"]
    assert set(histories) == {fp8.PREFIX + n for n in names}
    for name, h in histories.items():
        assert h.shape[-2:] == (3, 5), name
        np.testing.assert_array_equal(h[..., 0], 1.0, err_msg=name)
        assert (h[..., 1] > 0).all() and (h[..., 2:] == 0).all(), name


RESUME = [
    *GPT_SMALL,
    *ADAMW,
    *DELAYED,
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "optim.schedule=cosine",
    "optim.decay_steps=6",  # the schedule of the 6-step run, whatever train.steps says
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.every_steps=2",
]


def _final_state(run_dir) -> TrainState:
    run = build(load_config([], [*RESUME, "train.steps=6"]))
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    state, meta = ckpt.restore()
    ckpt.close()
    assert meta["step"] == 6
    return state


# extended: the histories are model state, saved and restored with the rest by the same
# code as BatchNorm statistics and RNG counts (jaxpar/checkpoint.py's model_state). Every
# suite runs a bitwise resume on this layout (tests/test_checkpoint.py's
# test_resume_is_bitwise_identical[fsdp_tp]), model state resumed bit for bit
# (tests/test_user_task.py's SIGTERM resume) and the histories on this layout
# (test_delayed_scaling_layouts_match_one_device[data=2,fsdp=2,tensor=2])
@pytest.mark.exhaustive
def test_delayed_scaling_resumes_bitwise_with_its_histories(tmp_path):
    """6 steps straight vs 2, exit, then a resume for 4 more: the same losses, and the
    same parameters, optimizer state and amax histories, bit for bit (the histories are
    model state: saved and restored with the rest; a resume that lost them would start
    from scale 1 again)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *RESUME, "train.steps=6", f"run.dir={straight}"]) == 0
    assert main(["train", *RESUME, "train.steps=2", f"run.dir={resumed}"]) == 0
    assert main(["train", *RESUME, "train.steps=6", f"run.dir={resumed}"]) == 0
    assert _losses(resumed) == _losses(straight)
    a, b = _final_state(straight), _final_state(resumed)
    assert (np.asarray(a.model_state["blocks"]["fp8_wo"])[:, :, 1:] > 0).all()  # 6 steps > 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def _losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


# ---- (f) FP8 gathers and the lab ----------------------------------------------------------
_PARTITIONED = """
import glob, os, re, sys
from jaxpar.config import load_config
from jaxpar.run import build
cfg = load_config([], sys.argv[2:])
run = build(cfg)
run.trainer.compile_step(run.data.batch(0, cfg.train.batch_size))
text = open(glob.glob(os.path.join(sys.argv[1], "*after_spmd-partitioning*"))[0]).read()
for dtype, shape in re.findall(r"= (\\w+)\\[([\\d,]*)\\][^\\n]*? all-gather\\(", text):
    print(dtype, shape)
"""


# extended: where the partitioner gathers the quantized tensors is measured in every suite
# on the same layout (fsdp=4 × tensor=2 with sequence parallelism) by
# test_the_lab_counts_fp8_gathers[llama-fsdp-sp]: the compiled step's all-gather bytes equal
# the lab's count of FP8 weights and activations gathered at 2 bytes an element (float32's
# would be twice that), through the same fp8.einsum; the E4M3 and E5M2 operands they are
# quantized to: test_gpt_multiplies_e4m3_forward_and_e5m2_gradients
@pytest.mark.exhaustive
def test_fsdp_and_sequence_parallelism_gather_fp8(tmp_path):
    """Where the partitioner places the gathers (XLA's HLO after SPMD partitioning, what a
    GPU compiles from): under ``fsdp=4,tensor=2`` with sequence parallelism, each FP8
    projection's weight is gathered as E4M3 (quantized on its shard: a quarter of float32's
    bytes), and so are the layers' activations before the column-parallel matmuls (E5M2:
    the output gradients before the row-parallel ones); the norms, the embedding table and
    the head's input stay float32. XLA:CPU widens them to float16 afterwards (its
    float-normalization passes; the lab counts 2 bytes an element there, 1 on a GPU)."""
    import subprocess
    import sys

    from tests.helpers import child_env

    env = child_env(8)
    env["XLA_FLAGS"] += f" --xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=spmd-partitioning"
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached program dumps nothing
    layout = ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "tensor.sequence=true"]
    args = [*GPT_SMALL, *FP8, *layout, "run.devices=8"]
    out = subprocess.run(
        [sys.executable, "-c", _PARTITIONED, str(tmp_path), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    gathers = [tuple(line.split()) for line in out.stdout.splitlines()]
    by_dtype = {d: {s for dd, s in gathers if dd == d} for d, _ in gathers}
    # gathered over fsdp: wq|wk|wv stacked [D, 3, N/2, H], wo [N/2, H, D], w_in and w_out
    # [D, F/2] and [F/2, D]; the activations [b, T, D]
    assert by_dtype["f8e4m3fn"] == {"32,3,2,8", "2,8,32", "32,32", "4,16,32"}, gathers
    assert by_dtype["f8e5m2"] == {"4,16,32"}, gathers  # [b, T, D] output gradients
    assert "f16" not in by_dtype


# the suite: the Llama's fsdp × sequence-parallel case, which runs both of the lab's FP8
# terms (FSDP weights gathered quantized, jaxpar/lab/gradient_terms.py; the sequence-parallel
# FP8 activation gathers, jaxpar/lab/tensor_terms.py, counted per layer from the family's
# projection inputs). Extended: the GPT's fsdp=8 (the same weight gathers) and its sequence
# parallelism (the same activation term, with the GPT's count of inputs)
@pytest.mark.parametrize(
    "family,layout",
    grid(
        [
            pytest.param(GPT_SMALL, "fsdp=8", id="gpt-fsdp=8"),
            pytest.param(GPT_SMALL, "data=4,tensor=2,tensor.sequence=true", id="gpt-sp"),
            pytest.param(LLAMA, "fsdp=4,tensor=2,tensor.sequence=true", id="llama-fsdp-sp"),
        ],
        {"llama-fsdp-sp"},
    ),
)
def test_the_lab_counts_fp8_gathers(family, layout):
    """The lab's all-gather bytes of an FP8 layout equal the compiled step's to 1% (its
    FSDP weight gathers and sequence-parallel activation gathers at 2 bytes an element on
    XLA:CPU), fewer than the default precision's (the Llama's five projections each
    gather their own quantized input: 12 gathers of half the bytes a layer where float32
    has 6), and the step's collective bytes to 5%."""
    from jaxpar.config import apply_overrides
    from jaxpar.lab import hardware, predict, sweep

    config = load_config([], [*family, *FP8])
    row = sweep.measure(config, layout, hardware.get_profile("h100"))
    assert row.ok, row.error
    run = build(apply_overrides(config, sweep.layout_overrides(layout)))
    predicted = predict.predict_comm(run, "cpu").by_kind()
    assert row.all_gather_bytes == pytest.approx(predicted["all-gather"], rel=0.01)
    assert row.comm_ratio == pytest.approx(1.0, abs=0.05)
    default = predict.predict_comm(
        build(apply_overrides(load_config([], family), sweep.layout_overrides(layout))), "cpu"
    )
    assert predicted["all-gather"] < default.by_kind()["all-gather"]


# ---- (e) config errors ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,message",
    [
        ("model.precision=fp16", "model.precision' must be one of default, fp8"),
        ("model.fp8_scaling=amax", "model.fp8_scaling' must be one of current, delayed"),
        ("model.fp8_history=0", "model.fp8_history"),
    ],
)
def test_bad_fp8_settings_are_one_line_config_errors(override, message):
    """A bad value names the key and the fix in one line."""
    with pytest.raises(ConfigError, match=message) as err:
        load_config([], [*FP8, override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides,unused",
    [
        (["model.fp8_scaling=delayed", "model.fp8_history=8"], ["fp8_scaling", "fp8_history"]),
        ([*FP8, "model.fp8_history=8"], ["fp8_history"]),
        ([*FP8, "model.fp8_scaling=delayed", "model.fp8_history=8"], []),
    ],
)
def test_scaling_keys_the_precision_leaves_unread_are_warned_of(overrides, unused):
    """``model.fp8_scaling`` without FP8, and ``model.fp8_history`` without delayed
    scaling, change nothing: each is named in a warning with the precision and scaling
    that make it so (STYLE: nothing silently ignored)."""
    from jaxpar.unused import warn_unused

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_unused(load_config([], overrides))
    named = re.findall(r"'model\.(fp8_\w+)'", " ".join(str(w.message) for w in caught))
    assert sorted(named) == sorted(unused)
    assert all("model.precision=" in str(w.message) for w in caught)


def test_delayed_scaling_in_a_pipeline_is_one_line():
    """The pipeline executors do not carry state updated by the backward pass: delayed
    scaling there is refused in one line naming the fix."""
    stages = ["mesh.data=4", "mesh.stage=2"]
    with pytest.raises(JaxparError) as err:
        build(load_config([], [*GPT_SMALL, *DELAYED, *stages, "run.devices=8"]))
    text = str(err.value)
    assert "\n" not in text and "Fp8History" in text and "model.fp8_scaling=current" in text
