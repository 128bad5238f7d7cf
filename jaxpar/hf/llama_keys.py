"""``config.json`` ↔ ``model.*`` for the Llama family's Hugging Face variants: every key is
mapped, known to leave the numbers alone, or refused in one line.

The variants (``model_type`` → architecture) and what sets them apart
(:mod:`jaxpar.models.llama_config`)::

  llama      LlamaForCausalLM     rope_parameters (default, linear, llama3)
  qwen2      Qwen2ForCausalLM     q/k/v biases (always)
  qwen3      Qwen3ForCausalLM     per-head q/k RMSNorm, head_dim
  mistral    MistralForCausalLM   sliding_window
  mixtral    MixtralForCausalLM   num_local_experts, num_experts_per_tok (renormalized top-k)
  qwen3_moe  Qwen3MoeForCausalLM  q/k RMSNorm, head_dim, experts of moe_intermediate_size

Mapped keys: ``vocab_size``, ``hidden_size`` → d_model, ``intermediate_size`` → d_ff
(``moe_intermediate_size`` for Qwen3-MoE), ``num_hidden_layers`` → n_layers,
``num_attention_heads`` → n_heads, ``num_key_value_heads`` → n_kv_heads, ``head_dim`` →
head_size, ``max_position_embeddings`` → max_seq_len, ``rms_norm_eps`` → norm_eps,
``tie_word_embeddings``, ``rope_parameters`` (or the older ``rope_theta`` +
``rope_scaling``) → rope_theta, rope_type, rope_factor, rope_low_freq_factor,
rope_high_freq_factor, rope_original_max_len, ``sliding_window`` / ``use_sliding_window``
/ ``layer_types`` / ``max_window_layers`` → sliding_window, the experts' keys → n_experts,
top_k, aux_loss_coef (with capacity_factor 0, z_loss_coef 0: these models route
dropless, with no z-loss).
"""

from __future__ import annotations

from typing import Any

from jaxpar.hf.layout import check_keys, unsupported

#: model_type → (architecture, what it adds to a plain Llama)
VARIANTS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
#: Keys that do not change the numbers of a forward or backward pass.
NO_EFFECT = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "_name_or_path",
        "output_router_logits",
        "tokenizer_class",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "_attn_implementation_autoset",
        "attn_implementation",
        "id2label",
        "label2id",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tie_encoder_decoder",
        "problem_type",
        "task_specific_params",
        "keys_to_ignore_at_inference",
        "_sliding_window_pattern",
    }
)
#: Keys whose value must be this for jaxpar's numbers to be the folder's.
REQUIRED = {
    "hidden_act": ("silu", "jaxpar's Llama family computes SwiGLU with silu only"),
    "attention_dropout": (0.0, "jaxpar has no attention dropout"),
    "mlp_bias": (False, "jaxpar's Llama MLPs have no biases"),
    "pretraining_tp": (1, "the slice-wise matmuls of pretraining_tp > 1 are not modelled"),
    "router_jitter_noise": (0.0, "jaxpar's router adds no jitter noise"),
    "partial_rotary_factor": (1.0, "jaxpar rotates the whole head dim"),
    "use_bidirectional_attention": (False, "jaxpar's Llama family is causal"),
    "decoder_sparse_step": (1, "jaxpar puts experts in every layer of a Qwen3-MoE"),
    "mlp_only_layers": ([], "jaxpar puts experts in every layer of a Qwen3-MoE"),
    "norm_topk_prob": (
        True,
        "jaxpar's router renormalizes the top-k weights (as Mixtral "
        "and Qwen3-MoE's released checkpoints do)",
    ),
}
_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}
_WINDOW_KEYS = ("sliding_window", "use_sliding_window", "layer_types", "max_window_layers")
_MOE_KEYS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "moe_intermediate_size",
)
#: Keys :func:`settings` reads itself.
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
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "attention_bias",
        *_WINDOW_KEYS,
        *_MOE_KEYS,
    }
)
_DEFAULT_THETA = {"mixtral": 1e6}


def settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``model.*`` values of a Llama-family ``config.json`` (``model.name=llama``).

    Raises:
      DataError: one line naming a key (or value) jaxpar would compute differently.
    """
    kind = hf.get("model_type")
    if kind not in VARIANTS:
        raise unsupported(
            where, f"model_type={kind!r}: the Llama family reads " + ", ".join(VARIANTS)
        )
    check_keys(hf, where, VARIANTS[kind], MAPPED | NO_EFFECT, REQUIRED)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    out = {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "d_ff": hf["intermediate_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_size": 0 if head_dim * heads == hf["hidden_size"] else head_dim,
        "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": hf["rms_norm_eps"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": kind == "qwen2",
        "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "sliding_window": _window(hf, where),
    }
    if hf.get("attention_bias"):
        raise unsupported(
            where,
            f"attention_bias=true: {VARIANTS[kind]} then has biases on "
            "the output projection too, which jaxpar's Llama family lacks",
        )
    return out | _rope(hf, kind, where) | _experts(hf, kind, where)


def _rope(hf: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """rope_theta and the scaling, from ``rope_parameters`` or the older keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        raise unsupported(
            where,
            f"rope_parameters={params}: one rotary setting per attention "
            "kind (Gemma 3's) is not a Llama-family layout",
        )
    rope = dict(params or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", _DEFAULT_THETA.get(kind, 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    extra = sorted(set(rope) - _ROPE_KEYS)
    if rope_type not in _ROPE_TYPES or extra:
        what = f"rope_type={rope_type}" if rope_type not in _ROPE_TYPES else f"key {extra[0]}"
        raise unsupported(
            where,
            f"rotary setting {what}: jaxpar implements the rope types "
            f"{', '.join(_ROPE_TYPES)} exactly and no other",
        )
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type != "default":
        out["rope_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        out |= {
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_len": int(rope["original_max_position_embeddings"]),
        }
    return out


def _window(hf: dict[str, Any], where: str) -> int:
    """The sliding window every layer uses (0: none); a mix of windowed and full layers is
    refused (one window for all layers is what the family computes)."""
    window = hf.get("sliding_window") or 0
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None and "use_sliding_window" in hf:  # Qwen's older keys
        first = hf.get("max_window_layers", layers) if hf["use_sliding_window"] else layers
        types = ["full_attention"] * min(first, layers) + ["sliding_attention"] * max(
            layers - first, 0
        )
    if types is None:
        return int(window)
    kinds = set(types)
    if not kinds <= {"full_attention", "sliding_attention"} or len(types) != layers:
        raise unsupported(
            where,
            f"layer_types={types}: jaxpar reads full_attention and "
            "sliding_attention, one per layer",
        )
    if len(kinds) > 1:
        raise unsupported(
            where,
            "layer_types mixes sliding_attention and full_attention layers: "
            "jaxpar's Llama family gives every layer the same attention window",
        )
    return int(window) if kinds == {"sliding_attention"} else 0


def _experts(hf: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """The mixture-of-experts keys of Mixtral and Qwen3-MoE."""
    n = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if kind not in ("mixtral", "qwen3_moe"):
        if n:
            raise unsupported(
                where, f"model_type={kind} with experts: jaxpar reads mixtral's and qwen3_moe's"
            )
        return {}
    out = {
        "n_experts": int(n),
        "top_k": int(hf["num_experts_per_tok"]),
        "moe_every": 1,
        "n_shared_experts": 0,
        "capacity_factor": 0.0,
        "z_loss_coef": 0.0,
        "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if kind == "qwen3_moe":
        out["d_ff"] = hf["moe_intermediate_size"]
    return out


def hf_config(cfg: Any) -> dict[str, Any]:
    """``config.json`` of a jaxpar Llama-family config, as the variant its switches make
    it (:func:`variant`)."""
    kind = variant(cfg)
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    out = {
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
        "rope_parameters": rope,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "dtype": "float32",
        "use_cache": True,
    }
    if kind in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if kind in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window or None
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        window = "sliding_attention" if cfg.sliding_window else "full_attention"
        out |= {
            "use_sliding_window": bool(cfg.sliding_window),
            "sliding_window": cfg.sliding_window or None,
            "max_window_layers": 0,
            "layer_types": [window] * cfg.n_layers,
        }
    if cfg.n_experts:
        out |= {"num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": cfg.aux_loss_coef}
        out["num_local_experts" if kind == "mixtral" else "num_experts"] = cfg.n_experts
    if kind == "qwen3_moe":
        out |= {
            "moe_intermediate_size": cfg.d_ff,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return out


def variant(cfg: Any) -> str:
    """The Hugging Face model_type that holds a config's switches."""
    if cfg.n_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.qk_norm:
        return "qwen3"
    return "mistral" if cfg.sliding_window else "llama"


def cannot_hold(cfg: Any) -> list[str]:
    """What of a config no variant's layout holds (empty: it exports)."""
    out = []
    if cfg.n_experts and (cfg.moe_every != 1 or cfg.n_shared_experts or cfg.capacity_factor):
        out.append(
            "experts other than in every layer, dropless, without shared experts "
            "(model.moe_every=1, n_shared_experts=0, capacity_factor=0: Mixtral's "
            "and Qwen3-MoE's)"
        )
    if cfg.qkv_bias and (cfg.qk_norm or cfg.n_experts):
        out.append("q/k/v biases together with q/k norms or experts (no variant has both)")
    if cfg.sliding_window and cfg.rope_type == "llama3":
        out.append("a sliding window with llama3 rotary scaling (LlamaForCausalLM has no window)")
    return out
