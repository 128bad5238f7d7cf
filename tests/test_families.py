"""Model families: the ResNet (channel-split tensor parallelism, BatchNorm) and the BERT
encoder (dropout, masked LM, pipelines) equal one device under every layout; each family's
counts agree with the compiled program; a user's family defined in one file trains; no
model name is compared outside ``jaxpar/models/``."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.run import build
from tests.helpers import assert_params_close, grid
from tests.test_research import host

ROOT = Path(__file__).resolve().parents[1]
SGD = [
    "optim.name=sgd",
    "optim.lr=0.1",
    "optim.momentum=0.9",
    "optim.warmup_steps=0",
    "optim.weight_decay=0.0",
    "optim.clip_norm=0.0",
]
RESNET = [
    "model.name=resnet",
    "model.depth=10",
    "model.width=8",
    "model.stem=small",
    "model.num_classes=10",
    "data.image_size=8",
    "data.num_examples=128",
    "train.batch_size=16",
    *SGD,
]
BERT = [
    "model.name=bert",
    "model.d_model=16",
    "model.n_heads=2",
    "model.d_ff=32",
    "model.n_layers=4",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.batch_size=32",
    *SGD,
]
LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=4,tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


def train(overrides, devices=8, steps=3):
    run = build(load_config([], [*overrides, f"run.devices={devices}"]))
    state = run.trainer.init()
    losses = []
    for step in range(steps):
        batch = run.trainer.shard_batch(run.data.batch(step, run.config.train.batch_size))
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), host(state.params), host(state.model_state), run


_one = {}


def one_device(name, overrides):
    if name not in _one:
        _one[name] = train([*overrides, "mesh.data=1"], devices=1)
    return _one[name]


# ---- ResNet -----------------------------------------------------------------------------------
# the suite: data × fsdp × tensor (the channel-split convolutions and BatchNorm statistics with
# the batch split over data and fsdp); each axis alone in the extended tier
@pytest.mark.parametrize(
    "layout", grid([pytest.param(x, id=x) for x in LAYOUTS], {"data=2,fsdp=2,tensor=2"})
)
def test_resnet_layouts_match_one_device(layout):
    """Losses, every parameter and every BatchNorm statistic after 3 SGD steps."""
    ref = one_device("resnet", RESNET)
    losses, params, stats, run = train([*RESNET, *LAYOUTS[layout]])
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    assert_params_close(params, ref[1])
    assert_params_close(stats, ref[2])
    assert run.plan.model.state_kinds == ("BatchStat",)
    moved = [np.abs(s).max() for s in jax.tree.leaves(stats) if s.ndim]
    assert min(moved) > 0  # every BatchNorm's running statistics were updated


# Both in the extended tier (with their one-device reference, the costliest of this file):
# what they run is the sub-mesh executor's, checked in the suite by tests/test_submesh.py —
# a model given by its layers (modules and functions) cut by parameter bytes, BatchNorm
# statistics and dropout in their stage equal to one device accumulating, in 2 and 4 stages
# (test_batchnorm_and_dropout_live_in_their_stage), and activations constrained inside
# sub-mesh stages by the transformers' pipelines; ResNet.layers() is the ResNet's own
# forward, which every ResNet test above runs.
@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.stage=2", "mesh.data=4", "pipeline.schedule=1f1b"], id="stage=2"),
            pytest.param(["mesh.stage=4", "mesh.data=2", "pipeline.schedule=gpipe"], id="stage=4"),
        ],
        set(),
    ),
)
def test_resnet_pipelines_by_layer_from_its_config(layout):
    """ResNet's layers (stem, stages, pool, head) cut over 2 and 4 stages by its config
    alone: losses, parameters and BatchNorm statistics equal one device accumulating the
    same 4 microbatches (each normalized by its own statistics). 16 rows a microbatch: with
    4, the last stage's BatchNorm (1×1 pixels) normalizes 4 values and amplifies summation
    noise 10⁴-fold in any layout (data=4 with accumulation as much as the pipeline)."""
    rows = ["train.batch_size=64", "data.num_examples=256"]
    ref = one_device("resnet-accumulating", [*RESNET, *rows, "train.grad_accum=4"])
    losses, params, stats, run = train([*RESNET, *rows, *layout, "pipeline.microbatches=4"])
    assert type(run.plan.gradients).__name__ == "SubMeshPipeline"
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    assert_params_close(params, ref[1])
    assert_params_close(stats, ref[2])


def test_resnet_splits_convolutions_by_channel_and_matches_the_lab():
    """Under tensor=2 the paired convolutions of every block hold half their channels per
    device — conv1 its output channels, conv2 its input channels — and the step's
    collective bytes match the lab's prediction (10%)."""
    from jaxpar.lab import hardware, sweep

    run = build(load_config([], [*RESNET, *LAYOUTS["data=4,tensor=2"]]))
    sh = run.plan.state_shardings.params
    halves = 0
    for stage in run.plan.model.params["stages"].values():
        for block_key in ("first", "rest"):
            if block_key not in stage:
                continue
            block, specs = stage[block_key], None
            for conv, dim in (("conv1", -1), ("conv2", -2)):
                shape = block[conv]["kernel"].shape
                sharding = sh["stages"][
                    list(run.plan.model.params["stages"]).index(
                        next(k for k, v in run.plan.model.params["stages"].items() if v is stage)
                    )
                ]
                sharding = sharding[block_key][conv]["kernel"]
                shard = sharding.shard_shape(shape)
                assert shard[dim] == shape[dim] // 2, (conv, shape, shard)
                assert [a for i, a in enumerate(shard) if i != len(shape) + dim] == [
                    a for i, a in enumerate(shape) if i != len(shape) + dim
                ]
                halves += 1
            del specs
    assert halves >= 8
    row = sweep.measure(run.config, "data=4,tensor=2", hardware.get_profile("h100"))
    assert row.ok, row.error
    assert row.comm_ratio == pytest.approx(1.0, abs=0.10)


# ---- BERT -------------------------------------------------------------------------------------
#: BERT on one device accumulating 4 microbatches: the reference of every BERT layout
BERT_ONE_DEVICE = [*BERT, "train.grad_accum=4"]


def test_bert_dropout_is_on_and_evaluation_is_fixed():
    """Training draws new dropout and masks every step; evaluation masks the same
    positions every time and drops nothing. (On one device, the run of the layouts'
    reference, whose compiled init and step it reuses: the layouts' draws are
    test_bert_layouts_and_pipelines_match_one_device's.)"""
    run = one_device("bert", BERT_ONE_DEVICE)[3]
    trainer, state = run.trainer, run.trainer.init()
    batch = trainer.shard_batch(run.data.batch(0, 32))
    apply = jax.jit(trainer.apply, static_argnames="train")
    a, _, after = apply(state.params, state.model_state, batch, train=True)
    b, _, _ = apply(state.params, after, batch, train=True)
    assert float(a) != float(b)  # next count: other masks and dropout
    assert int(after["noise"]["dropout"]["count"]) == 1
    e1 = trainer.evaluate(state, batch)
    e2 = trainer.evaluate(trainer.step(state, batch)[0], batch)
    e3 = trainer.evaluate(trainer.init(), batch)
    assert float(e1["loss"]) == float(e3["loss"]) != float(e2["loss"])
    assert set(e1) == {"loss", "masked_accuracy"}


# The transformer blocks are the GPT's (tests/test_equivalence.py runs them under every
# layout: three in the suite, the others extended); here: the encoder's own parts —
# dropout, masking, token types — under data and all three axes, and each pipeline schedule.
BERT_LAYOUTS = {
    "data=8": LAYOUTS["data=8"],
    "data=2,fsdp=2,tensor=2": LAYOUTS["data=2,fsdp=2,tensor=2"],
    "gpipe": ["mesh.data=4", "mesh.stage=2", "pipeline.schedule=gpipe"],
    "1f1b": ["mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "pipeline.schedule=1f1b"],
    "interleaved": [
        "mesh.data=2",
        "mesh.stage=2",
        "mesh.fsdp=2",
        "pipeline.schedule=interleaved",
        "pipeline.virtual_stages=2",
    ],
    "zb_h1": ["mesh.stage=4", "mesh.data=2", "pipeline.schedule=zb_h1"],
}


@pytest.mark.parametrize(
    "layout",
    grid([pytest.param(x, id=x) for x in BERT_LAYOUTS], {"data=2,fsdp=2,tensor=2"}),
)
def test_bert_layouts_and_pipelines_match_one_device(layout):
    """Dropout on: every layout and every pipeline schedule (4 microbatches) equals one
    device running the same 4 microbatches — losses, parameters, RNG count."""
    micro = (
        ["pipeline.microbatches=4"]
        if "mesh.stage" in str(BERT_LAYOUTS[layout])
        else ["train.grad_accum=4"]
    )
    ref = one_device("bert", BERT_ONE_DEVICE)
    losses, params, state, run = train([*BERT, *BERT_LAYOUTS[layout], *micro])
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    assert_params_close(params, ref[1])
    assert int(state["noise"]["dropout"]["count"]) == 12 == int(ref[2]["noise"]["dropout"]["count"])


# ---- every family -----------------------------------------------------------------------------
FAMILY_RUNS = {
    "gpt": [
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.d_ff=64",
        "model.max_seq_len=16",
        "data.seq_len=16",
        "train.batch_size=16",
    ],
    "bert": BERT,
    "resnet": [*RESNET, "data.image_size=32"],  # XLA skips the padding taps of 2×2 and 1×1 stages
    "convnet": [
        "model.name=convnet",
        "model.channels=4",
        "model.hidden=8",
        "data.image_size=8",
        "train.batch_size=16",
    ],
    "mlp": ["model.name=mlp", "model.hidden=8", "data.image_size=8", "train.batch_size=16"],
}


@pytest.mark.parametrize("name", list(FAMILY_RUNS))
def test_family_counts_match_the_compiled_program(name):
    """A family's parameter count equals the model's; its FLOPs per example times the
    examples a device computes equal the compiled step's matmul/convolution FLOPs (2%)."""
    from jaxpar import hlo
    from jaxpar.plan import global_batch_shapes

    run = build(load_config([], [*FAMILY_RUNS[name], "mesh.data=8"]))
    counts = run.family.counts(run.config.model, run.data)
    assert counts.params == sum(x.size for x in jax.tree.leaves(run.plan.model.params))
    batch = global_batch_shapes(run.data.batch(0, run.config.train.batch_size), 1)
    flops = hlo.program_cost(run.trainer.compile_step(batch).as_text()).flops
    per_device = run.config.train.batch_size // 8
    assert flops == pytest.approx(counts.train_flops_per_example * per_device, rel=0.02)


USER_FAMILY = '''
"""A user's model family in one file: its config, its model, its task; nothing else changes."""
import math

import optax
from flax import nnx
from pydantic import Field

import jaxpar
from jaxpar.models import DataNeeds, Family, ModelConfig, section


@section("model")
class WideConfig(ModelConfig):
    hidden: int = Field(64, ge=8, description="hidden units")
    num_classes: int = Field(10, ge=2, description="classes")


class Wide(nnx.Module):
    def __init__(self, cfg, features, rngs):
        named = lambda *n: nnx.with_partitioning(nnx.initializers.lecun_normal(), n)
        self.a = nnx.Linear(features, cfg.hidden, kernel_init=named("embed", "mlp"),
                            use_bias=False, rngs=rngs)
        self.b = nnx.Linear(cfg.hidden, cfg.num_classes, kernel_init=named("mlp", "classes"),
                            use_bias=False, rngs=rngs)

    def __call__(self, images):
        return self.b(nnx.relu(self.a(images.reshape(len(images), -1))))


def loss(model, batch):
    logits = model(batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean(), {}


FAMILY = Family(
    "wide", WideConfig,
    task=lambda cfg, data: jaxpar.Task(
        lambda rngs: Wide(cfg, math.prod(data.image_shape), rngs), loss,
        {"images": ("batch", None, None, None), "labels": ("batch",)}, name="wide"),
    needs=lambda cfg: DataNeeds("images", num_classes=cfg.num_classes))
'''


def test_a_users_family_in_one_file_trains_through_jaxpar_train(tmp_path, capsys):
    from jaxpar.cli import main

    path = tmp_path / "wide.py"
    path.write_text(USER_FAMILY)
    run_dir = tmp_path / "run"
    common = [
        f"model.name={path}:FAMILY",
        "model.hidden=32",
        "data.image_size=8",
        "train.batch_size=16",
        "train.steps=60",
        "train.log_every=10",
        "train.eval_every=60",
        "train.progress=false",
        "optim.warmup_steps=0",
    ]
    assert (
        main(
            ["train", *common, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"run.dir={run_dir}"]
        )
        == 0
    )
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows[-1]["loss"] < 0.6 * train_rows[0]["loss"], train_rows
    assert main(["inspect", *common, "mesh.fsdp=8", "mesh.data=1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"a/kernel\s+64×32\s+\(embed, mlp\)\s+P\(fsdp, None\)", out), out
    assert main(["train", *common, "model.hiden=3", f"run.dir={tmp_path / 'x'}"]) == 2
    assert (
        "unknown config key 'model.hiden' for model.name=wide: did you mean "
        "'model.hidden'? its keys: hidden, num_classes" in capsys.readouterr().err
    )


def test_no_model_name_is_compared_outside_its_file():
    """`grep -rn '"gpt"' jaxpar/` (and the other families) shows only jaxpar/models/."""
    found = []
    for path in (ROOT / "jaxpar").rglob("*.py"):
        if path.parent.name == "models":
            continue
        for name in ("gpt", "bert", "resnet", "convnet"):
            if f'"{name}"' in path.read_text() or f"'{name}'" in path.read_text():
                found.append(f"{path.relative_to(ROOT)}: {name}")
    assert found == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,per_param",
    grid(
        [
            pytest.param("resnet152", 2, id="resnet152"),
            pytest.param("bert_large", 3, id="bert_large"),
        ],
        {"bert_large"},
    ),
)
def test_plan_memory_of_the_seeds_models(config, per_param):
    """`jaxpar plan configs/{resnet152,bert_large}.yaml --devices 2` (compile only): under
    data=2 each device's compiled arguments are what the family's parameter count says —
    parameters and optimizer state (SGD momentum: 2 copies; AdamW: 3), float32, plus the
    BatchNorm statistics and the device's half of the batch — within 1%; the plan's
    memory is the compiled program's."""
    from jaxpar.lab import hardware
    from jaxpar.lab.planner import plan
    from jaxpar.sharding import total_bytes

    cfg = load_config([ROOT / "configs" / f"{config}.yaml"], ["run.devices=2"])
    [row] = [p.row for p in plan(cfg, 2, hardware.get_profile("h100"), layouts=["data=2"])]
    assert row.ok, row.error
    run = build(
        load_config([ROOT / "configs" / f"{config}.yaml"], ["run.devices=2", "mesh.data=2"])
    )
    counts = run.family.counts(run.config.model, run.data)
    batch = run.data.batch(0, run.config.train.batch_size)
    expected = (
        4 * per_param * counts.params
        + total_bytes(run.plan.model.state)
        + sum(v.nbytes for v in batch.values()) // 2
    )
    assert row.mem_args_bytes == pytest.approx(expected, rel=0.01)
    assert row.mem_total_bytes >= row.mem_args_bytes + row.mem_temp_bytes
