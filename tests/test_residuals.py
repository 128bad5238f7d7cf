"""The activations of a model the lab has no count for (a ResNet, a user's task): the
residuals JAX keeps for the backward and FSDP's gathered weights
(:mod:`jaxpar.lab.residuals`), against the temporaries of the step compiled for the same
layout on the 8 devices here."""

import dataclasses
import warnings

import pytest

import jaxpar
from jaxpar.lab import analytic, hardware
from jaxpar.lab.measure import measure
from jaxpar.lab.plan_text import format_plan
from jaxpar.lab.planner import plan
from jaxpar.user_code import load_task

H100 = hardware.get_profile("h100")
EXHAUSTIVE = pytest.mark.exhaustive
DIGITS = "configs/resnet_digits.yaml"
WIDE = ["train.batch_size=512", "model.width=32"]  # activations above the weights
RESNET50 = ["data.image_size=64", "train.batch_size=128", "data.num_examples=256"]
CNN = "examples/research_cnn.py:TASK"


def _pair(spec: str, layout: str, overrides: list[str]):
    """The estimated and the compiled row of ``layout``."""
    task = None
    if spec.endswith(":TASK"):
        config = jaxpar.load_config([], overrides)
        task = load_task(spec, config)
    else:
        config = jaxpar.load_config([spec], overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimated = analytic.estimate(config, layout, H100, 8, task=task, cpu=True)
        return estimated, measure(config, layout, H100, task=task)


@pytest.mark.parametrize(
    "spec,layout,overrides,bounds",
    [
        (DIGITS, "data=8", WIDE, (0.95, 1.0)),
        (DIGITS, "fsdp=8", WIDE, (0.9, 0.95)),  # every conv's gathered weights held
        (CNN, "data=8", ["train.batch_size=256"], (0.8, 0.9)),
        # a ResNet-10 whose activations are a fraction of its weights: RESIDUALS_LOW
        pytest.param(DIGITS, "data=8", [], (0.71, 0.75), marks=EXHAUSTIVE),
        pytest.param(DIGITS, "data=8,train.grad_accum=2", WIDE, (1.0, 1.05), marks=EXHAUSTIVE),
        pytest.param(CNN, "fsdp=8", ["train.batch_size=1024"], (0.9, 0.95), marks=EXHAUSTIVE),
        pytest.param("configs/resnet50.yaml", "data=8", RESNET50, (0.93, 0.97), marks=EXHAUSTIVE),
        # stacked blocks: one layer of each stack gathered at a time
        pytest.param("configs/resnet50.yaml", "fsdp=8", RESNET50, (1.0, 1.1), marks=EXHAUSTIVE),
    ],
)
def test_a_model_without_a_count_is_estimated_by_the_residuals_jax_keeps(
    spec, layout, overrides, bounds
):
    """Estimated over compiled temporaries within the bounds stated (docs/lab.md), never
    below the margin an estimated row is judged with (analytic.RESIDUALS_LOW)."""
    estimated, compiled = _pair(spec, layout, overrides)
    assert estimated.ok and compiled.ok, (estimated.error, compiled.error)
    ratio = estimated.mem_temp_bytes / compiled.mem_temp_bytes
    assert bounds[0] <= ratio <= bounds[1], ratio
    assert ratio >= analytic.RESIDUALS_LOW


def test_activations_split_by_channel_are_counted_whole():
    """Under tensor parallelism a device holds its channels of a block's activations; the
    residuals, traced on one device, hold them whole: an upper bound (the layout is judged
    to need more than it does, never less), at most ``tensor`` times the compiled."""
    estimated, compiled = _pair(DIGITS, "data=4,tensor=2", WIDE)
    assert 1.0 < estimated.mem_temp_bytes / compiled.mem_temp_bytes < 2


def test_a_pipelined_layout_of_a_model_without_a_count_fits_only_as_yes_question():
    """A pipeline's stages hold microbatches in flight, which the residuals of one do not
    say: a pipelined row of a user's stacked model whose state alone fits would be "yes",
    as if it fit. It is "yes?", and the plan says why; its layout without a pipeline is
    estimated, and the plan says its activations' collectives are not."""
    from tests import test_user_gpu_layouts as user

    task = dataclasses.replace(
        user.TASK,
        model_fn=lambda rngs: user.StackedLM(rngs, True),
        loss_fn=user._stacked_loss,
        stages=jaxpar.StageSplit("blocks", user._embed, user._stage, user._head),
    )
    config = jaxpar.load_config([], user.BASE)
    piped = "stage=2,data=4,pipeline.executor=spmd,pipeline.microbatches=2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranking = plan(config, 8, H100, analytic=True, layouts=[piped, "data=8"], task=task)
    rows = {p.row.layout: p.row for p in ranking}
    assert rows[piped].ok and rows[piped].fits and rows[piped].mem_temp_bytes is None
    assert analytic.may_not_fit(rows[piped]) and rows["data=8"].mem_temp_bytes > 0
    text = format_plan(ranking, H100, H100.memory_bytes)
    assert "estimated without an activation estimate for this model's pipelined" in text
    assert "its activations' collectives (tensor, context) are not estimated" in text
