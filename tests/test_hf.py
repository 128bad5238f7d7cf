"""Hugging Face interchange (jaxpar/hf/): ``jaxpar export --format hf`` writes GPT-2's
layout (tied or untied), ``model.init_from`` reads it on any layout, and an independent numpy
GPT-2 forward pass written from the HF tensors gives the logits jaxpar's model gives. The
Llama family's layout: tests/test_hf_llama.py."""

from __future__ import annotations

import errno
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.logical import activation_rules
from jaxpar.run import build
from tests.helpers import GPT_SMALL, grid, small_file_system

GPT2 = [
    *GPT_SMALL,
    "model.tie_embeddings=true",
    "model.positions=learned",
    "model.attn_bias=true",
    "train.eval_every=0",
]
FSDP8 = ["mesh.data=1", "mesh.fsdp=8"]
MIXED = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("jaxpar: warning")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- an independent GPT-2 forward pass, straight from the HF tensors ------------------------
def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gpt2_logits(tensors: dict, config: dict, tokens: np.ndarray) -> np.ndarray:
    """GPT2LMHeadModel's forward pass in float64 numpy: Conv1D is x @ W + b, the lm_head
    is wte's transpose."""
    t = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in tensors.items()}
    D, N = config["n_embd"], config["n_head"]
    H, (B, T) = D // N, tokens.shape
    x = t["wte.weight"][tokens] + t["wpe.weight"][:T]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(config["n_layer"]):
        p = lambda name, i=i: t[f"h.{i}.{name}"]
        h = layer_norm(x, p("ln_1.weight"), p("ln_1.bias"))
        qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = (a.reshape(B, T, N, H).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, -1))
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(H), -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        o = o.transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + o @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = layer_norm(x, p("ln_2.weight"), p("ln_2.bias"))
        u = gelu_new(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + u @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    head = t.get("lm_head.weight", t["wte.weight"])  # untied: its own
    return layer_norm(x, t["ln_f.weight"], t["ln_f.bias"]) @ head.T


def jaxpar_logits(run, params, tokens: np.ndarray) -> np.ndarray:
    """The run's model on ``tokens`` with ``params``, on the run's mesh and rules."""
    plan = run.plan

    @jax.jit
    def forward(params, tokens):
        with activation_rules(plan.mesh, plan.rules):
            return nnx.merge(plan.model.graphdef, params, {})(tokens)

    return np.asarray(forward(params, tokens))


def assert_logits_close(actual, expected):
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)


TOKENS = np.random.default_rng(0).integers(0, 256, (8, 16)).astype(np.int32)


# ---- a trained run, exported ------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A GPT with GPT-2's options trained 2 steps on mesh.fsdp=8, exported as HF files
    (from its run dir) and as .npz."""
    root = tmp_path_factory.mktemp("hf")
    run_dir = root / "run"
    assert main(["train", *GPT2, *FSDP8, f"run.dir={run_dir}", "train.steps=2"]) == 0
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(root / "hf")]) == 0
    assert main(["export", str(run_dir), "--out", str(root / "params.npz")]) == 0
    npz = np.load(root / "params.npz")
    return {"run": run_dir, "hf": root / "hf", "params": {k: npz[k] for k in npz.files}}


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = value
    return out


def test_export_writes_gpt2_layout_files(exported):
    """config.json and model.safetensors in GPT2LMHeadModel's layout; the numpy GPT-2 of
    those files gives the logits of the run's checkpoint."""
    hf = exported["hf"]
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert {
        k: config[k]
        for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner")
    } == {
        "vocab_size": 256,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 16,
        "n_ctx": 16,
        "n_inner": 64,
    }
    assert config["activation_function"] == "gelu_new"
    assert config["layer_norm_epsilon"] == 1e-5 and config["tie_word_embeddings"] is True
    with safe_open(hf / "model.safetensors", "numpy") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses a file without it
    tensors = load_file(hf / "model.safetensors")
    assert all(k.startswith("transformer.") for k in tensors)  # lm_head: tied, not stored
    shapes = {k.removeprefix("transformer."): v.shape for k, v in tensors.items()}
    assert shapes["wte.weight"] == (256, 32) and shapes["wpe.weight"] == (16, 32)
    assert shapes["h.1.attn.c_attn.weight"] == (32, 96) and shapes["h.1.attn.c_attn.bias"] == (96,)
    assert shapes["h.0.attn.c_proj.weight"] == (32, 32) and shapes["h.0.mlp.c_fc.weight"] == (
        32,
        64,
    )
    assert shapes["h.0.mlp.c_proj.weight"] == (64, 32) and shapes["ln_f.bias"] == (32,)
    assert len(tensors) == 4 + 2 * 12
    assert np.abs(tensors["transformer.h.0.attn.c_attn.bias"]).min() > 0  # trained biases
    run = build(load_config([], [*GPT2, *FSDP8]))
    expected = gpt2_logits(tensors, config, TOKENS)
    assert_logits_close(jaxpar_logits(run, nested(exported["params"]), TOKENS), expected)


# extended: an export read back onto another layout is the crossing of the export (its
# files give the run's logits: test_export_writes_gpt2_layout_files) and model.init_from
# onto data=2,fsdp=2,tensor=2 (test_init_from_hub_style_gpt2_matches_numpy_forward's logits
# from GPT-2 files there, test_the_default_untied_gpt_exports_with_its_own_lm_head's exact
# read-back of an export there: the same place_params and fresh optimizer state of
# Trainer.init); a step from there is the layout's ordinary step
@pytest.mark.exhaustive
def test_init_from_export_on_another_layout(exported, tmp_path, capsys):
    """model.init_from on data=2,fsdp=2,tensor=2: the checkpoint's parameters exactly, placed
    with the run's shardings, a fresh optimizer state, the same logits and step loss."""
    cfg = load_config([], [*GPT2, *MIXED, f"model.init_from={exported['hf']}"])
    run = build(cfg)
    counts = run.family.counts(run.config.model, run.data)
    assert counts.params == sum(x.size for x in jax.tree.leaves(run.plan.model.params))
    state = run.trainer.init()
    flat = {
        "/".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
    }
    assert flat.keys() == exported["params"].keys()
    for key, value in flat.items():
        np.testing.assert_array_equal(np.asarray(value), exported["params"][key], err_msg=key)
    shardings = jax.tree.leaves(run.plan.state_shardings.params)
    assert [x.sharding for x in jax.tree.leaves(state.params)] == shardings
    assert int(state.step) == 0
    assert all(
        not np.asarray(x).any() for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0
    )  # Adam's moments start at zero
    reference = build(load_config([], [*GPT2, *FSDP8]))
    expected = jaxpar_logits(reference, nested(exported["params"]), TOKENS)
    assert_logits_close(jaxpar_logits(run, state.params, TOKENS), expected)
    # one step from there: its loss is the numpy GPT-2's on the exported files
    tokens = run.data.batch(0, cfg.train.batch_size)["tokens"]
    hf = exported["hf"]
    logits = gpt2_logits(
        load_file(hf / "model.safetensors"),
        json.loads((hf / "config.json").read_text()),
        tokens[:, :-1],
    )
    logits = logits - logits.max(-1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.take_along_axis(log_p, tokens[:, 1:, None], -1).mean()
    _, metrics = run.trainer.step(state, run.trainer.shard_batch({"tokens": tokens}))
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


def random_gpt2(rng, V=256, D=32, L=2, N=4, T=16, F=128) -> dict[str, np.ndarray]:
    """A GPT-2 as the hub's gpt2 files hold it: no ``transformer.`` prefix, the attention
    mask buffers, lm_head stored equal to wte; every tensor random (biases and norms too)."""
    r = lambda *shape, s=0.2: (s * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    t = {
        "wte.weight": r(V, D, s=0.5),
        "wpe.weight": r(T, D, s=0.5),
        "ln_f.weight": 1 + r(D),
        "ln_f.bias": r(D),
    }
    for i in range(L):
        t |= {
            f"h.{i}.{k}": v
            for k, v in {
                "ln_1.weight": 1 + r(D),
                "ln_1.bias": r(D),
                "attn.c_attn.weight": r(D, 3 * D),
                "attn.c_attn.bias": r(3 * D),
                "attn.c_proj.weight": r(D, D),
                "attn.c_proj.bias": r(D),
                "ln_2.weight": 1 + r(D),
                "ln_2.bias": r(D),
                "mlp.c_fc.weight": r(D, F),
                "mlp.c_fc.bias": r(F),
                "mlp.c_proj.weight": r(F, D),
                "mlp.c_proj.bias": r(D),
                "attn.bias": np.tril(np.ones((1, 1, T, T), np.float32)),
                "attn.masked_bias": np.array(-1e4, np.float32),
            }.items()
        }
    t["lm_head.weight"] = t["wte.weight"].copy()
    return t


def test_init_from_hub_style_gpt2_matches_numpy_forward(tmp_path):
    """Files laid out as the hub's gpt2 (n_inner null: 4·n_embd): jaxpar's logits are the
    numpy GPT-2's, on fsdp=8 and on data=2,fsdp=2,tensor=2."""
    tensors = random_gpt2(np.random.default_rng(1))
    config = {
        "model_type": "gpt2",
        "vocab_size": 256,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 16,
        "n_ctx": 16,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = gpt2_logits(
        {
            k: v
            for k, v in tensors.items()
            if not k.endswith((".attn.bias", ".attn.masked_bias", "lm_head.weight"))
        },
        config,
        TOKENS,
    )
    for mesh in (FSDP8, MIXED):
        run = build(
            load_config([], [*GPT2, *mesh, "model.d_ff=128", f"model.init_from={tmp_path}"])
        )
        assert_logits_close(jaxpar_logits(run, run.trainer.init().params, TOKENS), expected)


def test_init_from_refuses_what_gpt_cannot_compute_and_keys_contradicting_the_folder(
    tmp_path, capsys
):
    config = {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "n_inner": None,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["inspect", f"model.init_from={tmp_path}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"jaxpar: error: model.init_from={tmp_path}: config.json "
        "activation_function=gelu: jaxpar's GPT computes the tanh GELU"
    )
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"layer_norm_epsilon": 1e-6, "activation_function": "gelu_new"})
    )
    assert main(["inspect", f"model.init_from={tmp_path}"]) == 2
    assert "layer_norm_epsilon=1e-06" in one_line(capsys.readouterr().err)
    # a valid folder decides every model key: the overrides that contradict it are named
    (tmp_path / "config.json").write_text(json.dumps(config | {"activation_function": "gelu_new"}))
    assert (
        main(["inspect", *GPT_SMALL, "model.positions=rotary", f"model.init_from={tmp_path}"]) == 2
    )
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"jaxpar: error: model.init_from={tmp_path} decides the model, but the config also sets "
    )
    for text in (
        "model.d_model=32 (its config.json gives 768)",
        "model.n_layers=2 (its config.json gives 12)",
        "model.n_heads=4 (its config.json gives 12)",
        "model.max_seq_len=16 (its config.json gives 1024)",
        "model.d_ff=64 (its config.json gives 3072)",
        "model.positions=rotary (its config.json gives learned)",
    ):
        assert text in line, text
    assert line.endswith(
        ": drop model.d_model model.n_layers model.n_heads "
        "model.max_seq_len model.d_ff model.positions"
    )
    # a directory without config.json, and weights that do not fit
    assert main(["inspect", *GPT2, f"model.init_from={tmp_path / 'nothing'}"]) == 2
    assert "no config.json there" in one_line(capsys.readouterr().err)
    from jaxpar import hf

    cfg = load_config([], GPT2).model
    tensors = hf.to_hf(hf.from_hf(random_gpt2(np.random.default_rng(2), F=64), cfg), cfg)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:8]
    tensors["transformer.extra"] = np.zeros(3, np.float32)
    with pytest.raises(
        ValueError,
        match="h.1.mlp.c_fc.bias missing; unexpected tensor extra; "
        r"wpe.weight has shape \(8, 32\), expected \(16, 32\)",
    ):
        hf.from_hf(tensors, cfg)


def test_export_refuses_what_gpt2_layout_cannot_hold(tmp_path, capsys):
    out = ["--format", "hf", "--out", str(tmp_path / "hf")]
    cases = [
        (
            [*GPT_SMALL, "model.tie_embeddings=true", "model.positions=rotary"],
            "model.positions=rotary (GPT-2 adds learned positions",
        ),
        (["model.name=convnet"], "this run is model.name=convnet: use --format npz"),
    ]
    for args, text in cases:
        assert main(["export", *args, f"run.dir={tmp_path / 'run'}", *out]) == 2
        line = one_line(capsys.readouterr().err)
        assert text in line, line
    assert not (tmp_path / "hf").exists()


def test_the_default_untied_gpt_exports_with_its_own_lm_head(tmp_path):
    """The default GPT (untied, no attention biases) trained 2 steps exports: config.json
    says tie_word_embeddings false, lm_head.weight is its head, and the numpy GPT-2 of the
    files gives the run's logits; init_from reads the directory back exactly."""
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    assert (
        main(["train", *GPT_SMALL, "train.eval_every=0", f"run.dir={run_dir}", "train.steps=2"])
        == 0
    )
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "params.npz")]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    tensors = load_file(out / "model.safetensors")
    npz = np.load(tmp_path / "params.npz")
    np.testing.assert_array_equal(tensors["lm_head.weight"], npz["head"].T)
    run = build(load_config([], GPT_SMALL))
    params = nested({k: npz[k] for k in npz.files})
    assert_logits_close(jaxpar_logits(run, params, TOKENS), gpt2_logits(tensors, config, TOKENS))
    back = (
        build(
            load_config([], [*GPT_SMALL, *MIXED, "model.attn_bias=true", f"model.init_from={out}"])
        )
        .trainer.init()
        .params
    )
    np.testing.assert_array_equal(np.asarray(back["head"]), npz["head"])
    np.testing.assert_array_equal(np.asarray(back["blocks"]["wq"]), npz["blocks/wq"])


def test_export_never_overwrites_unless_told_and_never_writes_into_the_run(
    exported, tmp_path, capsys
):
    """The run's own files, an existing .npz and a non-empty folder are refused in one line
    (exit 2) with every byte unchanged; --overwrite replaces the file, or the folder's model
    files (a stale shard index goes, an unrelated file stays)."""
    run = exported["run"]
    owned = {p: p.read_bytes() for p in (run / "metrics.jsonl", run / "config.yaml")}
    for target, extra in [
        (run / "metrics.jsonl", []),
        (run / "config.yaml", ["--overwrite"]),
        (run / "new.npz", []),
    ]:
        assert main(["export", str(run), "--out", str(target), *extra]) == 2
        assert "lies inside the run directory" in one_line(capsys.readouterr().err)
    assert not (run / "new.npz").exists()
    notes = tmp_path / "notes.npz"
    notes.write_bytes(b"my notes")
    assert main(["export", str(run), "--out", str(notes)]) == 2
    assert "exists; choose another path, or pass --overwrite" in one_line(capsys.readouterr().err)
    other = tmp_path / "other_model"
    other.mkdir()
    stale = {"config.json": b"{}", "model.safetensors.index.json": b"{}", "README.md": b"hi"}
    for name, data in stale.items():
        (other / name).write_bytes(data)
    assert main(["export", str(run), "--format", "hf", "--out", str(other)]) == 2
    assert "is not empty (it holds README.md, config.json" in one_line(capsys.readouterr().err)
    assert all((other / n).read_bytes() == d for n, d in stale.items())
    assert all(p.read_bytes() == data for p, data in owned.items())
    assert notes.read_bytes() == b"my notes"
    # told to: replaced
    assert main(["export", str(run), "--out", str(notes), "--overwrite"]) == 0
    replaced = np.load(notes)
    assert sorted(replaced.files) == sorted(exported["params"])
    for key, value in exported["params"].items():
        np.testing.assert_array_equal(replaced[key], value)
    assert main(["export", str(run), "--format", "hf", "--out", str(other), "--overwrite"]) == 0
    assert sorted(p.name for p in other.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert (other / "README.md").read_bytes() == b"hi"
    assert (other / "model.safetensors").read_bytes() == (
        exported["hf"] / "model.safetensors"
    ).read_bytes()


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB file system (tmpfs, as root), which a model's weights overflow."""
    with small_file_system(tmp_path / "small", "64k") as path:
        yield path


# the suite: safetensors' own error type and the .npz writer's OSError, each a disk full
# (simulated); extended: a real full tmpfs, whose error is safetensors' (the same handling in
# jaxpar/hf/files.py; a real full tmpfs in every suite:
# tests/test_writes.py::test_a_full_disk_while_plotting_is_exit_5_naming_the_image)
@pytest.mark.parametrize(
    "how",
    grid([pytest.param(h, id=h) for h in ("safetensors", "npz", "tmpfs")], {"safetensors", "npz"}),
)
def test_a_full_disk_while_exporting_is_exit_5_naming_the_file(
    exported, tmp_path, capsys, monkeypatch, request, how
):
    """A full disk while an export writes — safetensors' own error type wraps the OS's —
    is exit 5 and one line naming the file, not an internal error; the earlier model in
    the folder (--overwrite) keeps every byte, and no temporary file is left."""
    import safetensors

    out = request.getfixturevalue("small_disk") if how == "tmpfs" else tmp_path / "model"
    out.mkdir(exist_ok=True)
    earlier = {"config.json": b'{"model_type": "gpt2"}', "model.safetensors": b"old"}
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    if how == "safetensors":

        def full(*args, **kwargs):
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr("safetensors.numpy.save_file", full)
    if how == "npz":

        def full_npz(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("jaxpar.export.np.savez", full_npz)
    target = out / "params.npz" if how == "npz" else out / "model.safetensors"
    extra = [] if how == "npz" else ["--format", "hf", "--overwrite"]
    out_arg = target if how == "npz" else out
    assert main(["export", str(exported["run"]), "--out", str(out_arg), *extra]) == 5
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"jaxpar: disk full: writing '{target}' failed: No space left on device ("
    ), line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
