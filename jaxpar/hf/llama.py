"""Hugging Face interchange for the Llama family: ``LlamaForCausalLM``'s layout.

Names and shapes (i: layer; L layers, D width, N query heads, K key/value heads, H head
dim, F MLP width, V vocab; torch's ``Linear`` weights are stored output × input)::

  HF tensor                                     shape      jaxpar parameter     shape
  model.embed_tokens.weight                     [V, D]     embed                [V, D]
  model.layers.{i}.input_layernorm.weight       [D]        blocks/attn_norm     [L, D]
  model.layers.{i}.self_attn.q_proj.weight      [N·H, D]   blocks/wq            [L, D, N, H]
  model.layers.{i}.self_attn.k_proj.weight      [K·H, D]   blocks/wk            [L, D, K, H]
  model.layers.{i}.self_attn.v_proj.weight      [K·H, D]   blocks/wv            [L, D, K, H]
  model.layers.{i}.self_attn.o_proj.weight      [D, N·H]   blocks/wo            [L, N, H, D]
  model.layers.{i}.post_attention_layernorm.weight [D]     blocks/mlp_norm      [L, D]
  model.layers.{i}.mlp.gate_proj.weight         [F, D]     blocks/w_gate        [L, D, F]
  model.layers.{i}.mlp.up_proj.weight           [F, D]     blocks/w_up          [L, D, F]
  model.layers.{i}.mlp.down_proj.weight         [D, F]     blocks/w_down        [L, F, D]
  model.norm.weight                             [D]        norm                 [D]
  lm_head.weight                                [V, D]     head [D, V] (untied; tied: absent)

Rotary positions: Hugging Face's Llama rotates the two halves of each head
(``rotate_half``), and so does jaxpar (:func:`jaxpar.models.transformer.rotary`), so the
q/k projections map row for row. The permutation Hugging Face's
``convert_llama_weights_to_hf.py`` applies (``permute(w, n_heads)``: each head's
interleaved pairs (x0, x1), (x2, x3), … regrouped into halves) converts Meta's original
checkpoints, which rotate interleaved pairs, into this layout; jaxpar reads and writes the
Hugging Face layout only, so it never applies it.

Mixtral's experts: ``block_sparse_moe.gate.weight`` [E, D] ↔ blocks/router [L, D, E];
``block_sparse_moe.experts.{e}.w1 / w3 / w2`` ↔ e_gate, e_up [L, E, D, F] / e_down
[L, E, F, D]; Qwen3-MoE's: ``mlp.gate.weight`` and ``mlp.experts.{e}.gate_proj / up_proj
/ down_proj``. Qwen2's ``self_attn.{q,k,v}_proj.bias`` ↔ bq [L, N, H], bk, bv [L, K, H];
Qwen3's ``self_attn.{q,k}_norm.weight`` [H] ↔ q_norm, k_norm [L, H].

config.json ↔ ``model.*``: :mod:`jaxpar.hf.llama_keys`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.errors import DataError
from jaxpar.hf import llama_keys
from jaxpar.hf.layout import Layout, folder_differences, tensor_problems, untied
from jaxpar.models.llama import LLAMA_FAMILY, LlamaConfig

_LAYER = "model.layers.{}."


def _layer_names(cfg: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Each tensor of one layer: HF suffix → (jaxpar block name, index after the layer,
    how it converts: vec, lin, q, o, bias)."""
    out = {
        "input_layernorm.weight": ("attn_norm", (), "vec"),
        "self_attn.q_proj.weight": ("wq", (), "q"),
        "self_attn.k_proj.weight": ("wk", (), "q"),
        "self_attn.v_proj.weight": ("wv", (), "q"),
        "self_attn.o_proj.weight": ("wo", (), "o"),
        "post_attention_layernorm.weight": ("mlp_norm", (), "vec"),
    }
    if cfg.qkv_bias:
        out |= {f"self_attn.{x}_proj.bias": (f"b{x}", (), "bias") for x in "qkv"}
    if cfg.qk_norm:
        out |= {f"self_attn.{x}_norm.weight": (f"{x}_norm", (), "vec") for x in "qk"}
    if not cfg.n_experts:
        return out | {f"mlp.{x}_proj.weight": (f"w_{x}", (), "lin") for x in ("gate", "up", "down")}
    mixtral = llama_keys.variant(cfg) == "mixtral"
    moe, names = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if mixtral
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    out[f"{moe}.gate.weight"] = ("router", (), "lin")
    for e in range(cfg.n_experts):
        for hf_name, ours in zip(names, ("e_gate", "e_up", "e_down")):
            out[f"{moe}.experts.{e}.{hf_name}.weight"] = (ours, (e,), "lin")
    return out


def hf_tensor(kind: str, x: np.ndarray, d_model: int) -> np.ndarray:
    """One layer's jaxpar array → its HF tensor, by how it converts (:func:`_layer_names`)."""
    if kind == "q":
        return x.reshape(d_model, -1).T
    if kind == "o":
        return x.reshape(-1, d_model).T
    if kind == "bias":
        return x.reshape(-1)
    return x.T if kind == "lin" else x


def our_tensor(kind: str, x: np.ndarray, cfg: Any) -> np.ndarray:
    """One layer's HF tensor → its jaxpar array (the inverse of :func:`hf_tensor`)."""
    H = cfg.head_dim
    if kind == "q":
        return x.T.reshape(cfg.d_model, -1, H)
    if kind == "o":
        return x.T.reshape(-1, H, cfg.d_model)
    if kind == "bias":
        return x.reshape(-1, H)
    return x.T if kind == "lin" else x


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's name and shape."""
    D, N, K, H, F, V, E = (
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
        cfg.n_experts,
    )
    by_name = {
        "attn_norm": (D,),
        "mlp_norm": (D,),
        "wq": (N * H, D),
        "wk": (K * H, D),
        "wv": (K * H, D),
        "wo": (D, N * H),
        "bq": (N * H,),
        "bk": (K * H,),
        "bv": (K * H,),
        "q_norm": (H,),
        "k_norm": (H,),
        "w_gate": (F, D),
        "w_up": (F, D),
        "w_down": (D, F),
        "router": (E, D),
        "e_gate": (F, D),
        "e_up": (F, D),
        "e_down": (D, F),
    }
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg.n_layers):
        shapes |= {
            _LAYER.format(i) + k: by_name[ours] for k, (ours, _, _) in _layer_names(cfg).items()
        }
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def to_hf(params: dict[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """jaxpar Llama-family parameters (a pure dict of arrays) → HF tensors by name
    (float32)."""
    b = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"]}
    names = _layer_names(cfg)
    for i in range(cfg.n_layers):
        out |= {
            _LAYER.format(i) + k: hf_tensor(kind, b[ours][(i, *index)], cfg.d_model)
            for k, (ours, index, kind) in names.items()
        }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["head"]).T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf(tensors: dict[str, np.ndarray], cfg: LlamaConfig, where: str = "") -> dict[str, Any]:
    """HF tensors by name → jaxpar Llama-family parameters (float32).

    Raises:
      DataError: naming the missing, unexpected and misshapen tensors.
    """
    t = untied(tensors, cfg.tie_embeddings)
    t = {k: v for k, v in t.items() if not k.endswith(".rotary_emb.inv_freq")}  # a buffer
    problems = tensor_problems(t, _shapes(cfg))
    if problems:
        arch = llama_keys.VARIANTS[llama_keys.variant(cfg)]
        raise DataError(
            f"model.init_from={where}: the weights do not fit {arch}'s layout "
            "for this model: " + "; ".join(problems)
        )
    parts: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
    for i in range(cfg.n_layers):
        for k, (ours, index, kind) in _layer_names(cfg).items():
            x = np.asarray(t[_LAYER.format(i) + k], np.float32)
            parts.setdefault(ours, {})[(i, *index)] = our_tensor(kind, x, cfg)
    params = {
        "embed": np.asarray(t["model.embed_tokens.weight"], np.float32),
        "blocks": {name: stack_parts(p) for name, p in parts.items()},
        "norm": np.asarray(t["model.norm.weight"], np.float32),
    }
    if not cfg.tie_embeddings:
        params["head"] = np.ascontiguousarray(np.asarray(t["lm_head.weight"], np.float32).T)
    return params


def stack_parts(parts: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """Arrays by index (layer[, expert]) → one array with those leading dims."""
    lead = tuple(n + 1 for n in map(max, zip(*parts)))
    first = next(iter(parts.values()))
    out = np.empty(lead + first.shape, np.float32)
    for index, x in parts.items():
        out[index] = x
    return out


def config_differences(hf: dict[str, Any], cfg: Any) -> list[str]:
    """Each ``model.*`` value the folder's ``config.json`` gives that the run's config
    does not have, and which side to change (a refused key raises)."""
    settings = llama_keys.settings(hf, f"model.init_from={cfg.init_from}")
    return folder_differences(settings, cfg, LAYOUT.bounds)


#: The Hugging Face layouts of jaxpar's Llama family (see :mod:`jaxpar.hf`).
LAYOUT = Layout(
    LlamaConfig,
    "Llama",
    "LlamaForCausalLM",
    llama_keys.cannot_hold,
    llama_keys.hf_config,
    to_hf,
    from_hf,
    config_differences,
    LLAMA_FAMILY.name,
    tuple(llama_keys.VARIANTS),
    llama_keys.settings,
    lambda cfg: llama_keys.VARIANTS[llama_keys.variant(cfg)],
    ("max_seq_len",),
)
