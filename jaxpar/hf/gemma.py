"""Hugging Face interchange for the Gemma family: ``Gemma2ForCausalLM`` and
``Gemma3ForCausalLM`` (text).

Names and shapes (i: layer; L layers, D width, N query heads, K key/value heads, H head
dim, F MLP width, V vocab; torch's ``Linear`` weights are stored output × input; every
norm weight is the w of (1 + w), stored as it is)::

  HF tensor                                        shape     jaxpar parameter      shape
  model.embed_tokens.weight                        [V, D]    embed                 [V, D]
  model.layers.{i}.input_layernorm.weight          [D]       blocks/attn_norm      [L, D]
  model.layers.{i}.self_attn.q_proj.weight         [N·H, D]  blocks/wq             [L, D, N, H]
  model.layers.{i}.self_attn.k_proj.weight         [K·H, D]  blocks/wk             [L, D, K, H]
  model.layers.{i}.self_attn.v_proj.weight         [K·H, D]  blocks/wv             [L, D, K, H]
  model.layers.{i}.self_attn.o_proj.weight         [D, N·H]  blocks/wo             [L, N, H, D]
  model.layers.{i}.self_attn.q_norm.weight         [H]       blocks/q_norm         [L, H] (Gemma 3)
  model.layers.{i}.self_attn.k_norm.weight         [H]       blocks/k_norm         [L, H] (Gemma 3)
  model.layers.{i}.post_attention_layernorm.weight [D]       blocks/post_attn_norm [L, D]
  model.layers.{i}.pre_feedforward_layernorm.weight [D]      blocks/mlp_norm       [L, D]
  model.layers.{i}.post_feedforward_layernorm.weight [D]     blocks/post_mlp_norm  [L, D]
  model.layers.{i}.mlp.gate_proj.weight            [F, D]    blocks/w_gate         [L, D, F]
  model.layers.{i}.mlp.up_proj.weight              [F, D]    blocks/w_up           [L, D, F]
  model.layers.{i}.mlp.down_proj.weight            [D, F]    blocks/w_down         [L, F, D]
  model.norm.weight                                [D]       norm                  [D]
  lm_head.weight                                   [V, D]    head [D, V] (untied; tied: absent)

The q/k projections map row for row: transformers' Gemma rotates the two halves of each
head (``rotate_half``), as jaxpar does. config.json ↔ ``model.*``:
:mod:`jaxpar.hf.gemma_keys`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.errors import DataError
from jaxpar.hf import gemma_keys
from jaxpar.hf.layout import Layout, folder_differences, tensor_problems, untied
from jaxpar.hf.llama import hf_tensor, our_tensor, stack_parts
from jaxpar.models.gemma import GEMMA_FAMILY, GemmaConfig

_LAYER = "model.layers.{}."


def _layer_names(cfg: GemmaConfig) -> dict[str, tuple[str, str]]:
    """Each tensor of one layer: HF suffix → (jaxpar block name, how it converts: vec,
    lin, q, o)."""
    out = {
        "input_layernorm.weight": ("attn_norm", "vec"),
        "post_attention_layernorm.weight": ("post_attn_norm", "vec"),
        "pre_feedforward_layernorm.weight": ("mlp_norm", "vec"),
        "post_feedforward_layernorm.weight": ("post_mlp_norm", "vec"),
    }
    out |= {f"self_attn.{x}_proj.weight": (f"w{x}", "q") for x in "qkv"}
    out["self_attn.o_proj.weight"] = ("wo", "o")
    out |= {f"mlp.{x}_proj.weight": (f"w_{x}", "lin") for x in ("gate", "up", "down")}
    if cfg.qk_norm:
        out |= {f"self_attn.{x}_norm.weight": (f"{x}_norm", "vec") for x in "qk"}
    return out


def _shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's name and shape."""
    D, N, K, H, F, V = (
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
    )
    by_kind = {"q": lambda ours: ((N if ours == "wq" else K) * H, D), "o": lambda _: (D, N * H)}
    by_name = {"w_gate": (F, D), "w_up": (F, D), "w_down": (D, F), "q_norm": (H,), "k_norm": (H,)}
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg.n_layers):
        shapes |= {
            _LAYER.format(i) + k: by_kind[kind](ours)
            if kind in by_kind
            else by_name.get(ours, (D,))
            for k, (ours, kind) in _layer_names(cfg).items()
        }
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def to_hf(params: dict[str, Any], cfg: GemmaConfig) -> dict[str, np.ndarray]:
    """jaxpar Gemma parameters (a pure dict of arrays) → HF tensors by name (float32)."""
    b = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"]}
    for i in range(cfg.n_layers):
        out |= {
            _LAYER.format(i) + k: hf_tensor(kind, b[ours][i], cfg.d_model)
            for k, (ours, kind) in _layer_names(cfg).items()
        }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["head"]).T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf(tensors: dict[str, np.ndarray], cfg: GemmaConfig, where: str = "") -> dict[str, Any]:
    """HF tensors by name → jaxpar Gemma parameters (float32).

    Raises:
      DataError: naming the missing, unexpected and misshapen tensors.
    """
    t = untied(tensors, cfg.tie_embeddings)
    problems = tensor_problems(t, _shapes(cfg))
    if problems:
        arch = gemma_keys.VARIANTS[gemma_keys.variant(cfg)]
        raise DataError(
            f"model.init_from={where}: the weights do not fit {arch}'s layout "
            "for this model: " + "; ".join(problems)
        )
    blocks = {
        ours: stack_parts(
            {
                (i,): our_tensor(kind, np.asarray(t[_LAYER.format(i) + k], np.float32), cfg)
                for i in range(cfg.n_layers)
            }
        )
        for k, (ours, kind) in _layer_names(cfg).items()
    }
    params = {
        "embed": np.asarray(t["model.embed_tokens.weight"], np.float32),
        "blocks": blocks,
        "norm": np.asarray(t["model.norm.weight"], np.float32),
    }
    if not cfg.tie_embeddings:
        params["head"] = np.ascontiguousarray(np.asarray(t["lm_head.weight"], np.float32).T)
    return params


def config_differences(hf: dict[str, Any], cfg: Any) -> list[str]:
    """Each ``model.*`` value the folder's ``config.json`` gives that the run's config
    does not have, and which side to change (a refused key raises)."""
    settings = gemma_keys.settings(hf, f"model.init_from={cfg.init_from}")
    return folder_differences(settings, cfg, LAYOUT.bounds)


#: The Hugging Face layouts of jaxpar's Gemma family (see :mod:`jaxpar.hf`).
LAYOUT = Layout(
    GemmaConfig,
    "Gemma",
    "Gemma2ForCausalLM",
    gemma_keys.cannot_hold,
    gemma_keys.hf_config,
    to_hf,
    from_hf,
    config_differences,
    GEMMA_FAMILY.name,
    tuple(gemma_keys.VARIANTS),
    gemma_keys.settings,
    lambda cfg: gemma_keys.VARIANTS[gemma_keys.variant(cfg)],
    ("max_seq_len",),
)
