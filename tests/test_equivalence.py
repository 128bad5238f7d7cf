"""Every layout trains the same model to the same numbers as one device."""

import jax
import numpy as np
import pytest

from tests.helpers import CONVNET_SMALL, GPT_SMALL, assert_params_close, run_steps

LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=4,tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "fsdp=4,tensor=2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
}
ADAMW = ["optim.name=adamw", "optim.lr=3e-3", "optim.weight_decay=0.1", "optim.warmup_steps=1"]
SGD = ["optim.name=sgd", "optim.lr=0.05", "optim.momentum=0.9", "optim.nesterov=true"]
# (overrides, compare every element?) — see helpers.assert_params_close for why
# Adam-family results are compared per tensor.
MODELS = {"gpt": ([*GPT_SMALL, *ADAMW], False), "convnet": ([*CONVNET_SMALL, *SGD], True)}
_reference = {}


def reference(model):
    if model not in _reference:
        _reference[model] = run_steps([*MODELS[model][0], "mesh.data=1"], devices=1)
    return _reference[model]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device(model, layout):
    ref_losses, ref_params, _ = reference(model)
    overrides, elementwise = MODELS[model]
    losses, params, run = run_steps([*overrides, *LAYOUTS[layout]])
    assert run.trainer.mesh.devices.size == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(run.init_params))]
    assert min(moved) > 1e-4, "every parameter should have been updated"
    assert_params_close(params, ref_params, elementwise)
