"""The ``model.*`` keys every transformer family has: GPT, BERT, the Llama family (Qwen,
Mistral, mixtures of experts) and Gemma.

Each family's config extends :class:`TransformerConfig` and adds its own keys; it
redeclares a shared key only where its default or its doc differs (BERT's vocabulary holds
a mask token; a Llama's MLP is a SwiGLU of its own width).
"""

from __future__ import annotations

from pydantic import Field

from jaxpar.models.family import Dtype, ModelConfig
from jaxpar.models.fp8 import Fp8Scaling, Precision
from jaxpar.models.transformer import Attention, Remat
from jaxpar.schema import section


@section("model")
class TransformerConfig(ModelConfig):
    """The shape and numerics of a transformer: the keys its families share."""

    vocab_size: int = Field(256, ge=1, description="vocabulary (at least the data's)")
    d_model: int = Field(128, ge=1, description="width D")
    n_layers: int = Field(4, ge=1, description="transformer blocks L")
    n_heads: int = Field(4, ge=1, description="attention heads N (divides d_model)")
    d_ff: int = Field(512, ge=1, description="MLP width F")
    max_seq_len: int = Field(128, ge=1, description="longest sequence")
    remat: Remat = Field("none", description="what each block recomputes in the backward pass")
    dtype: Dtype = Field("float32", description="compute dtype (parameters stay float32)")
    attention: Attention = Field(
        "auto",
        description="jax.nn.dot_product_attention's "
        "implementation (auto: cuDNN on a GPU where it runs, XLA "
        "elsewhere)",
    )
    precision: Precision = Field(
        "default",
        description="the weight matmuls' precision (fp8: E4M3 operands, E5M2 gradients; "
        "embedding, logits and attention's own products stay in model.dtype)",
    )
    fp8_scaling: Fp8Scaling = Field(
        "current",
        description="FP8 scale of each tensor: from its amax in this step (current), or "
        "from the largest amax of its last model.fp8_history steps (delayed: Transformer "
        "Engine's recipe; the histories are model state, saved with checkpoints)",
    )
    fp8_history: int = Field(
        1024,
        ge=1,
        description="steps of amax history per tensor under model.fp8_scaling=delayed "
        "(Transformer Engine's and Flax's default length)",
    )

    @property
    def head_dim(self) -> int:
        """H: the width each head attends over."""
        return self.d_model // self.n_heads
