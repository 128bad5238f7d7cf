"""Mixture of experts (jaxpar/models/moe.py) in the Llama family: the dropless grouped
computation equals a dense reference that runs every expert and masks by the routing
(forward and gradients); the auxiliary losses match their formulas; a capacity factor drops
exactly the assignments beyond it; every layout, expert parallelism included, equals one
device; KV-cache decoding equals the forward pass; bad input is one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import ConfigError, LayoutError
from jaxpar.models.llama import Llama
from jaxpar.models.moe import capacity_mask, moe_mlp, route
from tests.helpers import (
    assert_params_close,
    decode_stepwise,
    grid,
    one_device_steps,
    run_steps,
)

MOE = [
    "model.name=llama",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=48",
    "model.n_layers=4",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.batch_size=16",
    "optim.name=adamw",
    "optim.lr=3e-3",
    "optim.warmup_steps=0",
    "model.n_experts=8",
    "model.top_k=2",
    "model.moe_every=2",
    "model.n_shared_experts=1",
]


def _experts(seed: int, E: int = 4, D: int = 8, F: int = 12):
    keys = jax.random.split(jax.random.key(seed), 5)
    return {
        "router": jax.random.normal(keys[0], (D, E)),
        "w_gate": 0.3 * jax.random.normal(keys[1], (E, D, F)),
        "w_up": 0.3 * jax.random.normal(keys[2], (E, D, F)),
        "w_down": 0.3 * jax.random.normal(keys[3], (E, F, D)),
    }, keys[4]


def dense_reference(h, p, top_k):
    """Every expert on every token, weighted by the routing (zero where not routed)."""
    experts, weights, _ = route(h.reshape(-1, h.shape[-1]), p["router"], top_k)
    E = p["router"].shape[-1]
    gate = (
        jnp.zeros((experts.shape[0], E))
        .at[jnp.arange(experts.shape[0])[:, None], experts]
        .add(weights)
    )
    x = h.reshape(-1, h.shape[-1])
    act = jax.nn.silu(jnp.einsum("td,edf->tef", x, p["w_gate"])) * jnp.einsum(
        "td,edf->tef", x, p["w_up"]
    )
    every = jnp.einsum("tef,efd->ted", act, p["w_down"])
    return jnp.einsum("ted,te->td", every, gate).reshape(h.shape)


@pytest.mark.parametrize(
    "top_k",
    grid(
        [pytest.param(k, id=str(k)) for k in (1, 2, 4)],
        # the suite: top-2, the MoE Llama's (MOE); top-1 and top-4 (every expert) go
        # through the same routing, sort by expert and grouped matmuls: extended
        {"2"},
    ),
)
def test_dropless_equals_the_dense_reference_forward_and_gradients(top_k):
    p, key = _experts(0)
    h = jax.random.normal(key, (3, 10, 8))
    # jitted: one compile each, where op-by-op dispatch compiled every primitive apart
    ours_fn, want_fn = (
        (lambda h, p: moe_mlp(h, p, top_k)[0]),
        (lambda h, p: dense_reference(h, p, top_k)),
    )
    got = jax.jit(ours_fn)(h, p)
    np.testing.assert_allclose(got, jax.jit(want_fn)(h, p), atol=1e-5)
    loss = lambda f: lambda h, p: jnp.sum(jnp.sin(f(h, p)))  # noqa: E731
    ours = jax.jit(jax.grad(loss(ours_fn), argnums=(0, 1)))(h, p)
    want = jax.jit(jax.grad(loss(want_fn), argnums=(0, 1)))(h, p)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(jnp.abs(b).max())))


def test_the_auxiliary_losses_match_their_formulas():
    """Load balancing: E · Σ_e f_e · P_e (f_e the share of assignments, P_e the mean
    probability); z-loss: mean logsumexp(logits)²; a uniform router balances to 1."""
    p, key = _experts(1)
    x = jax.random.normal(key, (40, 8))
    route_jit = jax.jit(route, static_argnums=2)  # one program, not op by op
    experts, _, stats = route_jit(x, p["router"], 2)
    logits = np.asarray(x @ p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    f = np.bincount(np.asarray(experts).ravel(), minlength=4) / experts.size
    np.testing.assert_allclose(stats["balance"], 4 * np.sum(f * probs.mean(0)), rtol=1e-5)
    np.testing.assert_allclose(stats["load"], f, rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(stats["z"], np.mean(lse**2), rtol=1e-5)
    _, _, uniform = route_jit(x, jnp.zeros((8, 4)), 4)
    np.testing.assert_allclose(uniform["balance"], 1.0, rtol=1e-6)


def test_a_capacity_factor_drops_exactly_the_assignments_beyond_it():
    """A constructed sequence routing 6 of its 8 tokens' first choice to expert 0: with
    capacity factor 1 (8 tokens · top-1 / 4 experts = 2 a expert) expert 0 keeps its first
    two, and the others' assignments stay."""
    experts = jnp.array([[0, 0, 1, 0, 2, 0, 0, 3]])[..., None]
    keep = jax.jit(capacity_mask, static_argnums=(1, 2))(experts, 4, 1.0)
    assert keep[0, :, 0].tolist() == [True, True, True, False, True, False, False, True]
    # through the layer: the dropped count, and the dropped tokens' zero output
    p, _ = _experts(2)
    h = jnp.ones((1, 8, 8)) * jnp.arange(1, 9)[None, :, None] / 8
    p["router"] = jnp.zeros((8, 4)).at[:, 0].set(5.0)  # every token prefers expert 0
    y, stats = jax.jit(lambda h, p: moe_mlp(h, p, 1, capacity_factor=1.0))(h, p)
    assert int(stats["dropped"]) == 6
    assert np.abs(np.asarray(y[0, 2:])).max() == 0 and np.abs(np.asarray(y[0, :2])).min() > 0


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.data=8"], id="data8"),
            pytest.param(["mesh.data=1", "mesh.fsdp=8"], id="fsdp8"),
            pytest.param(["mesh.data=8", "rules.experts=data"], id="expert8"),
            pytest.param(["mesh.data=4", "mesh.fsdp=2", "rules.experts=data"], id="expert4-fsdp2"),
            pytest.param(
                ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "rules.experts=data"],
                id="expert2-fsdp2-tensor2",
            ),
            pytest.param(["mesh.data=2", "mesh.context=4"], id="context4"),
            pytest.param(
                ["mesh.data=4", "mesh.context=2", "rules.experts=data", "context.attention=ring"],
                id="expert4-context2-ring",
            ),
        ],
        # the suite: experts over 2 devices beside fsdp and tensor; over 4 in the zb_h1
        # pipeline and over 8 in bfloat16 (below); MoE beside context in the capacity
        # test's context=4 case. Experts beside a context ring is their crossing: extended
        {"expert2-fsdp2-tensor2"},
    ),
)
def test_moe_layouts_equal_one_device(layout):
    """An MoE Llama (8 experts, top-2, every 2nd layer, a shared expert): losses and
    parameters of 3 AdamW steps equal one device's, with experts split over data (8, 4 and
    2 devices: 1, 2 and 4 experts a device) as without."""
    one = one_device_steps(MOE)
    losses, params, run = run_steps([*MOE, *layout])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)
    if "rules.experts=data" in layout:
        spec = run.plan.param_specs["blocks"]["e_gate"]
        assert spec[1] == "data" and run.plan.mesh.shape["data"] > 1


def test_experts_beside_context_parallelism_compute_a_devices_share():
    """The MoE layer runs manual over the sequence's axes as over the batch's: under
    ``context=4`` each device routes and computes its own quarter of its rows' tokens, so
    the compiled step's FLOPs equal those of the batch split 8 ways (every device of a
    context group computed the group's whole sequences: 3.3× with this model's 4 layers,
    half of them MoE)."""
    from jaxpar.lab.hardware import get_profile
    from jaxpar.lab.measure import measure

    config = jaxpar.load_config([], MOE)
    flops = [measure(config, x, get_profile("h100")).flops for x in ("data=8", "data=2,context=4")]
    assert flops[1] == pytest.approx(flops[0], rel=0.02)


def _steps_with_metrics(overrides: list[str], devices: int = 8, steps: int = 3):
    """Losses, final parameters and the last step's metrics (as numbers)."""
    config = jaxpar.load_config([], [*overrides, f"train.steps={steps}", f"run.devices={devices}"])
    run = jaxpar.build(config)
    state, losses = run.trainer.init(), []
    for step in range(steps):
        state, metrics = run.trainer.step(
            state, run.trainer.shard_batch(run.data.batch(step, config.train.batch_size))
        )
        losses.append(float(metrics["loss"]))
    return (
        np.array(losses),
        jax.tree.map(np.asarray, state.params),
        {k: float(v) for k, v in metrics.items()},
    )


@pytest.fixture(scope="module")
def accumulated():
    """One device, the batch as 2 microbatches (a pipeline's routing sees a microbatch)."""
    return _steps_with_metrics([*MOE, "mesh.data=1", "train.grad_accum=2"], devices=1)


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.data=4", "pipeline.executor=mpmd"], id="mpmd"),
            pytest.param(
                ["mesh.data=4", "pipeline.schedule=zb_h1", "rules.experts=data"],
                id="spmd-zb_h1-expert4",
            ),
            pytest.param(
                [
                    "mesh.data=2",
                    "mesh.fsdp=2",
                    "pipeline.executor=mpmd",
                    "pipeline.backward=residuals",
                    "rules.experts=data",
                ],
                id="mpmd-residuals-expert2-fsdp2",
            ),
        ],
        # heavy (19-20 s each, and the accumulated reference's 7 s): the MoE layers' own
        # code runs in every suite's layouts and lab cases (in stages: the lab's
        # stage=2 cases, which compile both executors' programs)
        set(),
        heavy={"spmd-zb_h1-expert4", "mpmd-residuals-expert2-fsdp2"},
    ),
)
def test_moe_pipelines_equal_one_device(accumulated, layout):
    """An MoE Llama cut into 2 stages of 2 MoE layers each (both executors, a zero-bubble
    schedule, experts split over data): every stage adds its share of the routers' losses
    and metrics, so losses, parameters and the load-balancing, z-loss, dropped and
    per-expert load metrics of 3 AdamW steps equal one device's with the same 2
    microbatches."""
    losses, params, metrics = _steps_with_metrics(
        [*MOE, "mesh.stage=2", "pipeline.microbatches=2", *layout]
    )
    np.testing.assert_allclose(losses, accumulated[0], rtol=1e-5)
    assert_params_close(params, accumulated[1], elementwise=False, rtol=1e-4)
    assert set(metrics) == set(accumulated[2])
    for name, value in accumulated[2].items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_accumulation_per_data_shard_routes_the_whole_microbatch(accumulated):
    """``data × fsdp`` with accumulation runs each data shard's microbatches manual over
    ``data`` (its rules then name ``fsdp`` alone): the routers' statistics are summed over
    both, so the load-balancing loss is the whole microbatch's, and losses, parameters and
    every ``moe_*`` metric equal one device's with the same 2 microbatches (they were each
    data shard's: balance 1.0122 against 1.0078 on the first step)."""
    losses, params, metrics = _steps_with_metrics(
        [*MOE, "mesh.data=4", "mesh.fsdp=2", "train.grad_accum=2"]
    )
    np.testing.assert_allclose(losses, accumulated[0], rtol=1e-5)
    assert_params_close(params, accumulated[1], elementwise=False, rtol=1e-4)
    for name, value in accumulated[2].items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


# the extended tier: the interleaved stack stays in every suite under the spmd executor
# (tests/test_pipeline.py's fsdp/all-axes case) and under the sub-mesh one
# (tests/test_submesh.py's BatchNorm + Dropout CNN), and so do MoE's pipelines (above)
@pytest.mark.exhaustive
def test_moe_interleaved_stack_under_both_executors():
    """Eight layers, every second one MoE, on 2 stages of 2 chunks each: the sub-mesh
    executor takes each chunk's share of every entry of the stack by that entry's own rows
    (the MoE entries have half the layers' rows), and its losses, parameters and metrics
    equal the spmd executor's."""
    common = [
        *MOE,
        "model.n_layers=8",
        "mesh.stage=2",
        "mesh.data=4",
        "pipeline.microbatches=2",
        "pipeline.schedule=interleaved",
        "pipeline.virtual_stages=2",
    ]
    spmd = _steps_with_metrics([*common, "pipeline.executor=spmd"])
    mpmd = _steps_with_metrics([*common, "pipeline.executor=mpmd"])
    np.testing.assert_allclose(mpmd[0], spmd[0], rtol=1e-5)
    assert_params_close(mpmd[1], spmd[1], elementwise=False, rtol=1e-4)
    for name, value in spmd[2].items():
        np.testing.assert_allclose(mpmd[2][name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_metrics_decoding_and_counts():
    """The metrics name the auxiliary losses and each expert's load (summing to 1), and the
    loss adds the weighted auxiliary losses to the cross entropy; decoding through the KV
    cache equals the forward pass; the parameter count equals the model's. The run is the
    one-device reference of the layouts above (once per test process): its compiled init
    and step again, nothing built or compiled for this test (the metrics across devices
    equal one device's in the pipeline tests above)."""
    run = one_device_steps(MOE)[2]
    state, metrics = run.trainer.step(
        run.trainer.init(), run.trainer.shard_batch(run.data.batch(0, 16))
    )
    loads = [float(metrics[f"moe_load_{e}"]) for e in range(8)]
    assert abs(sum(loads) - 1) < 1e-5 and float(metrics["moe_dropped"]) == 0
    cfg = run.config.model
    want = (
        float(metrics["ce"])
        + cfg.aux_loss_coef * float(metrics["moe_balance"])
        + cfg.z_loss_coef * float(metrics["moe_z"])
    )
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    counts = run.family.counts(cfg, run.data)
    assert counts.params == sum(x.size for x in jax.tree.leaves(run.plan.model.params))
    # the run's MoE Llama with that step's parameters: no second model initialized op by op
    model = nnx.merge(run.plan.model.graphdef, state.params, state.model_state)
    assert isinstance(model, Llama)
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
    np.testing.assert_allclose(decode_stepwise(model, tokens, 6), jax.jit(model)(tokens), atol=1e-5)


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match=r"model.top_k=9 is more than model.n_experts=8"):
        jaxpar.load_config([], [*MOE, "model.top_k=9"])
    with pytest.raises(ConfigError, match=r"model.moe_every=3 does not divide model.n_layers"):
        jaxpar.load_config([], [*MOE, "model.moe_every=3"])
    config = jaxpar.load_config(
        [], [*MOE, "model.n_experts=6", "mesh.data=4", "mesh.fsdp=2", "rules.experts=data"]
    )
    with pytest.raises(
        LayoutError,
        match=r"parameter 'blocks/e_down': dim 1 \('experts', "
        r"size 6\) .* not divisible by mesh axes \('data',\) "
        r"of size 4",
    ):
        jaxpar.build(config)


@pytest.mark.exhaustive  # the suite: the dispatch beside tensor and in pipelines (below)
def test_the_lab_predicts_the_expert_dispatch():
    """With experts split over data (8, and 4 beside fsdp=2; with remat, which gathers the
    tokens again) the step's collective bytes — the tokens and routing gathered, the
    outputs reduce-scattered, their transposes in the backward, the experts' gradients
    kept whole — equal the lab's prediction (1%)."""
    from jaxpar.lab import hardware, sweep

    config = jaxpar.load_config([], MOE)
    h100 = hardware.get_profile("h100")
    for layout in (
        "data=8,rules.experts=data",
        "data=4,fsdp=2,rules.experts=data",
        "data=8,rules.experts=data,model.remat=full",
    ):
        row = sweep.measure(config, layout, h100)
        assert row.ok, row.error
        assert row.reduce_scatter_bytes > 0 and row.comm_ratio == pytest.approx(1, abs=0.01)


#: MoE layouts under tensor parallelism and in pipelines: experts over data beside tensor,
#: and the spmd executor's pipeline in the suite; the mpmd executor's pipeline heavy (12 s
#: under load: its seven programs compiled; the suite's spmd pipeline keeps the experts'
#: terms inside a stage, and tests/test_analytic.py the mpmd executor's sends); the rest in
#: the extended tier
LAB_LAYOUTS = grid(
    [
        pytest.param(x, id=x)
        for x in (
            "data=4,tensor=2,rules.experts=data",
            # recomputing the dense MLPs' outputs, which save_qkv does not keep: again
            "data=4,tensor=2,rules.experts=data,model.remat=save_qkv",
            "data=2,fsdp=2,tensor=2,model.n_shared_experts=0,model.remat=full",
            "stage=2,data=4,rules.experts=data",
            "stage=2,data=4,rules.experts=data,pipeline.executor=mpmd",
            "stage=2,data=4,rules.experts=data,pipeline.executor=mpmd,pipeline.backward=residuals",
        )
    ],
    {
        "data=4,tensor=2,rules.experts=data,model.remat=save_qkv",
        "stage=2,data=4,rules.experts=data",
    },
    heavy={"stage=2,data=4,rules.experts=data,pipeline.executor=mpmd"},
)


@pytest.mark.parametrize("layout", LAB_LAYOUTS)
def test_the_lab_predicts_experts_under_tensor_and_in_pipelines(layout):
    """Under ``tensor`` (experts over data, and not, without shared experts; recomputed
    under a policy that keeps no MLP output, and fully) the MoE layers' all-reduces of
    their routed rows [b·e·T·k, D] — the down projection's outputs, the gate and up
    projections' input gradients — make the
    all-reduces equal the lab's (1%); in the spmd pipeline the experts are gathered as
    FSDP's weights, in the sub-mesh pipeline each program dispatches its chunk's share:
    gathers and reduce-scatters equal (1%); every step's collective bytes within 5%."""
    from jaxpar.config import apply_overrides
    from jaxpar.lab import hardware, predict, sweep
    from jaxpar.run import build

    config = jaxpar.load_config([], MOE)
    row = sweep.measure(config, layout, hardware.get_profile("h100"))
    assert row.ok, (layout, row.error)
    prediction = predict.predict_comm(
        build(apply_overrides(config, sweep.layout_overrides(layout))), "cpu"
    )
    kinds, what = prediction.by_kind(), {t.what for t in prediction.terms}
    if "tensor" in layout:
        assert {
            "experts: routed outputs all-reduced over tensor",
            "experts: routed input gradients all-reduced over tensor",
        } <= what
        assert row.all_reduce_bytes == pytest.approx(kinds["all-reduce"], rel=0.01), layout
    else:
        assert row.all_gather_bytes == pytest.approx(kinds["all-gather"], rel=0.01), layout
        assert row.reduce_scatter_bytes == pytest.approx(
            kinds.get("reduce-scatter", 0), rel=0.01
        ), layout
    if "mpmd" in layout:
        assert "experts: tokens and routing gathered" in what
    assert row.comm_ratio == pytest.approx(1.0, abs=0.05), layout


def test_sweep_all_adds_expert_parallel_layouts():
    """``sweep --all`` of an MoE model: every layout whose data degree divides the experts
    comes again with them split over data; a dense model gets none."""
    from jaxpar.lab import sweep

    layouts, _ = sweep.default_layouts(jaxpar.load_config([], MOE), 8)
    assert {
        "data=8,rules.experts=data",
        "data=4,tensor=2,rules.experts=data",
        "data=2,context=4,rules.experts=data",
    } <= set(layouts)
    dense, _ = sweep.default_layouts(jaxpar.load_config([], MOE[:-4]), 8)
    assert not [x for x in dense if "experts" in x]


@pytest.mark.heavy  # 18 s: float32 experts equal one device in every suite
def test_bfloat16_experts_track_one_device():
    """bfloat16 compute with the experts split over data (the experts enter the dispatch in
    float32 and are cast there, so their gradients are summed in float32): the losses stay
    within bfloat16 rounding of one device's."""
    bf16 = [*MOE, "model.dtype=bfloat16"]
    one = run_steps([*bf16, "mesh.data=1"], devices=1)
    losses, _, _ = run_steps([*bf16, "mesh.data=8", "rules.experts=data"])
    np.testing.assert_allclose(losses, one[0], rtol=2e-2)


CAPPED = [*MOE, "model.capacity_factor=1.0"]


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.data=2", "mesh.context=4"], id="context4"),
            pytest.param(["mesh.data=8", "rules.experts=data"], id="expert8"),
        ],
        # heavy (19 s): context's reordered sequences; the cap itself is every suite's
        # test_a_capacity_factor_drops_exactly_the_assignments_beyond_it. The cap is
        # applied to a device's own tokens before any dispatch, so experts over data drop
        # what one device drops in the suite's all-to-all training
        # (tests/test_moe_alltoall.py: capacity factor 1, experts over data=4 beside
        # fsdp=2); the all-gather dispatch here is extended
        set(),
        heavy={"context4"},
    ),
)
def test_a_capacity_factor_drops_the_same_assignments_on_every_layout(layout):
    """With a capacity factor, context parallelism (its sequences reordered for balance)
    and expert parallelism drop what one device drops: the same count, losses and
    parameters."""
    one = one_device_steps(CAPPED)  # once per test process
    run = one[2]  # its step again (compiled): the cap binds on the first batch
    _, metrics = run.trainer.step(
        run.trainer.init(), run.trainer.shard_batch(run.data.batch(0, 16))
    )
    assert float(metrics["moe_dropped"]) > 0
    losses, params, _ = run_steps([*CAPPED, *layout])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


def test_a_plan_offers_the_experts_other_placement_once():
    """A plan's default layouts add each layout with its data degree dividing the experts
    again with the experts placed the other way than the config places them: split over
    data where the config does not split them, not split where it does — never a layout
    that is the config's own again under another name."""
    from jaxpar.lab.sweep import default_layouts

    for given, other in (
        ([], "rules.experts=data"),
        (["rules.experts=data"], "rules.experts=null"),
    ):
        config = jaxpar.load_config([], [*MOE, *given])
        layouts, _ = default_layouts(config, 8, platform="gpu")
        variants = [x for x in layouts if "rules.experts" in x]
        assert variants and all(x.endswith(f",{other}") for x in variants), variants
        assert len(set(layouts)) == len(layouts)
        assert f"data=4,fsdp=2,{other}" in variants
