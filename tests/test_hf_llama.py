"""Hugging Face interchange of the Llama family (jaxpar/hf/llama.py): export writes
LlamaForCausalLM's layout, an independent numpy Llama forward pass written from those
tensors gives jaxpar's logits, ``model.init_from`` reads it back exactly on another layout
(also from shards), and files of another architecture or with a tensor missing are refused
in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar import hf
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.errors import DataError
from jaxpar.run import build
from tests.test_hf import TOKENS, assert_logits_close, jaxpar_logits, nested, one_line

LLAMA = [
    "model.name=llama",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=48",
    "model.n_layers=2",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.batch_size=16",
    "optim.warmup_steps=0",
    "train.eval_every=0",
    "model.rope_theta=500000",
]


# ---- an independent Llama forward pass, straight from the HF tensors -------------------------
def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def llama_logits(tensors: dict, config: dict, tokens: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's forward pass in float64 numpy: ``Linear`` is x @ W.T; rotary by
    ``rotate_half`` with base rope_theta; key/value heads repeated to the query heads
    (``repeat_kv``)."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    D, N = config["hidden_size"], config["num_attention_heads"]
    K, eps = config["num_key_value_heads"], config["rms_norm_eps"]
    H, (B, T) = D // N, tokens.shape
    inv = 1.0 / config["rope_parameters"]["rope_theta"] ** (np.arange(0, H, 2) / H)
    angles = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    x = t["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(config["num_hidden_layers"]):
        p = lambda name, i=i: t[f"model.layers.{i}.{name}"]
        h = rms_norm(x, p("input_layernorm.weight"), eps)
        q = (h @ p("self_attn.q_proj.weight").T).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        k = (h @ p("self_attn.k_proj.weight").T).reshape(B, T, K, H).transpose(0, 2, 1, 3)
        v = (h @ p("self_attn.v_proj.weight").T).reshape(B, T, K, H).transpose(0, 2, 1, 3)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(H), -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = ((s / s.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + o @ p("self_attn.o_proj.weight").T
        h = rms_norm(x, p("post_attention_layernorm.weight"), eps)
        gate = h @ p("mlp.gate_proj.weight").T
        u = gate / (1 + np.exp(-gate)) * (h @ p("mlp.up_proj.weight").T)
        x = x + u @ p("mlp.down_proj.weight").T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rms_norm(x, t["model.norm.weight"], eps) @ head.T


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Llama trained 2 steps on fsdp=8, exported as HF files and as .npz."""
    root = tmp_path_factory.mktemp("hf_llama")
    run_dir = root / "run"
    assert (
        main(["train", *LLAMA, "mesh.data=1", "mesh.fsdp=8", f"run.dir={run_dir}", "train.steps=2"])
        == 0
    )
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(root / "hf")]) == 0
    assert main(["export", str(run_dir), "--out", str(root / "params.npz")]) == 0
    npz = np.load(root / "params.npz")
    return {"hf": root / "hf", "params": {k: npz[k] for k in npz.files}}


def test_export_writes_llama_files_whose_numpy_forward_gives_jaxpar_logits(exported):
    out = exported["hf"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rope_parameters",
            "tie_word_embeddings",
        )
    } == {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
    }
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (32, 48)
    assert len(tensors) == 2 + 2 * 9 + 1
    run = build(load_config([], [*LLAMA, "mesh.data=1", "mesh.fsdp=8"]))
    assert_logits_close(
        jaxpar_logits(run, nested(exported["params"]), TOKENS),
        llama_logits(tensors, config, TOKENS),
    )


def test_init_from_reads_the_export_back_exactly_on_another_layout(exported):
    run = build(
        load_config(
            [],
            [
                *LLAMA,
                "mesh.data=2",
                "mesh.fsdp=2",
                "mesh.tensor=2",
                f"model.init_from={exported['hf']}",
            ],
        )
    )
    state = run.trainer.init()
    flat = {
        "/".join(str(k.key) for k in path): np.asarray(leaf)
        for path, leaf in __import__("jax").tree_util.tree_leaves_with_path(state.params)
    }
    assert flat.keys() == exported["params"].keys()
    for key, value in flat.items():
        np.testing.assert_array_equal(value, exported["params"][key], err_msg=key)


def test_sharded_files_and_a_tied_model_round_trip(tmp_path):
    """Weights above the shard size are written as shards with their index (as
    transformers' save_pretrained), and read back; a tied Llama stores no lm_head."""
    cfg = load_config([], [*LLAMA, "model.tie_embeddings=true"]).model
    run = build(load_config([], [*LLAMA, "model.tie_embeddings=true"]))
    params = __import__("jax").tree.map(np.asarray, run.trainer.init().params)
    hf.write(tmp_path, params, cfg, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert "lm_head.weight" not in index["weight_map"]
    back = hf.from_hf(hf.files.read_tensors(tmp_path), cfg)
    for a, b in zip(__import__("jax").tree.leaves(back), __import__("jax").tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    # a shard the index names but the folder lacks: named, with the fix (it was
    # safetensors' own file-not-found error)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(DataError, match=f"names {shards[1]}, which is not there; copy"):
        hf.files.read_tensors(tmp_path)


def test_another_architecture_or_a_missing_tensor_is_one_line(exported, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    assert main(["inspect", *LLAMA, f"model.init_from={gpt2}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert (
        f"model.name=llama but model.init_from={gpt2} holds a gpt2 model (gpt in "
        "jaxpar): drop model.name, the folder decides" in line
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((exported["hf"] / "config.json").read_text())
    tensors = load_file(exported["hf"] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert (
        main(
            [
                "train",
                *LLAMA,
                "train.steps=1",
                f"run.dir={tmp_path / 'r'}",
                f"model.init_from={broken}",
            ]
        )
        == 2
    )
    line = one_line(capsys.readouterr().err)
    assert (
        "the weights do not fit LlamaForCausalLM's layout for this model: "
        "model.layers.1.mlp.up_proj.weight missing" in line
    )
