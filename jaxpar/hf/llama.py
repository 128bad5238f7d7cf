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

config.json ↔ ``model.*``: ``vocab_size``, ``hidden_size`` ↔ ``d_model``,
``intermediate_size`` ↔ ``d_ff``, ``num_hidden_layers`` ↔ ``n_layers``,
``num_attention_heads`` ↔ ``n_heads``, ``num_key_value_heads`` ↔ ``n_kv_heads``,
``max_position_embeddings`` ↔ ``max_seq_len``, ``rope_theta``, ``rms_norm_eps`` ↔
``norm_eps``, ``tie_word_embeddings`` ↔ ``tie_embeddings``; ``hidden_act`` silu, no
attention or MLP biases, no ``rope_scaling``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.errors import DataError
from jaxpar.hf.layout import Layout, key_differences, tensor_problems
from jaxpar.models.llama import LlamaConfig

_LAYER = "model.layers.{}."


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """``config.json`` of a jaxpar Llama config."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    D, N, K, H, F, V = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg.n_layers):
        shapes |= {_LAYER.format(i) + k: s for k, s in (
            ("input_layernorm.weight", (D,)), ("self_attn.q_proj.weight", (N * H, D)),
            ("self_attn.k_proj.weight", (K * H, D)), ("self_attn.v_proj.weight", (K * H, D)),
            ("self_attn.o_proj.weight", (D, N * H)),
            ("post_attention_layernorm.weight", (D,)), ("mlp.gate_proj.weight", (F, D)),
            ("mlp.up_proj.weight", (F, D)), ("mlp.down_proj.weight", (D, F)))}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def to_hf(params: dict[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """jaxpar Llama parameters (a pure dict of arrays) → HF tensors by name (float32)."""
    D = cfg.d_model
    b = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"]}
    for i in range(cfg.n_layers):
        layer = _LAYER.format(i)
        out |= {
            layer + "input_layernorm.weight": b["attn_norm"][i],
            layer + "self_attn.q_proj.weight": b["wq"][i].reshape(D, -1).T,
            layer + "self_attn.k_proj.weight": b["wk"][i].reshape(D, -1).T,
            layer + "self_attn.v_proj.weight": b["wv"][i].reshape(D, -1).T,
            layer + "self_attn.o_proj.weight": b["wo"][i].reshape(-1, D).T,
            layer + "post_attention_layernorm.weight": b["mlp_norm"][i],
            layer + "mlp.gate_proj.weight": b["w_gate"][i].T,
            layer + "mlp.up_proj.weight": b["w_up"][i].T,
            layer + "mlp.down_proj.weight": b["w_down"][i].T,
        }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["head"]).T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf(tensors: dict[str, np.ndarray], cfg: LlamaConfig, where: str = ""
            ) -> dict[str, Any]:
    """HF Llama tensors by name → jaxpar Llama parameters (float32).

    Raises:
      DataError: naming the missing, unexpected and misshapen tensors.
    """
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    t = dict(tensors)
    if cfg.tie_embeddings:  # a tied model's files may store the head: the table itself
        head = t.pop("lm_head.weight", None)
        if head is not None and not np.array_equal(head, t.get("model.embed_tokens.weight")):
            t["lm_head.weight"] = head  # reported below as unexpected
    t = {k: v for k, v in t.items() if not k.endswith(".rotary_emb.inv_freq")}  # a buffer
    shapes = _shapes(cfg)
    problems = tensor_problems(t, shapes)
    if problems:
        raise DataError(f"model.init_from={where}: the weights do not fit LlamaForCausalLM's "
                        "layout for this model: " + "; ".join(problems))
    t = {k: np.asarray(v, np.float32) for k, v in t.items()}

    def stack(name: str, fn=lambda x: x) -> np.ndarray:
        return np.ascontiguousarray(np.stack([fn(t[_LAYER.format(i) + name])
                                              for i in range(cfg.n_layers)]))

    blocks = {
        "attn_norm": stack("input_layernorm.weight"),
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(D, N, H)),
        "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, H)),
        "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, H)),
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D)),
        "mlp_norm": stack("post_attention_layernorm.weight"),
        "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
        "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
    }
    params = {"embed": t["model.embed_tokens.weight"], "blocks": blocks,
              "norm": t["model.norm.weight"]}
    if not cfg.tie_embeddings:
        params["head"] = np.ascontiguousarray(t["lm_head.weight"].T)
    return params


def config_differences(hf: dict[str, Any], cfg: LlamaConfig) -> list[str]:
    """Each way ``config.json`` (``hf``) and the model config ``cfg`` differ, with the fix."""
    out = []
    if hf.get("model_type") != "llama":
        out.append(f"model_type is {hf.get('model_type')!r}, not 'llama' (model.name=llama "
                   "reads LlamaForCausalLM's layout)")
    heads = hf.get("num_attention_heads")
    pairs = (("vocab_size", "vocab_size", hf.get("vocab_size")),
             ("hidden_size", "d_model", hf.get("hidden_size")),
             ("intermediate_size", "d_ff", hf.get("intermediate_size")),
             ("num_hidden_layers", "n_layers", hf.get("num_hidden_layers")),
             ("num_attention_heads", "n_heads", heads),
             ("num_key_value_heads", "n_kv_heads", hf.get("num_key_value_heads", heads)),
             ("max_position_embeddings", "max_seq_len", hf.get("max_position_embeddings")),
             ("rope_theta", "rope_theta", hf.get("rope_theta", 10000.0)),
             ("rms_norm_eps", "norm_eps", hf.get("rms_norm_eps", 1e-6)),
             ("tie_word_embeddings", "tie_embeddings", hf.get("tie_word_embeddings", False)))
    out += key_differences(pairs, cfg)
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={hf['hidden_act']}: jaxpar's Llama computes SwiGLU (silu) only")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        out.append("attention_bias / mlp_bias: jaxpar's Llama has no biases")
    if hf.get("rope_scaling"):
        out.append(f"rope_scaling={hf['rope_scaling']}: jaxpar's rotary positions have no "
                   "frequency scaling")
    if hf.get("head_dim") not in (None, cfg.head_dim):
        out.append(f"head_dim={hf['head_dim']}: jaxpar's head dim is d_model / n_heads = "
                   f"{cfg.head_dim}")
    return out


#: LlamaForCausalLM's layout for jaxpar's Llama family (see :mod:`jaxpar.hf`).
def cannot_hold(cfg: LlamaConfig) -> list[str]:
    """What of the model LlamaForCausalLM's layout cannot hold (empty: it exports)."""
    if cfg.n_experts:
        return [f"model.n_experts={cfg.n_experts} (a mixture of experts; LlamaForCausalLM's "
                "MLPs are dense, and jaxpar writes no Mixtral layout yet)"]
    return []


LAYOUT = Layout(LlamaConfig, "Llama", "LlamaForCausalLM", cannot_hold, hf_config, to_hf,
                from_hf, config_differences)
