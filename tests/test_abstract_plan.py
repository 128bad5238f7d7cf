"""Plans for devices that are not here (``build(config, target=(count, platform))``, an
abstract mesh): the first step of the planner for clusters (issue 45). The plan, the
state's bytes per device and the lab's collective terms come from shapes and layouts
alone, so they must equal those of the same layout on the devices here, and at 1,024
devices follow from the model's size and the degrees."""

import jax
import pytest

from jaxpar.config import load_config
from jaxpar.errors import LayoutError
from jaxpar.lab import hardware, predict
from jaxpar.lab.measure import _memory, lower, measure
from jaxpar.run import build
from tests.helpers import GPT_SMALL
from tests.test_llama import LLAMA
from tests.test_moe import MOE

EXHAUSTIVE = pytest.mark.exhaustive  # the suite keeps one case of each mechanism
LAYOUTS = [
    (GPT_SMALL, ["mesh.data=8"]),
    pytest.param(GPT_SMALL, ["mesh.fsdp=8"], marks=EXHAUSTIVE),
    (GPT_SMALL, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    (GPT_SMALL, ["mesh.data=4", "mesh.context=2", "context.attention=ulysses"]),
    (GPT_SMALL, ["mesh.data=4", "mesh.stage=2", "pipeline.microbatches=2"]),
    pytest.param(
        GPT_SMALL, ["mesh.data=2", "mesh.tensor=4", "tensor.sequence=true"], marks=EXHAUSTIVE
    ),
    pytest.param(GPT_SMALL, ["mesh.data=8", "train.grad_accum=2"], marks=EXHAUSTIVE),
    (MOE, ["mesh.data=8", "rules.experts=data"]),
]


def _id(case) -> str:
    values = case.values if hasattr(case, "values") else case
    return ",".join(values[1])


@pytest.mark.parametrize("base,layout", LAYOUTS, ids=[_id(c) for c in LAYOUTS])
def test_an_abstract_mesh_plans_what_the_devices_here_would(base, layout):
    """Eight devices that are not here against the eight that are: the same gradient
    strategy, the same state bytes per device, and the same lab terms, each collective
    (kind, what, payload, group, times), gradient buckets included."""
    config = load_config([], [*base, "run.devices=8", *layout])
    here = build(config)
    there = build(config, target=(8, "cpu"))
    assert not there.devices and there.plan.mesh.shape == here.plan.mesh.shape
    assert type(there.plan.gradients) is type(here.plan.gradients)
    assert there.plan.state_bytes() == here.plan.state_bytes()
    assert predict.predict_comm(there, "cpu").terms == predict.predict_comm(here, "cpu").terms


def test_a_1024_gpu_plan_of_llama3_70b_follows_from_its_size():
    """Llama-3-70B on 1,024 GPUs (FSDP 128 × tensor 8), planned here (about 1 s): each
    device holds 1/1024 of the parameters and AdamW's two moments (f32: 12 bytes a
    parameter; within 1% — the norms' weights are not split over tensor), and the lab's
    FSDP gathers and gradient reduce-scatters run over groups of 128 (the GPU's choice,
    where XLA:CPU would all-reduce)."""
    config = load_config(
        ["configs/llama3_70b.yaml"], ["mesh.fsdp=128", "mesh.tensor=8", "train.batch_size=1024"]
    )
    run = build(config, target=(1024, "gpu"))
    terms = predict.predict_comm(run, "gpu").terms
    state = run.plan.state_bytes()
    params = state.params_total / 4  # f32 parameters
    assert 69e9 < params < 72e9
    assert 12 * params / 1024 <= state.total <= 1.01 * 12 * params / 1024
    gathers = [t for t in terms if t.kind == "all-gather" and "gather" in t.what]
    scatters = [t for t in terms if t.kind == "reduce-scatter"]
    assert gathers and scatters and {t.group for t in scatters} == {128}


def test_the_sub_mesh_executor_plans_on_devices_here_only():
    config = load_config(
        [],
        [
            *GPT_SMALL,
            "mesh.data=4",
            "mesh.stage=2",
            "pipeline.microbatches=2",
            "pipeline.executor=mpmd",
        ],
    )
    with pytest.raises(LayoutError, match="pipeline.executor=spmd"):
        build(config, target=(8, "cpu"))


@pytest.mark.parametrize(
    "base,layout",
    [
        # the suite: data=2,fsdp=2,tensor=2 (gathers, reduce-scatters and tensor all-reduces
        # beside the data all-reduce); the reading compile's options (analysis_options) are
        # the same whatever the layout, so data=8's is extended
        pytest.param(LLAMA, "data=8", marks=EXHAUSTIVE),
        pytest.param(LLAMA, "fsdp=8", marks=EXHAUSTIVE),
        (LLAMA, "data=2,fsdp=2,tensor=2"),
        pytest.param(GPT_SMALL, "data=4,stage=2,pipeline.microbatches=4", marks=EXHAUSTIVE),
    ],
)
def test_plan_reports_the_memory_of_the_program_training_compiles(base, layout):
    """``plan`` and ``sweep --steps 0`` compile for reading (cheaper XLA options: a
    fifth to a quarter of the time); the arguments, temporaries, outputs and peak they report are
    those of the step as training compiles it (``jaxpar inspect``), byte for byte."""
    config = load_config([], base)
    row = measure(config, layout, hardware.get_profile("h100"))
    lowered = lower(config, layout, hardware.get_profile("h100"))
    batch = lowered.run.data.batch(0, lowered.run.config.train.batch_size)
    trained = lowered.run.trainer.compile_step(batch)
    reported = (row.mem_args_bytes, row.mem_temp_bytes, row.mem_output_bytes, row.mem_total_bytes)
    assert reported == _memory(trained)


def test_auto_settings_follow_the_platform_planned_for():
    """``train.grad_bucket_mb=auto`` on ``data=8``: buckets for 8 CPUs, XLA's reduction
    (no bucket term in the lab) for 8 GPUs planned from this CPU, and the same when the
    devices are here but the plan is for a GPU profile (``platform=``); a target that
    is not a JAX platform, or one with ``fit_memory``, is one line."""
    from jaxpar.errors import ConfigError
    from jaxpar.gradients import AccumulatedPerDataShard, Plain
    from jaxpar.lab.gradient_terms import BUCKETS

    config = load_config([], [*GPT_SMALL, "run.devices=8", "mesh.data=8"])
    cpus = build(config, target=(8, "cpu"))
    gpus = build(config, target=(8, "gpu"))
    assert isinstance(cpus.plan.gradients, AccumulatedPerDataShard)
    assert type(gpus.plan.gradients) is Plain and gpus.plan.layout.platform == "gpu"
    assert not [t for t in predict.predict_comm(gpus, "gpu").terms if t.what == BUCKETS]
    assert type(build(config, platform="gpu").plan.gradients) is Plain
    with pytest.raises(ConfigError, match="'cuda'.*cpu, gpu, tpu"):
        build(config, target=(8, "cuda"))
    with pytest.raises(ConfigError, match="fit_memory"):
        build(config, target=(8, "gpu"), fit_memory=True)


def test_the_reads_outside_a_stack_are_traced_once_a_model(monkeypatch):
    """What a pipeline's last stage reads outside the stacked layers (the head): traced
    once per model, stage position and batch shape, so another layout's plan gets the same
    set without tracing again; a model whose split functions do not hash is traced each
    time, to the same set."""
    import dataclasses

    import numpy as np

    from jaxpar.lab import stage_reads

    def plan_of(layout):
        return build(load_config([], [*GPT_SMALL, *layout, "pipeline.executor=mpmd"])).plan

    plans = [plan_of(["mesh.data=4", "mesh.stage=2"]), plan_of(["mesh.tensor=4", "mesh.stage=2"])]
    batch = {"tokens": np.zeros((8, 17), np.int32)}
    traced = []
    trace = stage_reads._trace_outside_stack
    monkeypatch.setattr(
        stage_reads, "_trace_outside_stack", lambda *a: traced.append(a) or trace(*a)
    )
    monkeypatch.setattr(stage_reads, "_READ", {})
    head = stage_reads.read_outside_stack(plans[0], 1, batch)
    assert stage_reads.read_outside_stack(plans[1], 1, batch) == head and len(traced) == 1
    assert 0 < len(head) < len(jax.tree.leaves(plans[0].model.params))

    class Unhashable:
        __hash__ = None

        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args):
            return self.fn(*args)

    split = plans[0].task.stages
    task = dataclasses.replace(
        plans[0].task, stages=dataclasses.replace(split, head=Unhashable(split.head))
    )
    odd = dataclasses.replace(plans[0], task=task)
    assert stage_reads.read_outside_stack(odd, 1, batch) == head
    assert stage_reads.read_outside_stack(odd, 1, batch) == head and len(traced) == 3
