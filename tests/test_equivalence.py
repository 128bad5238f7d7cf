"""Every layout trains the same model to the same numbers as one device."""

import functools

import jax
import numpy as np
import pytest

from tests.helpers import CONVNET_SMALL, GPT_SMALL, assert_params_close, grid, run_steps

LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=4,tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "fsdp=4,tensor=2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
}
SGD = [
    "optim.name=sgd",
    "optim.lr=0.2",
    "optim.momentum=0.9",
    "optim.nesterov=true",
    "optim.weight_decay=1e-4",
]
# SGD's update is linear in the gradient, so layouts agree element by element; Adam is
# covered below (see helpers.assert_params_close for why it is compared per tensor).
MODELS = {"gpt": [*GPT_SMALL, *SGD], "convnet": [*CONVNET_SMALL, *SGD]}
_reference = {}


def reference(model):
    if model not in _reference:
        _reference[model] = run_steps([*MODELS[model], "mesh.data=1"], devices=1)
    return _reference[model]


# The suite: the GPT under the README's layouts but data=8 — fsdp=8, data=4,tensor=2 and all
# three axes (data=2,fsdp=2,tensor=2). Extended tier: fsdp=4,tensor=2 (fsdp beside tensor:
# the three-axis case); data=8 (the bucketed per-data-shard step, `auto` on the CPU), which
# equals one device in every suite in tests/test_buckets.py's
# test_bucketed_data_parallelism_equals_one_device_and_the_per_array_step[plain]; and the
# convnet (annotations only, no collective of its own: the three-axis case's step; an image
# batch under all three axes: tests/test_families.py's
# test_resnet_layouts_match_one_device[data=2,fsdp=2,tensor=2]).
@pytest.mark.parametrize(
    "model,layout",
    grid(
        [pytest.param(m, x, id=f"{x}-{m}") for m in MODELS for x in LAYOUTS],
        {"fsdp=8-gpt", "data=4,tensor=2-gpt", "data=2,fsdp=2,tensor=2-gpt"},
    ),
)
def test_layout_matches_single_device(model, layout):
    ref_losses, ref_params, _ = reference(model)
    losses, params, run = run_steps([*MODELS[model], *LAYOUTS[layout]])
    assert run.plan.mesh.devices.size == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    moved = [
        np.abs(a - b).max()
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(run.init_params))
    ]
    assert min(moved) > 1e-6, "every parameter should have been updated"
    assert_params_close(params, ref_params)


def _first_gradients(overrides, devices):
    from jaxpar.config import load_config
    from jaxpar.run import build

    run = build(load_config([], [*overrides, f"run.devices={devices}"]))
    state = run.trainer.init()
    batch = run.trainer.shard_batch(run.data.batch(0, 16))
    grad = jax.jit(jax.grad(lambda p, b: run.trainer.loss(p, b)[0]))(state.params, batch)
    return jax.tree.map(np.asarray, grad)


@functools.cache
def _one_device_gradients():
    return _first_gradients([*GPT_SMALL, "mesh.data=1"], 1)


# the suite: all three axes; fsdp=8 alone in the extended tier (its parameters after 3 SGD
# steps agree element by element above, test_layout_matches_single_device[fsdp=8-gpt])
@pytest.mark.parametrize(
    "layout",
    grid(
        [pytest.param(x, id=x) for x in ("fsdp=8", "data=2,fsdp=2,tensor=2")],
        {"data=2,fsdp=2,tensor=2"},
    ),
)
def test_gpt_gradients_match_single_device_elementwise(layout):
    """Gradients of every layout agree element by element (to 1e-5 of each tensor's scale)."""
    ref = _one_device_gradients()
    grads = _first_gradients([*GPT_SMALL, *LAYOUTS[layout]], 8)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(
            g,
            r,
            rtol=1e-5,
            atol=1e-5 * np.abs(r).max(),
            err_msg=f"{layout} {jax.tree_util.keystr(path)}",
        )


# extended: AdamW's update is elementwise and its moments take their parameter's sharding
# as SGD's momentum does (test_layout_matches_single_device[data=2,fsdp=2,tensor=2-gpt]);
# AdamW steps equal one device at these tolerances in every suite on this layout in
# tests/test_fp8.py's test_delayed_scaling_layouts_match_one_device[data=2,fsdp=2,tensor=2]
# and on data=8 in tests/test_buckets.py's
# test_bucketed_data_parallelism_equals_one_device_and_the_per_array_step[plain]
@pytest.mark.parametrize(
    "layout",
    grid(
        [pytest.param(x, id=x) for x in ("fsdp=8", "data=2,fsdp=2,tensor=2")],
        set(),
    ),
)
def test_gpt_adamw_matches_single_device(layout):
    """AdamW: the loss trajectory agrees to rtol 1e-5. Parameters are compared per tensor
    at 1e-4: Adam divides each gradient element by its own running magnitude, which for
    elements whose gradient is ~0 magnifies the 1e-7 summation-order differences of the
    gradients (checked element-wise above) into larger update differences."""
    adamw = ["optim.name=adamw", "optim.lr=3e-3", "optim.weight_decay=0.1"]
    ref_losses, ref_params, _ = run_steps([*GPT_SMALL, *adamw, "mesh.data=1"], devices=1)
    losses, params, _ = run_steps([*GPT_SMALL, *adamw, *LAYOUTS[layout]])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params, ref_params, elementwise=False, rtol=1e-4)
