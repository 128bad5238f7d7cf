"""``config.json`` ↔ ``model.*`` for Gemma 2 and Gemma 3 text folders: every key is mapped,
known to leave the numbers alone, or refused in one line.

  gemma2       Gemma2ForCausalLM   soft-capped attention (50) and output logits (30), one
                                   rotary base, windowed and full layers alternating
  gemma3_text  Gemma3ForCausalLM   per-head q/k norms, a rotary setting per kind of layer
                                   (``rope_parameters: {full_attention: …,
                                   sliding_attention: …}``), five windowed layers to a full one

Mapped keys: ``vocab_size``, ``hidden_size`` → d_model, ``intermediate_size`` → d_ff,
``num_hidden_layers`` → n_layers, ``num_attention_heads`` → n_heads,
``num_key_value_heads`` → n_kv_heads, ``head_dim`` → head_size,
``max_position_embeddings`` → max_seq_len, ``rms_norm_eps`` → norm_eps,
``tie_word_embeddings``, ``query_pre_attn_scalar``, ``attn_logit_softcapping`` →
attn_softcap, ``final_logit_softcapping`` → final_softcap, ``sliding_window``,
``layer_types`` (or Gemma 3's older ``sliding_window_pattern``) → sliding_window_pattern,
``rope_parameters`` (or the older ``rope_theta``, ``rope_local_base_freq``,
``rope_scaling``) → rope_theta, rope_local_theta, rope_type, rope_factor.
"""

from __future__ import annotations

from typing import Any

from jaxpar.errors import DataError
from jaxpar.hf import llama_keys
from jaxpar.hf.layout import check_keys, unsupported

VARIANTS = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
#: Keys that do not change the numbers: the Llama family's, Gemma 3's cache choice, and
#: ``hidden_act`` (Gemma 1's key: transformers' Gemma 2/3 read ``hidden_activation``).
NO_EFFECT = llama_keys.NO_EFFECT | {"cache_implementation", "hidden_act"}
#: Keys whose value must be this for jaxpar's numbers to be the folder's.
REQUIRED = {
    "hidden_activation": (
        "gelu_pytorch_tanh",
        "jaxpar's Gemma gates its MLP with the tanh form of GELU only",
    ),
    "attention_dropout": (0.0, "jaxpar has no attention dropout"),
    "attention_bias": (False, "jaxpar's Gemma projections have no biases"),
    "use_bidirectional_attention": (False, "jaxpar's Gemma is causal"),
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor"}
_KINDS = ("full_attention", "sliding_attention")
MAPPED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "sliding_window_pattern",
        "rope_parameters",
        "rope_theta",
        "rope_local_base_freq",
        "rope_scaling",
    }
)


def settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``model.*`` values of a Gemma 2 or Gemma 3 text ``config.json``.

    Raises:
      DataError: one line naming a key (or value) jaxpar would compute differently.
    """
    kind = hf.get("model_type")
    if kind not in VARIANTS:
        raise unsupported(where, f"model_type={kind!r}: jaxpar's Gemma reads {', '.join(VARIANTS)}")
    check_keys(hf, where, VARIANTS[kind], MAPPED | NO_EFFECT, REQUIRED)
    if kind == "gemma3_text" and hf.get("attn_logit_softcapping") is not None:
        raise DataError(
            f"{where}: config.json attn_logit_softcapping={hf['attn_logit_softcapping']}: "
            "transformers' Gemma3ForCausalLM never applies it, so jaxpar cannot "
            "say which numbers the folder means; set it to null"
        )
    heads = hf["num_attention_heads"]
    width = hf["hidden_size"]
    head_dim = hf.get("head_dim") or width // heads
    return (
        {
            "vocab_size": hf["vocab_size"],
            "d_model": width,
            "d_ff": hf["intermediate_size"],
            "n_layers": hf["num_hidden_layers"],
            "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_size": 0 if head_dim * heads == width else head_dim,
            "max_seq_len": hf["max_position_embeddings"],
            "norm_eps": hf["rms_norm_eps"],
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            "attn_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(hf.get("final_logit_softcapping") or 0.0),
            "qk_norm": kind == "gemma3_text",
        }
        | _windows(hf, kind, where)
        | _rope(hf, kind, where)
    )


def layer_types(pattern: int, layers: int) -> list[str]:
    """transformers' layer kinds: every ``pattern``-th layer full (0: none)."""
    return [
        "full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(layers)
    ]


def _windows(hf: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """sliding_window and the pattern that gives each layer its kind."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") or 0
    types = hf.get("layer_types")
    if types is None:  # what transformers derives: Gemma 2 alternates, Gemma 3 goes by 6
        types = layer_types(2 if kind == "gemma2" else hf.get("sliding_window_pattern", 6), layers)
    if not set(types) <= set(_KINDS) or len(types) != layers:
        raise unsupported(
            where,
            f"layer_types={types}: jaxpar reads full_attention and "
            "sliding_attention, one per layer",
        )
    pattern = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), 0)
    if layer_types(pattern, layers) != list(types):
        raise unsupported(
            where,
            f"layer_types={types}: jaxpar's Gemma repeats one pattern (P − 1 "
            "sliding_attention layers, then a full_attention one) through the model",
        )
    if pattern != 1 and not window:
        raise unsupported(where, "has sliding_attention layers but no sliding_window")
    return {"sliding_window": int(window), "sliding_window_pattern": pattern}


def _rope(hf: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """The rotary base of each kind of layer and the full layers' scaling."""
    params = hf.get("rope_parameters")
    if kind == "gemma2":
        full = dict(params or hf.get("rope_scaling") or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        local = full
    elif params is not None:
        if not isinstance(params, dict) or not set(params) <= set(_KINDS):
            raise unsupported(
                where,
                f"rope_parameters={params}: a Gemma 3 folder gives one "
                "setting per attention kind (full_attention, sliding_attention)",
            )
        full = {"rope_theta": 1e6, **(params.get("full_attention") or {})}
        local = {"rope_theta": 1e4, **(params.get("sliding_attention") or {})}
    else:  # the older spelling: the scaling is the full layers'
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    full_type, local_type = (_rope_type(r, where) for r in (full, local))
    if local_type != "default" or (kind == "gemma2" and full_type != "default"):
        scaled = local_type if local_type != "default" else full_type
        raise unsupported(
            where,
            f"rotary setting rope_type={scaled}: jaxpar's "
            f"{VARIANTS[kind]} scales only Gemma 3's full-attention layers "
            "(linear)",
        )
    out = {
        "rope_theta": float(full["rope_theta"]),
        "rope_local_theta": float(local["rope_theta"]),
        "rope_type": full_type,
    }
    return out | ({"rope_factor": float(full["factor"])} if full_type == "linear" else {})


def _rope_type(rope: dict[str, Any], where: str) -> str:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    extra = sorted(set(rope) - _ROPE_KEYS)
    if rope_type not in ("default", "linear") or extra:
        what = (
            f"rope_type={rope_type}"
            if rope_type not in ("default", "linear")
            else f"key {extra[0]}"
        )
        raise unsupported(
            where,
            f"rotary setting {what}: jaxpar's Gemma implements the rope "
            "types default and linear exactly and no other",
        )
    return rope_type


def variant(cfg: Any) -> str:
    """The Hugging Face model_type that holds a config (q/k norms: Gemma 3)."""
    return "gemma3_text" if cfg.qk_norm else "gemma2"


def hf_config(cfg: Any) -> dict[str, Any]:
    """``config.json`` of a jaxpar Gemma config, as the variant :func:`variant` names."""
    kind = variant(cfg)
    full = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        full["factor"] = cfg.rope_factor
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    windows = [k.window for k in cfg.pattern]
    return {
        "architectures": [VARIANTS[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_bidirectional_attention": False,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "attn_logit_softcapping": cfg.attn_softcap or None,
        "final_logit_softcapping": cfg.final_softcap or None,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": [
            "sliding_attention" if windows[i % len(windows)] else "full_attention"
            for i in range(cfg.n_layers)
        ],
        "rope_parameters": full
        if kind == "gemma2"
        else {"full_attention": full, "sliding_attention": local},
        "initializer_range": 0.02,
        "dtype": "float32",
        "use_cache": True,
    }


def cannot_hold(cfg: Any) -> list[str]:
    """What of a config neither variant's layout holds (empty: it exports)."""
    out = []
    if not cfg.qk_norm and (cfg.rope_local_theta != cfg.rope_theta or cfg.rope_type != "default"):
        out.append(
            "a rotary base per kind of layer or rotary scaling without q/k norms "
            "(Gemma 2 has one base; Gemma 3, which has both, has q/k norms)"
        )
    if cfg.qk_norm and cfg.attn_softcap:
        out.append(
            "soft-capped attention with q/k norms (transformers' Gemma 3 never "
            "applies attn_logit_softcapping)"
        )
    return out
