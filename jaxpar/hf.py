"""Hugging Face interchange for the GPT: GPT-2's layout (``GPT2LMHeadModel``) as files.

``jaxpar export RUN_DIR --format hf --out DIR`` writes ``DIR/config.json`` and
``DIR/model.safetensors`` (float32, ``{"format": "pt"}`` metadata) that ``transformers``
loads with ``GPT2LMHeadModel.from_pretrained(DIR)``; ``model.init_from=DIR`` starts a
fresh jaxpar run from such a directory (a local copy of GPT-2 small, say: nothing is
downloaded). The tensors are read with ``safetensors.numpy``; torch is never needed.

GPT-2's numerics are jaxpar's GPT with ``model.tie_embeddings=true``,
``model.positions=learned`` and ``model.attn_bias=true``: pre-norm blocks, LayerNorm
eps 1e-5, attention scaled by 1/sqrt(H), the tanh GELU (``gelu_new``, which is
``jax.nn.gelu``'s default), the output layer the token table's transpose.

Names and shapes (i: layer; L layers, D width, N heads, H = D/N, F MLP width,
V vocab, T positions; HF's ``Conv1D`` weights are stored input × output)::

  HF tensor (transformer.*)      shape    jaxpar parameter          shape
  wte.weight                     [V, D]   embed                     [V, D]
  wpe.weight                     [T, D]   pos                       [T, D]
  h.{i}.ln_1.weight / .bias      [D]      blocks/ln1_scale / ln1_bias [L, D]
  h.{i}.attn.c_attn.weight       [D, 3D]  blocks/wq, wk, wv         [L, D, N, H] each
                                          (columns q | k | v, each head-major n·H + h)
  h.{i}.attn.c_attn.bias         [3D]     blocks/bq, bk, bv         [L, N·H] each
  h.{i}.attn.c_proj.weight       [D, D]   blocks/wo                 [L, N, H, D]
  h.{i}.attn.c_proj.bias         [D]      blocks/bo                 [L, D]
  h.{i}.ln_2.weight / .bias      [D]      blocks/ln2_scale / ln2_bias [L, D]
  h.{i}.mlp.c_fc.weight / .bias  [D, F]   blocks/w_in / b_in        [L, D, F] / [L, F]
  h.{i}.mlp.c_proj.weight / .bias [F, D]  blocks/w_out / b_out      [L, F, D] / [L, D]
  ln_f.weight / .bias            [D]      ln_f_scale / ln_f_bias    [D]
  lm_head.weight (tied: not stored) [V, D] = wte.weight

config.json ↔ ``model.*``: ``vocab_size`` ↔ ``vocab_size``, ``n_embd`` ↔ ``d_model``,
``n_layer`` ↔ ``n_layers``, ``n_head`` ↔ ``n_heads``, ``n_positions`` (= ``n_ctx``) ↔
``max_seq_len``, ``n_inner`` (null: 4·n_embd) ↔ ``d_ff``; ``tie_word_embeddings`` true ↔
``tie_embeddings=true``.

Reading accepts the keys with or without the ``transformer.`` prefix (the hub's
``gpt2`` files have none), ignores the attention-mask buffers older files hold
(``h.{i}.attn.bias``, ``h.{i}.attn.masked_bias``) and a stored ``lm_head.weight`` equal
to ``wte.weight``, and reads a sharded ``model.safetensors.index.json`` too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import ConfigError, DataError
from jaxpar.models.gpt import GPTConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: HF's names for the tanh GELU (``jax.nn.gelu(approximate=True)``)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_PREFIX = "transformer."
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in older files


# ---- what GPT-2's layout can hold ------------------------------------------------------------
def check_exportable(family: str, cfg: Any) -> None:
    """Raises a one-line ValueError when a run's model cannot be written in GPT-2's layout.

    Args:
      family: the run's ``model.name`` (``""`` for a user's task).
      cfg: its typed model config.
    """
    if not isinstance(cfg, GPTConfig):
        what = f"model.name={family}" if family else "a user's task (--task)"
        raise ConfigError(f"--format hf writes GPT-2's layout (GPT2LMHeadModel, a decoder-only "
                          f"transformer LM, jaxpar's model.name=gpt); this run is {what}: use "
                          "--format npz")
    why = []
    if not cfg.tie_embeddings:
        why.append("model.tie_embeddings=false (GPT-2's output layer is the token table "
                   "wte itself; it has no lm_head of its own)")
    if cfg.positions != "learned":
        why.append(f"model.positions={cfg.positions} (GPT-2 adds learned positions, wpe; it "
                   "has no rotary embedding)")
    if why:
        raise ConfigError("--format hf: GPT-2's layout cannot hold this model: "
                          + "; ".join(why) + "; use --format npz")


def hf_config(cfg: Any) -> dict[str, Any]:
    """``config.json`` of a jaxpar GPT config (see :func:`check_exportable`)."""
    gpt2_tokens = cfg.vocab_size == 50257  # GPT-2's BPE: <|endoftext|> is 50256
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        # jaxpar trains without dropout: the file describes the model as trained
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": 50256 if gpt2_tokens else None,
        "eos_token_id": 50256 if gpt2_tokens else None,
        "use_cache": True,
    }


# ---- the mapping -----------------------------------------------------------------------------
def to_hf(params: dict[str, Any], cfg: Any) -> dict[str, np.ndarray]:
    """jaxpar GPT parameters (a pure dict of arrays) → HF tensors by name (float32).

    A model without ``attn_bias`` gets zero attention biases (the same function).
    """
    L, D = cfg.n_layers, cfg.d_model
    b = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    zeros = np.zeros((L, D), np.float32)
    out = {"wte.weight": params["embed"], "wpe.weight": params["pos"],
           "ln_f.weight": params["ln_f_scale"], "ln_f.bias": params["ln_f_bias"]}
    for i in range(L):
        h = f"h.{i}."
        out |= {
            h + "ln_1.weight": b["ln1_scale"][i], h + "ln_1.bias": b["ln1_bias"][i],
            h + "attn.c_attn.weight": np.concatenate(
                [b[w][i].reshape(D, D) for w in ("wq", "wk", "wv")], axis=1),
            h + "attn.c_attn.bias": np.concatenate(
                [b.get(k, zeros)[i] for k in ("bq", "bk", "bv")]),
            h + "attn.c_proj.weight": b["wo"][i].reshape(D, D),
            h + "attn.c_proj.bias": b.get("bo", zeros)[i],
            h + "ln_2.weight": b["ln2_scale"][i], h + "ln_2.bias": b["ln2_bias"][i],
            h + "mlp.c_fc.weight": b["w_in"][i], h + "mlp.c_fc.bias": b["b_in"][i],
            h + "mlp.c_proj.weight": b["w_out"][i], h + "mlp.c_proj.bias": b["b_out"][i],
        }
    return {_PREFIX + k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf(tensors: dict[str, np.ndarray], cfg: Any, where: str = "") -> dict[str, Any]:
    """HF GPT-2 tensors by name → jaxpar GPT parameters (a pure dict of float32 arrays).

    Raises:
      DataError: naming the missing, unexpected and misshapen tensors, or an untied
        ``lm_head.weight``.
    """
    L, D, N, H, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    t = {k.removeprefix(_PREFIX): v for k, v in tensors.items()}
    head = t.pop("lm_head.weight", None)
    for k in [k for k in t if k.startswith("h.") and k.endswith(_BUFFERS)]:
        del t[k]
    shapes = {"wte.weight": (cfg.vocab_size, D), "wpe.weight": (cfg.max_seq_len, D),
              "ln_f.weight": (D,), "ln_f.bias": (D,)}
    for i in range(L):
        shapes |= {f"h.{i}.{k}": s for k, s in (
            ("ln_1.weight", (D,)), ("ln_1.bias", (D,)), ("attn.c_attn.weight", (D, 3 * D)),
            ("attn.c_attn.bias", (3 * D,)), ("attn.c_proj.weight", (D, D)),
            ("attn.c_proj.bias", (D,)), ("ln_2.weight", (D,)), ("ln_2.bias", (D,)),
            ("mlp.c_fc.weight", (D, F)), ("mlp.c_fc.bias", (F,)),
            ("mlp.c_proj.weight", (F, D)), ("mlp.c_proj.bias", (D,)))}
    problems = [f"{k} missing" for k in shapes if k not in t]
    problems += [f"unexpected tensor {k}" for k in t if k not in shapes]
    problems += [f"{k} has shape {tuple(t[k].shape)}, expected {s}" for k, s in shapes.items()
                 if k in t and tuple(t[k].shape) != s]
    if head is not None and (head.shape != t.get("wte.weight", head).shape
                             or not np.array_equal(head, t["wte.weight"])):
        problems.append("lm_head.weight differs from wte.weight (an untied output layer; "
                        "GPT-2's is tied, as jaxpar's model.tie_embeddings=true)")
    if problems:
        raise DataError(f"model.init_from={where}: the weights do not fit GPT-2's layout for "
                        "this model: " + "; ".join(problems))
    t = {k: np.asarray(v, np.float32) for k, v in t.items()}

    def stack(name: str, fn: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> np.ndarray:
        return np.stack([fn(t[f"h.{i}.{name}"]) for i in range(L)])

    blocks = {
        "ln1_scale": stack("ln_1.weight"), "ln1_bias": stack("ln_1.bias"),
        "ln2_scale": stack("ln_2.weight"), "ln2_bias": stack("ln_2.bias"),
        "wo": stack("attn.c_proj.weight", lambda w: w.reshape(N, H, D)),
        "bo": stack("attn.c_proj.bias"),
        "w_in": stack("mlp.c_fc.weight"), "b_in": stack("mlp.c_fc.bias"),
        "w_out": stack("mlp.c_proj.weight"), "b_out": stack("mlp.c_proj.bias"),
    }
    for j, name in enumerate(("q", "k", "v")):
        cols = slice(j * D, (j + 1) * D)
        blocks["w" + name] = stack("attn.c_attn.weight", lambda w: w[:, cols].reshape(D, N, H))
        blocks["b" + name] = stack("attn.c_attn.bias", lambda b: b[cols])
    return {"embed": t["wte.weight"], "pos": t["wpe.weight"], "blocks": blocks,
            "ln_f_scale": t["ln_f.weight"], "ln_f_bias": t["ln_f.bias"]}


# ---- config.json against the run's model -----------------------------------------------------
def config_differences(hf: dict[str, Any], cfg: Any) -> list[str]:
    """Each way ``config.json`` (``hf``) and the model config ``cfg`` differ, with the fix."""
    out = []
    if hf.get("model_type") != "gpt2":
        out.append(f"model_type is {hf.get('model_type')!r}, not 'gpt2' (jaxpar reads GPT-2's "
                   "layout only)")
    n_embd = hf.get("n_embd")
    pairs = (("vocab_size", "vocab_size", hf.get("vocab_size")),
             ("n_embd", "d_model", n_embd),
             ("n_layer", "n_layers", hf.get("n_layer")),
             ("n_head", "n_heads", hf.get("n_head")),
             ("n_positions", "max_seq_len", hf.get("n_positions")),
             ("n_inner", "d_ff", hf.get("n_inner") or (4 * n_embd if n_embd else None)))
    for theirs, ours, value in pairs:
        if value != getattr(cfg, ours):
            out.append(f"{theirs}={value} but model.{ours}={getattr(cfg, ours)} "
                       f"(set model.{ours}={value})")
    if not hf.get("tie_word_embeddings", True):
        out.append("tie_word_embeddings=false (a separate lm_head; jaxpar reads GPT-2's tied "
                   "layout only)")
    for key, what in (("tie_embeddings", "a tied output layer"),
                      ("attn_bias", "attention biases")):
        if not getattr(cfg, key):
            out.append(f"GPT-2 has {what} but model.{key}=false (set model.{key}=true)")
    if cfg.positions != "learned":
        out.append(f"GPT-2 has learned positions but model.positions={cfg.positions} (set "
                   "model.positions=learned)")
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        out.append(f"activation_function={act}: jaxpar's GPT computes the tanh GELU "
                   f"({' / '.join(TANH_GELU)}) only")
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
        out.append(f"layer_norm_epsilon={hf['layer_norm_epsilon']}: jaxpar's LayerNorm has "
                   "eps 1e-5 only")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        out.append("attention scaled other than by 1/sqrt(head dim) (scale_attn_weights / "
                   "scale_attn_by_inverse_layer_idx): jaxpar's attention has that scale only")
    return out


def read_config(directory: str | Path, cfg: Any) -> dict[str, Any]:
    """``directory/config.json``, checked against the run's model config.

    Raises:
      DataError: one line naming the missing file, or each difference and the
        override that fixes it.
    """
    where = f"model.init_from={directory}"
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise DataError(f"{where}: no {CONFIG} there; give a directory holding a Hugging "
                        f"Face GPT-2 model ({CONFIG} and {WEIGHTS})")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: {CONFIG} cannot be read: {err}") from None
    diffs = config_differences(hf, cfg)
    if diffs:
        fixes = [d.rsplit("(set ", 1)[1].rstrip(")") for d in diffs if "(set " in d]
        tail = f"; to match it, pass {' '.join(fixes)}" if fixes else ""
        raise DataError(f"{where}: {CONFIG} does not match this run's model: "
                        + "; ".join(diffs) + tail)
    return hf


def read_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` (or of the files a sharded index names)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError(f"model.init_from={directory}: {INDEX} is not a safetensors "
                            f"index ({type(err).__name__}: {err}); re-save the model") from None
    else:
        raise DataError(f"model.init_from={directory}: no {WEIGHTS} there (only safetensors "
                        "files are read; convert a pytorch_model.bin with transformers' "
                        "save_pretrained(safe_serialization=True))")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors |= load_file(str(f))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise DataError(f"model.init_from={directory}: {f.name} cannot be read as "
                            f"safetensors ({type(err).__name__}: {err}); re-save the "
                            "model") from None
    return tensors


def init_params_for(cfg: Any) -> Callable[[], dict[str, Any]] | None:
    """The pretrained weights a run of model config ``cfg`` starts from
    (``Task.init_params``): those of ``model.init_from``, for the GPT; None otherwise."""
    if not isinstance(cfg, GPTConfig) or not cfg.init_from:
        return None
    return params_loader(cfg)  # checks config.json now, reads the weights later


def params_loader(cfg: Any) -> Callable[[], dict[str, Any]]:
    """What ``model.init_from`` gives the task (``Task.init_params``): ``config.json`` is
    checked now (a mismatch fails before anything runs); the weights are read when the
    trainer initializes a fresh run.

    Raises:
      DataError: see :func:`read_config`.
    """
    directory = cfg.init_from
    read_config(directory, cfg)
    return lambda: from_hf(read_tensors(directory), cfg, directory)


# ---- writing ---------------------------------------------------------------------------------
def write(out: str | Path, params: dict[str, Any], cfg: Any) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` of GPT parameters (host arrays) to
    the directory ``out``; each file appears whole (written aside, then renamed)."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights, config = out / WEIGHTS, out / CONFIG
    tmp_w, tmp_c = weights.with_name(WEIGHTS + ".tmp"), config.with_name(CONFIG + ".tmp")
    try:
        # transformers refuses safetensors files without a "format" entry
        save_file(to_hf(params, cfg), str(tmp_w), metadata={"format": "pt"})
        tmp_c.write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
        os.replace(tmp_w, weights)
        os.replace(tmp_c, config)
    finally:
        tmp_w.unlink(missing_ok=True)
        tmp_c.unlink(missing_ok=True)
    return out
