"""The ``model.*`` keys of ``model.name=gemma``: Gemma 2 and Gemma 3 text decoders.

What sets them apart from a Llama (and is a key here):

* ``sliding_window`` with ``sliding_window_pattern`` P: layer i (from 0) attends to the
  whole past when (i + 1) is a multiple of P, to the last ``sliding_window`` positions
  otherwise (Gemma 2: P = 2; Gemma 3: P = 6; P = 0: every layer windowed);
* a rotary base per kind of layer: ``rope_theta`` (and ``rope_type=linear`` with
  ``rope_factor``) on the full-attention layers, ``rope_local_theta`` on the windowed ones
  (Gemma 3: 1e6 and 1e4; Gemma 2: one base for both);
* ``query_pre_attn_scalar``: the attention scale is its −½ power, not the head dim's;
* ``attn_softcap`` / ``final_softcap``: cap · tanh(x / cap) on the attention logits and
  on the output logits (Gemma 2: 50 and 30; 0: none);
* ``qk_norm``: a (1 + w) RMSNorm over each query and key head (Gemma 3).

Every Gemma also scales the embeddings by √d_model, normalizes with (1 + w) RMSNorms
before and after attention and the MLP, and gates a GELU (tanh form) MLP.
``jaxpar/hf/gemma.py`` reads and writes the Hugging Face layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from jaxpar.errors import ConfigError
from jaxpar.models.rope import RopeScaling
from jaxpar.models.transformer import Attention
from jaxpar.models.transformer_config import TransformerConfig
from jaxpar.schema import Float, section

#: ``model.rope_type`` values of the Gemma family (its checkpoints use no other).
GemmaRope = Literal["default", "linear"]


@section("model")
class GemmaConfig(TransformerConfig):
    """``model.*`` keys of ``model.name=gemma``: shape and numerics."""

    n_heads: int = Field(4, ge=1, description="query heads N")
    n_kv_heads: int = Field(2, ge=1, description="key/value heads K (divides n_heads)")
    head_size: int = Field(
        0, ge=0, description="head dim H (0: d_model / n_heads; Qwen3 and Gemma set their own)"
    )
    d_ff: int = Field(344, ge=1, description="gated GELU MLP width F")
    max_seq_len: int = Field(128, ge=1, description="longest sequence (the KV cache)")
    rope_theta: Float = Field(
        10000.0, gt=0, description="rotary base of the full-attention layers (Gemma 3: 1e6)"
    )
    rope_local_theta: Float = Field(
        10000.0, gt=0, description="rotary base of the sliding-window layers (Gemma 2: rope_theta)"
    )
    rope_type: GemmaRope = Field(
        "default",
        description="rotary scaling of the "
        "full-attention layers: default, linear (positions / "
        "rope_factor)",
    )
    rope_factor: Float = Field(1.0, gt=0, description="rope_type=linear: the factor")
    sliding_window: int = Field(
        0,
        ge=0,
        description="a windowed layer attends to the last "
        "sliding_window positions, its own included (0: no window)",
    )
    sliding_window_pattern: int = Field(
        2,
        ge=0,
        description="every sliding_window_pattern"
        "-th layer attends to the whole past, the others "
        "through the window (0: every layer windowed)",
    )
    query_pre_attn_scalar: Float = Field(
        0.0, ge=0, description="attention scale query_pre_attn_scalar^-0.5 (0: the head dim)"
    )
    attn_softcap: Float = Field(
        0.0, ge=0, description="attention logits capped to cap·tanh(x/cap) (0: none; Gemma 2: 50)"
    )
    final_softcap: Float = Field(
        0.0, ge=0, description="output logits capped to cap·tanh(x/cap) (0: none; Gemma 2: 30)"
    )
    qk_norm: bool = Field(
        False,
        description="(1 + w) RMSNorm over each query and key head before the rotation (Gemma 3)",
    )
    norm_eps: Float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(True, description="output layer: the token table's transpose")
    attention: Attention = Field(
        "auto",
        description="jax.nn.dot_product_attention's "
        "implementation (auto: cuDNN on a GPU where it runs, XLA "
        "elsewhere; soft-capped attention is written out in jnp)",
    )
    init_from: str = Field(
        "",
        description="a Hugging Face folder (config.json + "
        "safetensors) a fresh run starts from: Llama, Qwen2, Qwen3, "
        "Mistral, Mixtral, Qwen3-MoE, Gemma 2 or Gemma 3 text; the model "
        "keys come from its config.json",
    )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def qkv_bias(self) -> bool:  # what the Llama's attention_params asks: Gemma has none
        return False

    @property
    def scale(self) -> float:
        """The attention logits' scale."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def pattern(self) -> tuple[LayerKind, ...]:
        """The kinds of consecutive layers that repeat through the model: layer i is of
        kind ``pattern[i % len(pattern)]``."""
        H, eps = self.head_dim, self.norm_eps
        full = LayerKind(0, H, eps, self.rope_theta, RopeScaling(self.rope_type, self.rope_factor))
        if not self.sliding_window or self.sliding_window_pattern == 1:
            return (full,)
        local = LayerKind(self.sliding_window, H, eps, self.rope_local_theta)
        if not self.sliding_window_pattern:
            return (local,)
        return (local,) * (self.sliding_window_pattern - 1) + (full,)

    @model_validator(mode="after")
    def _heads(self) -> GemmaConfig:
        if not self.head_size and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model."
                f"n_heads={self.n_heads}; change one, or set model.head_size"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model.head_size={self.head_dim}: rotary positions need an "
                "even head dim; pick an even one"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model."
                f"n_heads={self.n_heads}: each key/value head serves a group of "
                "query heads; pick a divisor of n_heads"
            )
        return self


@dataclass(frozen=True)
class LayerKind:
    """What one kind of attention layer fixes at trace time: its window (0: the whole
    past) and its rotary frequencies — with the head dim and the norm epsilon, all that
    :func:`jaxpar.models.llama_attention.qkv` reads of a config."""

    window: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()
