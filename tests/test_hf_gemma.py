"""Gemma 2 and Gemma 3 text folders written by current transformers, against transformers
itself: ``model.init_from=FOLDER`` alone gives transformers' logits on one device and on
``data=2, fsdp=2, tensor=2``; an export is a folder transformers loads with the same
logits and jaxpar reads back bit for bit; KV-cache decoding equals the forward pass; two
AdamW steps on 8 devices (context parallelism included) equal one device's; a key that
would change the numbers is refused in one line.

The tiny models make every Gemma switch matter: Gemma 2 caps its attention logits at 2
and its output logits at 5 (transformers' defaults, 50 and 30, barely touch a random tiny
model's logits); Gemma 3 has 5 layers in a pattern of 3 (two windowed, one full, then two
windowed: the pattern does not divide the layers), a linear-scaled base of 1e6 on the full
layer and 1e4 on the windowed ones, head_dim 16 ≠ d_model / n_heads and a
query_pre_attn_scalar of 24; windows of 5 on sequences of 16.

Needs torch and transformers (``pip install -e ".[test,reference]"``); skipped without."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar import hf
from jaxpar.config import load_config
from jaxpar.errors import JaxparError
from jaxpar.hf.layout import CANNOT_READ
from jaxpar.run import build
from tests.helpers import (
    assert_params_close,
    decode_stepwise,
    grid,
    one_device_steps,
    run_steps,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# transformers' logits of the same TOKENS [4, 16] of ids < 96, a folder with every weight
# perturbed, the tolerance, a folder with config.json changed: the Llama family's helpers
from tests.test_hf_families import TOKENS, _rewrite, close, hf_logits, save_random  # noqa: E402

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    sliding_window=5,
    query_pre_attn_scalar=24,
)
VARIANTS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE, num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=5.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE,
        num_hidden_layers=5,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
}
ONE = ("run.devices=1", "mesh.data=1")
EIGHT = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
RUN = [
    "data.dataset=synthetic",
    "data.seq_len=16",
    "train.batch_size=8",
    "optim.warmup_steps=0",
    "train.eval_every=0",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each variant's folder and transformers' logits of TOKENS."""
    root = tmp_path_factory.mktemp("gemma")
    return {
        name: (root / name, save_random(make(), root / name)) for name, make in VARIANTS.items()
    }


@functools.cache
def run_of(folder, *overrides):
    return build(load_config([], [*RUN, f"model.init_from={folder}", *overrides]))


@pytest.mark.parametrize("layout", [ONE, EIGHT], ids=["one-device", "data2-fsdp2-tensor2"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_folder_alone_gives_transformers_logits(folders, name, layout):
    folder, expected = folders[name]
    run = run_of(folder, *layout)
    assert run.config.model.name == "gemma"
    close(jaxpar.logits(run, TOKENS), expected)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_loads_in_transformers_and_reads_back_bit_for_bit(folders, name, tmp_path):
    folder, expected = folders[name]
    run = run_of(folder, *ONE)
    params = jax.tree.map(np.asarray, run.trainer.init().params)
    hf.write(tmp_path, params, run.config.model)
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((folder / "config.json").read_text())
    assert written["model_type"] == original["model_type"]
    assert hf.folder_settings(tmp_path) == hf.folder_settings(folder)
    close(hf_logits(tmp_path), expected)
    back = hf.from_hf(hf.files.read_tensors(tmp_path), run.config.model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


# Extended tier: decoding is the family's own code whatever set its numbers — the suite's
# check is tests/test_gemma.py::test_decode_with_cache_matches_forward (Gemma 2's caps and
# Gemma 3's norms and linear-scaled rotary, 5 layers in a pattern of 3, past the window).
@pytest.mark.parametrize("name", grid([pytest.param(n, id=n) for n in VARIANTS], set()))
def test_kv_cache_decoding_equals_the_forward_pass(folders, name):
    """A prompt of 3, then one token a call: past the window (5) on every layer kind."""
    from flax import nnx

    run = run_of(folders[name][0], *ONE)
    model = nnx.merge(run.plan.model.graphdef, run.trainer.init().params, {})
    np.testing.assert_allclose(
        decode_stepwise(model, TOKENS, 3), jax.jit(model)(TOKENS), rtol=1e-5, atol=1e-5
    )


# Extended tier, every case. Gemma 2 on data × fsdp × tensor: the folder's weights placed
# and computed on that layout give transformers' logits in every suite
# (test_folder_alone_gives_transformers_logits[gemma2-data2-fsdp2-tensor2]: the soft caps and
# windows with the layout's shardings), its gradients are autodiff's of that forward (Gemma
# 2's loss and every gradient under a layout equal one device's in
# tests/test_pack_families.py's gemma2 all_gather case at context=2), and AdamW steps on
# data × fsdp × tensor equal one device's in tests/test_llama.py's
# test_llama_layouts_equal_one_device[data2-fsdp2-tensor2] (the projections Gemma's layers
# call) and tests/test_fp8.py's delayed-scaling layout case. The context cases: the windows
# across context devices are checked in the suite by tests/test_pack_families.py (Gemma 3's
# balanced ring at context=4 and context=2 in stages, and, heavy, Gemma 2's soft-capped
# all_gather at context=2: a packed batch's loss and every gradient equal one device's),
# and Gemma 3's folder under data × fsdp × tensor gives transformers' logits above.
@pytest.mark.parametrize(
    ("name", "layout"),
    grid(
        [
            pytest.param("gemma2", EIGHT, id="gemma2-data2-fsdp2-tensor2"),
            pytest.param(
                "gemma2",
                ("mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2"),
                id="gemma2-context2-fsdp2-tensor2",
            ),
            pytest.param(
                "gemma3",
                ("mesh.context=2", "mesh.data=2", "mesh.tensor=2"),
                id="gemma3-context2-data2-tensor2",
            ),
        ],
        set(),
    ),
)
def test_two_adamw_steps_on_eight_devices_equal_one_device(folders, name, layout):
    """The folder's weights trained two steps: the losses and parameters equal one
    device's (soft-capped attention and windows across context devices included)."""
    common = [*RUN, f"model.init_from={folders[name][0]}"]
    expected, expected_params, _ = one_device_steps(common, steps=2)
    losses, params, _ = run_steps([*common, *layout], steps=2)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_params_close(params, expected_params, elementwise=False, rtol=1e-4)


@pytest.mark.parametrize(
    ("name", "changes", "words"),
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        (
            "gemma3",
            {
                "layer_types": [
                    "full_attention",
                    "sliding_attention",
                    "full_attention",
                    "sliding_attention",
                    "sliding_attention",
                ]
            },
            "one pattern",
        ),
        (
            "gemma3",
            {
                "rope_parameters": {
                    # yarn's own keys: the type is named, not one of its keys
                    "full_attention": {
                        "rope_type": "yarn",
                        "factor": 4.0,
                        "original_max_position_embeddings": 8192,
                    },
                    "sliding_attention": {"rope_theta": 1e4},
                }
            },
            "rotary setting rope_type=yarn",
        ),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ("gemma2", {"some_new_switch": True}, "some_new_switch"),
    ],
    ids=["gemma3-attn-softcap", "irregular-layers", "yarn", "activation", "unknown-key"],
)
def test_keys_that_change_the_numbers_are_refused_in_one_line(
    folders, tmp_path, name, changes, words
):
    folder = _rewrite(folders[name][0], tmp_path, **changes)
    with pytest.raises(JaxparError) as err:
        build(load_config([], [*RUN, f"model.init_from={folder}"]))
    assert words in str(err.value) and "\n" not in str(err.value)
    # and what to do: drop a key without effect, or bring the model another way
    assert str(err.value).endswith((CANNOT_READ, "only if it has no effect", "to null"))


def test_gemma3_spelt_the_older_way_and_an_override_contradicting_it(folders, tmp_path):
    """``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` read as
    ``rope_parameters``; ``model.rope_theta`` against the folder is one line."""
    folder = folders["gemma3"][0]
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"type": "linear", "factor": 8.0},
    }
    old = _rewrite(folder, tmp_path)
    (old / "config.json").write_text(json.dumps(config))
    assert rope["full_attention"]["factor"] == 8.0
    assert hf.folder_settings(old) == hf.folder_settings(folder)
    with pytest.raises(JaxparError) as err:
        build(load_config([], [*RUN, f"model.init_from={old}", "model.rope_theta=10000"]))
    assert "drop model.rope_theta" in str(err.value) and "\n" not in str(err.value)
