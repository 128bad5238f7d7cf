"""The ``model.*`` keys of ``model.name=llama`` and of the variants it covers by flags.

One family holds Llama 2/3.x and the decoders that differ from it by a few switches, each
a key here rather than a model file of its own (the blocks, the scan, the KV cache, the
MoE layer and the pipeline cut are the same code):

* Qwen2/2.5: ``qkv_bias`` (q, k and v projections with biases);
* Qwen3: ``qk_norm`` (an RMSNorm over each query and key head, before the rotation) and an
  explicit ``head_size`` (Qwen3's head dim is not d_model / n_heads);
* Mistral: ``sliding_window`` (each token sees the last W positions);
* Mixtral and Qwen3-MoE: ``n_experts`` / ``top_k`` (every MLP a routed mixture);
* Llama 3.1+: ``rope_type=llama3`` with its factors (:mod:`jaxpar.models.rope`).

``jaxpar/hf/llama.py`` reads and writes each variant's Hugging Face layout.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from jaxpar.errors import ConfigError
from jaxpar.models import moe
from jaxpar.models.rope import RopeScaling, RopeType
from jaxpar.models.transformer import check_heads
from jaxpar.models.transformer_config import TransformerConfig
from jaxpar.schema import Float, section


@section("model")
class LlamaConfig(TransformerConfig):
    """``model.*`` keys of ``model.name=llama``: shape and numerics."""

    n_heads: int = Field(4, ge=1, description="query heads N (divides d_model)")
    n_kv_heads: int = Field(2, ge=1, description="key/value heads K (divides n_heads)")
    head_size: int = Field(
        0, ge=0, description="head dim H (0: d_model / n_heads; Qwen3 and Gemma set their own)"
    )
    d_ff: int = Field(344, ge=1, description="SwiGLU MLP width F")
    max_seq_len: int = Field(128, ge=1, description="longest sequence (the KV cache)")
    rope_theta: Float = Field(10000.0, gt=0, description="rotary base (Llama 3: 500000)")
    rope_type: RopeType = Field(
        "default",
        description="rotary frequency scaling: default, "
        "linear (positions / rope_factor), llama3 (Llama 3.1's)",
    )
    rope_factor: Float = Field(1.0, gt=0, description="rope_type linear / llama3: the factor")
    rope_low_freq_factor: Float = Field(1.0, gt=0, description="rope_type=llama3: low_freq_factor")
    rope_high_freq_factor: Float = Field(
        4.0, gt=0, description="rope_type=llama3: high_freq_factor"
    )
    rope_original_max_len: int = Field(
        8192, ge=1, description="rope_type=llama3: original_max_position_embeddings"
    )
    qkv_bias: bool = Field(False, description="biases on the q, k and v projections (Qwen2)")
    qk_norm: bool = Field(
        False, description="RMSNorm over each query and key head before the rotation (Qwen3)"
    )
    sliding_window: int = Field(
        0,
        ge=0,
        description="each token attends to the last "
        "sliding_window positions, its own included (0: all; "
        "Mistral)",
    )
    norm_eps: Float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="output layer: the token table's transpose")
    init_from: str = Field(
        "",
        description="a Hugging Face folder (config.json + "
        "safetensors) a fresh run starts from: Llama, Qwen2, Qwen3, "
        "Mistral, Mixtral or Qwen3-MoE; the model keys come from its "
        "config.json",
    )
    n_experts: int = Field(0, ge=0, description="experts of each mixture-of-experts MLP (0: none)")
    top_k: int = Field(2, ge=1, description="experts each token is routed to")
    moe_every: int = Field(1, ge=1, description="every moe_every-th MLP is a mixture of experts")
    n_shared_experts: int = Field(
        0,
        ge=0,
        description="experts every token also passes through (one SwiGLU of that many times d_ff)",
    )
    capacity_factor: Float = Field(
        0.0,
        ge=0,
        description="0: dropless; else each expert "
        "takes at most factor · T · top_k / n_experts assignments "
        "of a sequence (the rest are dropped and counted)",
    )
    aux_loss_coef: Float = Field(0.01, ge=0, description="weight of the load-balancing loss")
    z_loss_coef: Float = Field(0.001, ge=0, description="weight of the router z-loss")
    moe_dispatch: moe.Dispatch = Field(
        "all_gather",
        description="experts' token dispatch: all_gather (any backend), all_to_all (GPU, TPU)",
    )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def rope_scaling(self) -> RopeScaling:
        return RopeScaling(
            self.rope_type,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    @model_validator(mode="after")
    def _heads(self) -> LlamaConfig:
        if not self.head_size:
            check_heads(self, rotary=True)
        elif self.head_size % 2:
            raise ConfigError(
                f"model.head_size={self.head_size}: rotary positions need an "
                "even head dim; pick an even one"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model."
                f"n_heads={self.n_heads}: each key/value head serves a group of "
                "query heads; pick a divisor of n_heads"
            )
        self._rope_keys_take_effect()
        if self.n_experts and self.top_k > self.n_experts:
            raise ConfigError(
                f"model.top_k={self.top_k} is more than model.n_experts="
                f"{self.n_experts}: route each token to at most n_experts"
            )
        if self.n_experts and self.n_layers % self.moe_every:
            raise ConfigError(
                f"model.moe_every={self.moe_every} does not divide "
                f"model.n_layers={self.n_layers}; pick a divisor"
            )
        return self

    def _rope_keys_take_effect(self) -> None:
        """A rotary factor the chosen ``rope_type`` does not read is refused, not ignored."""
        unread = {"rope_factor": 1.0} if self.rope_type == "default" else {}
        if self.rope_type != "llama3":
            unread |= {
                "rope_low_freq_factor": 1.0,
                "rope_high_freq_factor": 4.0,
                "rope_original_max_len": 8192,
            }
        for key, default in unread.items():
            if getattr(self, key) != default:
                raise ConfigError(
                    f"model.{key}={getattr(self, key)} has no effect with "
                    f"model.rope_type={self.rope_type}; set the rope_type that "
                    "reads it, or drop it"
                )

    @property
    def group(self) -> int:  # layers a scan step runs: moe_every (the last MoE), 1 if dense
        return self.moe_every if self.n_experts else 1
