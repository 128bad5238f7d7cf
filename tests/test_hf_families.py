"""Folders written by current transformers — Llama 3.1 (llama3 rotary scaling), Qwen2,
Qwen3, Mistral (sliding window), Mixtral and Qwen3-MoE — against transformers itself:
``model.init_from=FOLDER`` alone (no other model key) gives transformers' logits on one
device and on ``fsdp=2, tensor=2``; an export is a folder transformers loads with the same
logits and jaxpar reads back bit for bit; bf16, sharded and tied folders; every key is read
or refused in one line.

Needs torch and transformers (``pip install -e ".[test,reference]"``, which CI's first
interpreter installs); skipped without them."""

from __future__ import annotations

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

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
VARIANTS = {
    "llama3": lambda: transformers.LlamaConfig(
        **SHAPE,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=5),
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        head_dim=16,
        norm_topk_prob=True,
    ),
}
TOKENS = np.random.default_rng(0).integers(0, 96, (4, 16)).astype(np.int32)
ONE = ["run.devices=1", "mesh.data=1"]
RUN = [
    "data.dataset=synthetic",
    "data.seq_len=16",
    "train.batch_size=8",
    "optim.warmup_steps=0",
    "train.eval_every=0",
]


def save_random(config, folder, dtype=torch.float32, **kwargs) -> np.ndarray:
    """A transformers model of ``config`` with every weight perturbed (norms and biases
    too), saved to ``folder``; returns its float64-free logits of TOKENS (float32)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(folder, **kwargs)
    return hf_logits(folder)


def hf_logits(folder) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each variant's folder and transformers' logits of TOKENS."""
    root = tmp_path_factory.mktemp("families")
    return {
        name: (root / name, save_random(make(), root / name)) for name, make in VARIANTS.items()
    }


def run_of(folder, *overrides):
    return build(load_config([], [*RUN, f"model.init_from={folder}", *overrides]))


def logits_of(run) -> np.ndarray:
    return jaxpar.logits(run, TOKENS)


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())


SHARDED = ["mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2"]
LOADED = grid(
    [
        pytest.param(
            name, sharded, id=f"{name}-" + ("data2-fsdp2-tensor2" if sharded else "one-device")
        )
        for name in VARIANTS
        for sharded in (False, True)
    ],
    # every suite: each folder on one device (its own keys), and Mixtral's placed on
    # data2-fsdp2-tensor2 (a folder's weights are converted on the host, then placed by the
    # same place_params whatever the family: Qwen3's and Mistral's there are extended)
    {*(f"{name}-one-device" for name in VARIANTS), "mixtral-data2-fsdp2-tensor2"},
)


@pytest.mark.parametrize(("name", "sharded"), LOADED)
def test_folder_alone_gives_transformers_logits(folders, name, sharded):
    folder, expected = folders[name]
    run = run_of(folder, *(SHARDED if sharded else ONE))
    assert run.config.model.name == "llama"
    close(logits_of(run), expected)


@pytest.mark.parametrize(
    "name", grid([pytest.param(n, id=n) for n in VARIANTS], {"llama3", "qwen2", "qwen3_moe"})
)
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


def test_bf16_sharded_tied_folder(tmp_path):
    config = VARIANTS["qwen3"]()
    config.tie_word_embeddings = True
    expected = save_random(config, tmp_path, dtype=torch.bfloat16, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    run = run_of(tmp_path, *ONE)
    assert run.config.model.tie_embeddings
    close(logits_of(run), expected)


@pytest.mark.parametrize(
    "name",
    grid(
        [pytest.param("mistral", id="mistral"), pytest.param("qwen3", id="qwen3")],
        # every suite: Mistral (its window over the cache: llama_attention.cached_mask).
        # Qwen3's norms and head size run in the projections decode shares with the forward
        # pass (llama_attention.qkv), which gives transformers' logits above; the Llama's
        # grouped-query cache: tests/test_llama.py::test_decode_with_cache_matches_forward[2]
        {"mistral"},
    ),
)
def test_kv_cache_decoding_equals_the_forward_pass(folders, name):
    from flax import nnx

    run = run_of(folders[name][0], *ONE)
    model = nnx.merge(run.plan.model.graphdef, run.trainer.init().params, {})
    np.testing.assert_allclose(
        decode_stepwise(model, TOKENS, 3), jax.jit(model)(TOKENS), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_sliding_window_across_context_devices_equals_one_device(folders, strategy):
    """Mistral's window (5) crosses the boundaries of 4 context shards of 4 tokens, in
    the balanced order."""
    folder, expected = folders["mistral"]
    run = run_of(folder, "mesh.context=4", "mesh.data=2", f"context.attention={strategy}")
    close(logits_of(run), expected)


def _rewrite(folder, tmp_path, **changes):
    import shutil

    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"some_new_switch": True}, "some_new_switch"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        (
            {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
            "layer_types mixes",
        ),
        ({"model_type": "gemma7"}, "model_type='gemma7'"),
    ],
    ids=["yarn", "unknown-key", "dropout", "mixed-windows", "unknown-type"],
)
def test_keys_that_change_the_numbers_are_refused_in_one_line(folders, tmp_path, changes, words):
    folder = _rewrite(folders["qwen2"][0], tmp_path, **changes)
    with pytest.raises(JaxparError) as err:
        run_of(folder)
    assert words in str(err.value) and "\n" not in str(err.value)
    # and what to do: drop a key without effect, or bring the model another way
    assert str(err.value).endswith((CANNOT_READ, "only if it has no effect", "to null"))


def test_a_key_without_effect_is_read_and_rope_theta_spelt_the_old_way(folders, tmp_path):
    folder, expected = folders["llama3"]
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    old = _rewrite(
        folder,
        tmp_path,
        rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    json_text = json.loads((old / "config.json").read_text())
    json_text.pop("rope_parameters")
    (old / "config.json").write_text(json.dumps(json_text))
    close(logits_of(run_of(old, *ONE)), expected)


def test_an_override_contradicting_the_folder_is_one_line(folders):
    with pytest.raises(JaxparError) as err:
        run_of(folders["llama3"][0], "model.rope_theta=10000")
    message = str(err.value)
    assert "model.rope_theta=10000" in message and "500000" in message
    assert "drop model.rope_theta" in message


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda t: t.pop("model.norm.weight"), "model.norm.weight missing"),
        (lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)}), "has shape (7,)"),
        (
            lambda t: t.update({"model.norm.weight": np.ones(32, np.int64)}),
            "model.norm.weight holds int64 values, not weights",
        ),
        (
            lambda t: t.update(
                {"model.norm.weight": np.where(np.arange(32) % 8, 1.0, np.nan).astype(np.float32)}
            ),
            "model.norm.weight holds 4 NaN or infinite",
        ),
    ],
    ids=["missing", "misshapen", "integer", "nan"],
)
def test_a_missing_misshapen_integer_or_nan_tensor_is_one_line(folders, tmp_path, edit, words):
    """Named before the first step: an integer tensor is no weight, a NaN no start."""
    from safetensors.numpy import load_file, save_file

    folder = _rewrite(folders["qwen3"][0], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(JaxparError) as err:
        run_of(folder, *ONE).trainer.init()
    assert words in str(err.value) and "\n" not in str(err.value)


LAYOUTS = {
    "stage2-spmd": [
        "mesh.stage=2",
        "mesh.data=4",
        "pipeline.microbatches=2",
        "pipeline.executor=spmd",
    ],
    "stage2-mpmd": [
        "mesh.stage=2",
        "mesh.data=4",
        "pipeline.microbatches=2",
        "pipeline.executor=mpmd",
    ],
    "data2-fsdp2-tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "context2-ring": ["mesh.data=4", "mesh.context=2", "context.attention=ring"],
}
TRAINED = grid(
    [pytest.param(name, layout, id=f"{name}-{layout}") for name in VARIANTS for layout in LAYOUTS],
    # heavy: the sub-mesh executor (a folder's weights placed on the stages' own sub-meshes
    # by one program: no suite case starts it from given weights), 12 s. The rest is
    # extended. Training on data2-fsdp2-tensor2 (Mixtral's was the suite's): a
    # folder's weights placed on it give transformers' logits above (Mixtral), and steps
    # there equal one device's from the Llama's and the MoE's initializers
    # (tests/test_llama.py, tests/test_moe.py's expert2-fsdp2-tensor2). The spmd pipeline
    # (Qwen2's was the suite's): its stage-split parameters are placed as any sharded
    # layout's (Mixtral's above), and a Llama stack trains there as one device in
    # tests/test_moe.py's spmd-zb_h1-expert4 (heavy). The context ring (Mistral's was the suite's):
    # the parameters are whole over context; a Llama stack under context in
    # tests/test_sequence_parallel.py's llama-fsdp=2,context=2,tensor=2 and
    # tests/test_ulysses.py's llama_kv2 case; grouped key/value heads and sliding windows
    # round a balanced ring, gradients included, in tests/test_pack_families.py's
    # gemma3-mesh.context=4,context.attention=ring; Mistral's window across the ring above
    # (test_sliding_window_across_context_devices_equals_one_device[ring])
    set(),
    heavy={"qwen3-stage2-mpmd"},
)


@pytest.mark.parametrize(("name", "layout"), TRAINED)
def test_variants_train_on_every_layout_as_on_one_device(folders, name, layout):
    """Two AdamW steps from the folder's weights: the losses and parameters on each
    layout (pipelines under both executors, FSDP with tensor parallelism, a context ring)
    equal one device's."""
    common = [*RUN, f"model.init_from={folders[name][0]}"]
    # a router's load-balancing loss is a mean over the microbatch it sees: a pipeline's
    # reference accumulates the same microbatches on one device
    moe = name in ("mixtral", "qwen3_moe")
    accumulate = ["train.grad_accum=2"] if "stage" in layout and moe else []
    expected, expected_params, _ = one_device_steps([*common, *accumulate], steps=2)
    losses, params, _ = run_steps([*common, *LAYOUTS[layout]], steps=2)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_params_close(params, expected_params, elementwise=False, rtol=1e-4)


def test_a_run_may_read_shorter_sequences_than_the_folder_not_longer(folders):
    """max_seq_len bounds a rotary model (the KV cache's length): lower is the run's
    choice; higher than the folder's max_position_embeddings (64) is one line."""
    folder, expected = folders["qwen3"]
    assert (
        load_config([], [f"model.init_from={folder}", "model.max_seq_len=32"]).model.max_seq_len
        == 32
    )
    # and builds (it was refused there, as a config.json that did not match): the same logits
    shorter = run_of(folder, "model.max_seq_len=32", *ONE)
    assert shorter.config.model.max_seq_len == 32
    close(logits_of(shorter), expected)
    with pytest.raises(JaxparError) as err:
        load_config([], [f"model.init_from={folder}", "model.max_seq_len=128"])
    assert "model.max_seq_len=128 (its config.json gives 64, the most it reads)" in str(err.value)
