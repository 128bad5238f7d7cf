"""Hugging Face interchange for the GPT: GPT-2's layout (``GPT2LMHeadModel``).

``jaxpar export RUN_DIR --format hf --out DIR`` writes ``DIR/config.json`` and the weights
(:mod:`jaxpar.hf.files`) that ``transformers`` loads with
``GPT2LMHeadModel.from_pretrained(DIR)``; ``model.init_from=DIR`` starts a fresh jaxpar run
from such a directory (a local copy of GPT-2 small, say: nothing is downloaded).

GPT-2's numerics are jaxpar's GPT with ``model.positions=learned``: pre-norm blocks,
LayerNorm eps 1e-5, attention scaled by 1/sqrt(H), the tanh GELU (``gelu_new``, which is
``jax.nn.gelu``'s default); GPT-2 has attention biases (a model without
``model.attn_bias`` exports zero ones) and ties its output layer to the token table
(``model.tie_embeddings=true``) — an untied model is written with its own
``lm_head.weight`` and ``tie_word_embeddings: false``, which ``GPT2LMHeadModel`` loads.

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
  lm_head.weight (tied: not stored) [V, D] = wte.weight, or (untied) head [D, V] transposed

config.json ↔ ``model.*``: ``vocab_size`` ↔ ``vocab_size``, ``n_embd`` ↔ ``d_model``,
``n_layer`` ↔ ``n_layers``, ``n_head`` ↔ ``n_heads``, ``n_positions`` (= ``n_ctx``) ↔
``max_seq_len``, ``n_inner`` (null: 4·n_embd) ↔ ``d_ff``; ``tie_word_embeddings`` (default
true) ↔ ``tie_embeddings``.

Reading accepts the keys with or without the ``transformer.`` prefix (the hub's
``gpt2`` files have none), ignores the attention-mask buffers older files hold
(``h.{i}.attn.bias``, ``h.{i}.attn.masked_bias``) and a stored ``lm_head.weight`` equal
to ``wte.weight`` (of a tied model), and reads a sharded index too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpar.errors import DataError
from jaxpar.hf.layout import Layout, key_differences, tensor_problems, unsupported
from jaxpar.models.gpt import GPT_FAMILY, GPTConfig

#: HF's names for the tanh GELU (``jax.nn.gelu(approximate=True)``)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_PREFIX = "transformer."
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in older files


# ---- what GPT-2's layout can hold ------------------------------------------------------------
def cannot_hold(cfg: GPTConfig) -> list[str]:
    """What of the model GPT-2's layout cannot hold (empty: it exports)."""
    if cfg.positions != "learned":
        return [
            f"model.positions={cfg.positions} (GPT-2 adds learned positions, wpe; it has "
            "no rotary embedding)"
        ]
    return []


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
        # the dropout the model trained with (model.dropout: embeddings and residual
        # branches alike; model.attention_dropout)
        "resid_pdrop": getattr(cfg, "dropout", 0.0),
        "embd_pdrop": getattr(cfg, "dropout", 0.0),
        "attn_pdrop": getattr(cfg, "attention_dropout", 0.0),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": 50256 if gpt2_tokens else None,
        "eos_token_id": 50256 if gpt2_tokens else None,
        "use_cache": True,
    }


# ---- the mapping -----------------------------------------------------------------------------
def to_hf(params: dict[str, Any], cfg: Any) -> dict[str, np.ndarray]:
    """jaxpar GPT parameters (a pure dict of arrays) → HF tensors by name (float32).

    A model without ``attn_bias`` gets zero attention biases (the same function); an
    untied one its own ``lm_head.weight``.
    """
    L, D = cfg.n_layers, cfg.d_model
    b = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    zeros = np.zeros((L, D), np.float32)
    out = {
        "wte.weight": params["embed"],
        "wpe.weight": params["pos"],
        "ln_f.weight": params["ln_f_scale"],
        "ln_f.bias": params["ln_f_bias"],
    }
    for i in range(L):
        h = f"h.{i}."
        out |= {
            h + "ln_1.weight": b["ln1_scale"][i],
            h + "ln_1.bias": b["ln1_bias"][i],
            h + "attn.c_attn.weight": np.concatenate(
                [b[w][i].reshape(D, D) for w in ("wq", "wk", "wv")], axis=1
            ),
            h + "attn.c_attn.bias": np.concatenate(
                [b.get(k, zeros)[i] for k in ("bq", "bk", "bv")]
            ),
            h + "attn.c_proj.weight": b["wo"][i].reshape(D, D),
            h + "attn.c_proj.bias": b.get("bo", zeros)[i],
            h + "ln_2.weight": b["ln2_scale"][i],
            h + "ln_2.bias": b["ln2_bias"][i],
            h + "mlp.c_fc.weight": b["w_in"][i],
            h + "mlp.c_fc.bias": b["b_in"][i],
            h + "mlp.c_proj.weight": b["w_out"][i],
            h + "mlp.c_proj.bias": b["b_out"][i],
        }
    out = {_PREFIX + k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["head"]).T, np.float32)
    return out


def from_hf(tensors: dict[str, np.ndarray], cfg: Any, where: str = "") -> dict[str, Any]:
    """HF GPT-2 tensors by name → jaxpar GPT parameters (a pure dict of float32 arrays).

    Raises:
      DataError: naming the missing, unexpected and misshapen tensors, or an untied
        ``lm_head.weight``.
    """
    t = {k.removeprefix(_PREFIX): v for k, v in tensors.items()}
    head = t.pop("lm_head.weight", None)
    for k in [k for k in t if k.startswith("h.") and k.endswith(_BUFFERS)]:
        del t[k]
    problems = tensor_problems(t, _expected_shapes(cfg)) + _head_problems(t, head, cfg)
    if problems:
        raise DataError(
            f"model.init_from={where}: the weights do not fit GPT-2's layout for "
            "this model: " + "; ".join(problems)
        )
    t = {k: np.asarray(v, np.float32) for k, v in t.items()}
    params = {
        "embed": t["wte.weight"],
        "pos": t["wpe.weight"],
        "blocks": _stacked_blocks(t, cfg),
        "ln_f_scale": t["ln_f.weight"],
        "ln_f_bias": t["ln_f.bias"],
    }
    if not cfg.tie_embeddings:
        params["head"] = np.ascontiguousarray(np.asarray(head, np.float32).T)
    return params


def _expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of GPT-2's layout for ``cfg`` (the output layer aside) by name, with
    its shape."""
    D, F = cfg.d_model, cfg.d_ff
    shapes = {
        "wte.weight": (cfg.vocab_size, D),
        "wpe.weight": (cfg.max_seq_len, D),
        "ln_f.weight": (D,),
        "ln_f.bias": (D,),
    }
    for i in range(cfg.n_layers):
        shapes |= {
            f"h.{i}.{k}": s
            for k, s in (
                ("ln_1.weight", (D,)),
                ("ln_1.bias", (D,)),
                ("attn.c_attn.weight", (D, 3 * D)),
                ("attn.c_attn.bias", (3 * D,)),
                ("attn.c_proj.weight", (D, D)),
                ("attn.c_proj.bias", (D,)),
                ("ln_2.weight", (D,)),
                ("ln_2.bias", (D,)),
                ("mlp.c_fc.weight", (D, F)),
                ("mlp.c_fc.bias", (F,)),
                ("mlp.c_proj.weight", (F, D)),
                ("mlp.c_proj.bias", (D,)),
            )
        }
    return shapes


def _head_problems(t: dict[str, np.ndarray], head: np.ndarray | None, cfg: Any) -> list[str]:
    """What is wrong with the stored ``lm_head.weight`` (``head``) for ``cfg``: a tied
    model's must equal the token table, an untied model's must be there, [V, D]."""
    problems = []
    D = cfg.d_model
    if (
        cfg.tie_embeddings
        and head is not None
        and (
            head.shape != t.get("wte.weight", head).shape
            or not np.array_equal(head, t["wte.weight"])
        )
    ):
        problems.append(
            "lm_head.weight differs from wte.weight (an untied output layer: "
            "set model.tie_embeddings=false)"
        )
    if not cfg.tie_embeddings and (head is None or head.shape != (cfg.vocab_size, D)):
        problems.append(
            "lm_head.weight missing"
            if head is None
            else f"lm_head.weight has shape {tuple(head.shape)}, expected {(cfg.vocab_size, D)}"
        )
    return problems


def _stacked_blocks(t: dict[str, np.ndarray], cfg: Any) -> dict[str, np.ndarray]:
    """The blocks' parameters, each GPT-2 tensor stacked over the layers (``c_attn``'s
    columns q | k | v split into the three projections)."""
    L, D, N, H = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim

    def stack(name: str, fn: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> np.ndarray:
        return np.stack([fn(t[f"h.{i}.{name}"]) for i in range(L)])

    blocks = {
        "ln1_scale": stack("ln_1.weight"),
        "ln1_bias": stack("ln_1.bias"),
        "ln2_scale": stack("ln_2.weight"),
        "ln2_bias": stack("ln_2.bias"),
        "wo": stack("attn.c_proj.weight", lambda w: w.reshape(N, H, D)),
        "bo": stack("attn.c_proj.bias"),
        "w_in": stack("mlp.c_fc.weight"),
        "b_in": stack("mlp.c_fc.bias"),
        "w_out": stack("mlp.c_proj.weight"),
        "b_out": stack("mlp.c_proj.bias"),
    }
    for j, name in enumerate(("q", "k", "v")):
        cols = slice(j * D, (j + 1) * D)
        # the columns bound as a default: a closure would see whatever the loop last set
        blocks["w" + name] = stack(
            "attn.c_attn.weight", lambda w, cols=cols: w[:, cols].reshape(D, N, H)
        )
        blocks["b" + name] = stack("attn.c_attn.bias", lambda b, cols=cols: b[cols])
    return blocks


# ---- config.json against the run's model -----------------------------------------------------
def config_differences(hf: dict[str, Any], cfg: Any) -> list[str]:
    """Each way ``config.json`` (``hf``) and the model config ``cfg`` differ, with the fix."""
    out = []
    if hf.get("model_type") != "gpt2":
        out.append(
            f"model_type is {hf.get('model_type')!r}, not 'gpt2' (jaxpar reads GPT-2's layout only)"
        )
    n_embd = hf.get("n_embd")
    if cfg is None:  # the refusals alone (settings)
        return out + _refusals(hf)
    pairs = (
        ("vocab_size", "vocab_size", hf.get("vocab_size")),
        ("n_embd", "d_model", n_embd),
        ("n_layer", "n_layers", hf.get("n_layer")),
        ("n_head", "n_heads", hf.get("n_head")),
        ("n_positions", "max_seq_len", hf.get("n_positions")),
        ("n_inner", "d_ff", hf.get("n_inner") or (4 * n_embd if n_embd else None)),
    )
    out += key_differences(pairs, cfg)
    tied = bool(hf.get("tie_word_embeddings", True))
    if tied != cfg.tie_embeddings:
        out.append(
            f"tie_word_embeddings={str(tied).lower()} but model.tie_embeddings="
            f"{str(cfg.tie_embeddings).lower()} (set model.tie_embeddings="
            f"{str(tied).lower()})"
        )
    if not cfg.attn_bias:
        out.append(
            "GPT-2 has attention biases but model.attn_bias=false (set model.attn_bias=true)"
        )
    if cfg.positions != "learned":
        out.append(
            f"GPT-2 has learned positions but model.positions={cfg.positions} (set "
            "model.positions=learned)"
        )
    return out + _refusals(hf)


def _refusals(hf: dict[str, Any]) -> list[str]:
    """The settings of a GPT-2 ``config.json`` jaxpar's GPT cannot compute."""
    out = []
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        out.append(
            f"activation_function={act}: jaxpar's GPT computes the tanh GELU "
            f"({' / '.join(TANH_GELU)}) only"
        )
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
        out.append(
            f"layer_norm_epsilon={hf['layer_norm_epsilon']}: jaxpar's LayerNorm has eps 1e-5 only"
        )
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        out.append(
            "attention scaled other than by 1/sqrt(head dim) (scale_attn_weights / "
            "scale_attn_by_inverse_layer_idx): jaxpar's attention has that scale only"
        )
    return out


def settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``model.*`` values of GPT-2's ``config.json`` (``model.name=gpt``).

    Raises:
      DataError: one line naming a setting jaxpar's GPT computes otherwise.
    """
    refused = [d for d in config_differences(hf, None) if "(set " not in d]
    if refused:
        raise unsupported(where, refused[0])
    n_embd = hf["n_embd"]
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": n_embd,
        "n_layers": hf["n_layer"],
        "n_heads": hf["n_head"],
        "max_seq_len": hf["n_positions"],
        "d_ff": hf.get("n_inner") or 4 * n_embd,
        "positions": "learned",
        "attn_bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


#: GPT-2's layout for jaxpar's GPT (see :mod:`jaxpar.hf`).
LAYOUT = Layout(
    GPTConfig,
    "GPT-2",
    "GPT2LMHeadModel",
    cannot_hold,
    hf_config,
    to_hf,
    from_hf,
    config_differences,
    GPT_FAMILY.name,
    ("gpt2",),
    settings,
    lambda cfg: "GPT-2",
)
