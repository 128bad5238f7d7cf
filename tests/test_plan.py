"""The Plan as plain data: for a tiny GPT and the research CNN, each layout's specs, the
pipeline's tick table, the chosen gradient strategy and every layout error — decided by
``make_plan`` alone, without compiling anything."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import Plan, make_plan
from jaxpar.buckets import auto_bytes
from jaxpar.errors import LayoutError, TaskError
from jaxpar.gradients import Accumulated, AccumulatedPerDataShard, Pipelined, Plain
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.models import gpt
from jaxpar.models.gpt import GPTConfig
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.pipeline.ticks import tick_table
from jaxpar.rules import RulesConfig, resolve_rules
from jaxpar.user_code import load_task

CFG = GPTConfig(d_model=32, n_layers=4, n_heads=4, d_ff=64, max_seq_len=16)
TASK = gpt.task(CFG, seq_len=16)
CNN = load_task("examples/research_cnn.py:TASK")
TX = optax.adamw(1e-3)


def plan(
    task=TASK,
    preset="auto",
    pipeline=None,
    grad_accum=1,
    fsdp_gather="per_microbatch",
    rules=(),
    **degrees,
) -> Plan:
    mesh = make_mesh(MeshConfig(**{"data": 1, **degrees}), jax.devices()[:8])
    table = resolve_rules(RulesConfig(preset=preset, overrides=tuple(rules)))
    return make_plan(
        task, TX, mesh, table, grad_accum=grad_accum, pipeline=pipeline, fsdp_gather=fsdp_gather
    )


@pytest.fixture(autouse=True)
def no_compilation():
    """Every plan here is decided without compiling a program."""
    compiled = []

    def listener(event: str, duration: float, **_) -> None:
        # lowering to MLIR happens before any compilation, also on a compilation-cache hit
        if "backend_compile" in event or "jaxpr_to_mlir_module" in event:
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield
    jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiled, f"the plan compiled {len(compiled)} programs"


def _strip(spec: P) -> P:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _specs(tree):
    return jax.tree.map(_strip, tree, is_leaf=lambda x: isinstance(x, P))


FSDP_TP_BLOCKS = {
    "ln1_scale": P(None, "fsdp"),
    "ln1_bias": P(None, "fsdp"),
    "ln2_scale": P(None, "fsdp"),
    "ln2_bias": P(None, "fsdp"),
    "wq": P(None, "fsdp", "tensor"),
    "wk": P(None, "fsdp", "tensor"),
    "wv": P(None, "fsdp", "tensor"),
    "wo": P(None, "tensor", None, "fsdp"),
    "w_in": P(None, "fsdp", "tensor"),
    "b_in": P(None, "tensor"),
    "w_out": P(None, "tensor", "fsdp"),
    "b_out": P(None, "fsdp"),
}


@pytest.mark.parametrize(
    "preset,degrees,w_in,wo,embed,batch",
    [
        ("dp", {"data": 8}, P(), P(), P(), P("data")),
        (
            "fsdp",
            {"data": 2, "fsdp": 4},
            P(None, "fsdp"),
            P(None, None, None, "fsdp"),
            P(None, "fsdp"),
            P(("data", "fsdp")),
        ),
        (
            "tp",
            {"data": 4, "tensor": 2},
            P(None, None, "tensor"),
            P(None, "tensor"),
            P("tensor"),
            P("data"),
        ),
        (
            "fsdp_tp",
            {"data": 2, "fsdp": 2, "tensor": 2},
            P(None, "fsdp", "tensor"),
            P(None, "tensor", None, "fsdp"),
            P("tensor", "fsdp"),
            P(("data", "fsdp")),
        ),
    ],
)
def test_each_preset_gives_its_specs(preset, degrees, w_in, wo, embed, batch):
    p = plan(preset=preset, **degrees)
    specs = _specs(p.param_specs)
    assert specs["blocks"]["w_in"] == w_in and specs["blocks"]["wo"] == wo
    assert specs["embed"] == embed
    assert _strip(p.batch_specs["tokens"]) == batch
    # the optimizer state of every parameter-shaped leaf follows its parameter
    mu = _specs(p.opt_specs[0].mu)
    assert mu == specs and p.opt_replicated == []
    # and the shardings are the same specs on the plan's mesh
    assert p.state_shardings.params["blocks"]["w_in"].spec == p.param_specs["blocks"]["w_in"]


FSDP_TP = {
    "embed": P("tensor", "fsdp"),
    "pos": P(None, "fsdp"),
    "head": P("fsdp", "tensor"),
    "ln_f_scale": P("fsdp"),
    "ln_f_bias": P("fsdp"),
    "blocks": FSDP_TP_BLOCKS,
}


def _without(tree, axis):
    return jax.tree.map(
        lambda s: _strip(P(*(None if e == axis else e for e in s))),
        tree,
        is_leaf=lambda x: isinstance(x, P),
    )


@pytest.mark.parametrize(
    "preset,degrees,expected",
    [
        (
            "dp",
            {"data": 8},
            jax.tree.map(lambda s: P(), FSDP_TP, is_leaf=lambda x: isinstance(x, P)),
        ),
        ("fsdp", {"data": 2, "fsdp": 4}, _without(FSDP_TP, "tensor")),
        ("tp", {"data": 4, "tensor": 2}, _without(FSDP_TP, "fsdp")),
        ("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, FSDP_TP),
        ("auto", {"data": 2, "fsdp": 2, "tensor": 2}, FSDP_TP),
    ],
)
def test_every_parameter_spec_of_each_preset(preset, degrees, expected):
    assert _specs(plan(preset=preset, **degrees).param_specs) == expected


def test_auto_preset_on_all_axes_and_its_state_bytes():
    p = plan(data=2, fsdp=2, tensor=2)
    assert _specs(p.param_specs["blocks"]) == FSDP_TP_BLOCKS
    sizes = p.state_bytes()
    # fsdp × tensor = 4 ways for every matrix: each device holds a quarter of them
    w_in_bytes = 4 * CFG.n_layers * CFG.d_model * CFG.d_ff
    assert sizes.params_total == sum(x.size * 4 for x in jax.tree.leaves(p.model.params))
    assert sizes.params < sizes.params_total / 3
    assert sizes.opt_state_total == 2 * sizes.params_total + 4  # adam's mu, nu and count
    assert w_in_bytes // 4 <= sizes.params


@pytest.mark.parametrize(
    "schedule,p_,m,v",
    [("1f1b", 2, 4, 1), ("zb_h1", 4, 8, 1), ("interleaved", 2, 4, 2), ("gpipe", 4, 4, 1)],
)
def test_pipelined_layout_has_its_tick_table(schedule, p_, m, v):
    p = plan(
        stage=p_,
        data=8 // p_,
        pipeline=PipelineConfig(schedule=schedule, microbatches=m, virtual_stages=v),
    )
    expected = tick_table.__wrapped__(schedule, p_, m, v)  # made anew, not the shared one
    assert (p.pipeline.p, p.pipeline.m, p.pipeline.v) == (p_, m, v)
    # one table a shape per process, which no one can change in place
    assert p.pipeline is tick_table(schedule, p_, m, v) and not p.pipeline.kind.flags.writeable
    for column in ("kind", "chunk", "mb", "act_slot", "grad_slot", "recv_act", "recv_grad"):
        np.testing.assert_array_equal(getattr(p.pipeline, column), getattr(expected, column))
    assert p.microbatches == m and isinstance(p.gradients, Pipelined)
    assert _strip(p.param_specs["blocks"]["w_in"])[0] == "stage"  # layers over stages


def test_default_microbatches_are_twice_the_stages():
    assert plan(stage=4, data=2).pipeline.m == 8


#: ``data`` alone without accumulation: the per-shard step where auto means buckets (the CPU)
PLAIN_DATA = AccumulatedPerDataShard if auto_bytes(jax.default_backend()) else Plain


@pytest.mark.parametrize(
    "task,degrees,accum,fsdp_gather,strategy,inner",
    [
        (TASK, {"data": 8}, 1, "per_microbatch", PLAIN_DATA, None),
        (TASK, {"data": 8}, 4, "per_microbatch", AccumulatedPerDataShard, None),
        (CNN, {"data": 8}, 4, "per_microbatch", Accumulated, Plain),  # BatchNorm: automatic path
        (TASK, {"data": 2, "fsdp": 2, "tensor": 2}, 2, "per_microbatch", Accumulated, Plain),
        (TASK, {"fsdp": 8}, 2, "per_microbatch", Accumulated, Plain),
        (TASK, {"stage": 2, "data": 4}, 2, "per_microbatch", Accumulated, Pipelined),
    ],
)
def test_the_gradient_strategy_of_each_layout(task, degrees, accum, fsdp_gather, strategy, inner):
    p = plan(task=task, grad_accum=accum, fsdp_gather=fsdp_gather, **degrees)
    assert type(p.gradients) is strategy
    if inner is not None:
        assert type(p.gradients.inner) is inner and p.gradients.k == accum
    assert p.accumulates_per_data_shard == (strategy is AccumulatedPerDataShard)


def test_fsdp_gather_once_gathers_the_batch_axes_away():
    p = plan(fsdp=8, grad_accum=2, fsdp_gather="once")
    assert p.fsdp_gather_once
    gathered = p.gradients.gathered_shardings["blocks"]["w_in"].spec
    assert _strip(gathered) == P()  # whole on every device through the accumulation
    with pytest.warns(
        UserWarning, match="'train.fsdp_gather' has no effect with train.grad_accum=1"
    ):
        assert not plan(fsdp=8, fsdp_gather="once").fsdp_gather_once


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            {"tensor": 2, "data": 4, "rules": [("mpl", ())]},
            LayoutError,
            "rules.mpl' names no logical axis.*did you mean 'rules.mlp'",
        ),
        (
            {"data": 8, "rules": [("batch", ())]},
            LayoutError,
            "batch 'tokens' is not split over mesh axis 'data'",
        ),
        (
            {"tensor": 2, "data": 4, "preset": "dp"},
            LayoutError,
            "mesh axis 'tensor' has size 2 but no rule shards anything over it",
        ),
        ({"tensor": 8}, LayoutError, r"'heads', size 4.*not divisible.*size 8"),
        ({"stage": 2, "data": 4, "task": CNN}, LayoutError, "cannot be split into pipeline stages"),
        (
            {"stage": 2, "data": 4, "rules": [("layers", ())]},
            LayoutError,
            "needs the stacked layers split over it.*rules.layers=stage",
        ),
        (
            {"stage": 8},
            LayoutError,
            "4 layers cannot be cut into mesh.stage × pipeline.virtual_stages = 8×1",
        ),
    ],
)
def test_each_layout_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan(**kwargs)


def test_a_stateful_model_cannot_be_pipelined():
    import dataclasses

    from jaxpar.task import StageSplit

    staged = dataclasses.replace(
        CNN,
        stages=StageSplit("conv", lambda m, b: b, lambda m, x, b, f: x, lambda m, x, b: (0.0, {})),
    )
    with pytest.raises(LayoutError, match="BatchStat.*statistics of the whole batch"):
        plan(task=staged, stage=2, data=4)


def test_batch_checks_name_the_fix():
    p = plan(data=8, grad_accum=2)
    ok = {"tokens": jax.ShapeDtypeStruct((32, 17), np.int32)}
    assert _strip(p.batch_shardings(ok)["tokens"].spec) == P("data")
    with pytest.raises(
        LayoutError,
        match=r"global batch 24 must be divisible by "
        r"train.grad_accum \(2\) × the 8 devices",
    ):
        p.batch_shardings({"tokens": jax.ShapeDtypeStruct((24, 17), np.int32)})
    with pytest.raises(TaskError, match="batch has entries \\['text'\\]"):
        p.batch_shardings({"text": ok["tokens"]})
    staged = plan(stage=2, data=4, pipeline=PipelineConfig(microbatches=4))
    with pytest.raises(LayoutError, match="evaluation batch of 8 runs through the pipeline"):
        staged.check_eval_batch({"tokens": jax.ShapeDtypeStruct((8, 17), np.int32)})


def test_replan_changes_only_the_settings_named():
    p = plan(fsdp=8, grad_accum=2)
    q = p.replan(fsdp_gather="once")
    assert q.fsdp_gather_once and not p.fsdp_gather_once
    assert q.mesh is p.mesh and q.rules == p.rules and q.grad_accum == 2
    assert _specs(q.param_specs) == _specs(p.param_specs)


def test_a_built_in_models_task_in_one_call():
    """``jaxpar.task_for(config)`` and the family's own ``task`` give the same task; a GPT
    config that names Hugging Face weights is read by ``task_for``, not by ``gpt.task``."""
    from jaxpar import load_config, task_for
    from jaxpar.errors import ConfigError

    config = load_config(
        [], ["model.d_model=32", "model.n_heads=4", "data.seq_len=16", "model.max_seq_len=16"]
    )
    made = task_for(config)
    direct = gpt.task(config.model, seq_len=16)
    assert (
        (made.batch_axes, made.tokens_per_example, made.stages)
        == (direct.batch_axes, direct.tokens_per_example, direct.stages)
        == ({"tokens": ("batch", None)}, 16, gpt.STAGES)
    )
    shapes = lambda t: jax.tree.map(lambda a: a.shape, plan(task=t, data=8).model.params)
    assert shapes(made) == shapes(direct) and made.init_params is None
    with pytest.raises(ConfigError, match="model.init_from=some/dir: .*jaxpar.task_for"):
        gpt.task(GPTConfig(init_from="some/dir"), seq_len=16)
