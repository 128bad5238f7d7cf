"""The FLOPs of one HLO instruction (:func:`instruction_flops`): a ``dot`` or a
``convolution``, and on a GPU the custom calls XLA makes instead — matrix products handed to
cuBLAS (a gemm's backend config names its contracting dims as a ``dot`` does), attention
handed to cuDNN's fused kernel (two products forward, five backward over the scores;
``benchmarks/`` keeps a step compiled for an H200, ``tests/test_hlo.py``) and convolutions
handed to cuDNN (forward, backward-input, backward-filter: each the forward's FLOPs).
"""

from __future__ import annotations

import math
import re

from jaxpar.hlo_text import Instruction, arrays


def _dims(attrs: str, key: str) -> list[int]:
    match = re.search(rf"{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


#: a GPU program's matrix products that XLA hands to a library as a custom call (cuBLAS,
#: cuBLASLt, FP8 included): the first result is the product, the first two operands its
#: factors, and the backend config names the contracting dimensions as a dot would
_GEMM_TARGETS = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


#: cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``): the
#: matrix products of one pass over its [B, N, T, S] scores, each 2·B·N·T·S·D FLOPs (D the
#: head dim) as the full product counts them — a causal kernel skips the masked tiles. The
#: forward's two (scores, weighted values); the backward's five, FlashAttention-2's: the
#: scores again, then the gradients of the probabilities, values, queries and keys.
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')
_FMHA_PRODUCTS = {"forward": 2, "backward": 5}
_SCORES = re.compile(r'"intermediate_tensor_shape":\{"dimensions":\[([^\]]*)\]')


def _fused_attention_flops(inst: Instruction, types: dict[str, str]) -> float:
    """FLOPs of a cuDNN fused-attention call: the scores' [B, N, T, S] from its backend
    config, the head dim from its first operand (the queries, [B, T, N, D])."""
    scores = _SCORES.search(inst.attrs)
    queries = arrays(types.get(inst.operands[0], "")) if inst.operands else []
    if not scores or not queries:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", scores.group(1))]
    head_dim = math.prod(queries[0][1]) / math.prod(dims[:-1])
    which = "backward" if "Backward" in _FMHA.search(inst.attrs).group() else "forward"
    return 2.0 * _FMHA_PRODUCTS[which] * math.prod(dims) * head_dim


#: cuDNN's convolutions. XLA's conv rewriter gives each the forward convolution's window and
#: dimension labels, whatever it computes (``xla/service/gpu/transforms/conv_rewriter.cc``),
#: so each does the forward's multiply-adds; what differs is where the forward's output and
#: kernel are: (input, kernel) → output forward (a bias and activation fused in or not);
#: (output gradient, kernel) → input gradient; (input, output gradient) → kernel gradient.
_CUDNN_CONV = re.compile(
    r'custom_call_target="__cudnn\$conv(Forward|BiasActivationForward|ForwardGraph|'
    r'BackwardInput|BackwardFilter)"'
)
#: where the forward's output and kernel are: an operand's index, or None for the result
#: (``__cudnn$convReorderFilter…``, an int8 filter's layout change, computes nothing)
_CONV_ARRAYS = {"BackwardInput": (0, 1), "BackwardFilter": (1, None)}


def _cudnn_conv_flops(inst: Instruction, types: dict[str, str], kind: str) -> float:
    """FLOPs of a cuDNN convolution call (``kind``: the target's suffix): its forward's."""

    def dims(at: int | None) -> tuple[int, ...]:
        if at is None:
            found = arrays(inst.type)
        else:
            found = arrays(types.get(inst.operands[at], "")) if len(inst.operands) > at else []
        return found[0][1] if found else ()

    out, kernel = (dims(at) for at in _CONV_ARRAYS.get(kind, (None, 1)))
    return _convolution_flops(out, kernel, inst.attrs) if out and kernel else 0.0


def _convolution_flops(out: tuple[int, ...], kernel: tuple[int, ...], attrs: str) -> float:
    """2 × the output's elements × a kernel's elements per output feature (its window times
    the input features of its group), less the zeros an input gradient reads."""
    labels = re.search(r"dim_labels=\w+_(\w+)->", attrs)
    out_features = kernel[labels.group(1).index("o")] if labels and kernel else 1
    # An input gradient of a strided convolution reads its output gradient with zeros
    # inserted (lhs_dilate=s): of each window only 1/s per dim is data, as a GPU's
    # backward-data kernel computes it.
    dilate = re.search(r"lhs_dilate=([\dx]+)", attrs)
    zeros = math.prod(int(d) for d in dilate.group(1).split("x")) if dilate else 1
    return 2.0 * math.prod(out) * math.prod(kernel) / max(out_features, 1) / zeros


def _contracting(inst: Instruction) -> list[int]:
    """A dot's (``lhs_contracting_dims={…}``) or a library gemm's contracting dims."""
    if inst.opcode == "dot":
        return _dims(inst.attrs, "lhs_contracting_dims")
    found = _GEMM_CONTRACT.search(inst.attrs)
    return [int(d) for d in re.findall(r"\d+", found.group(1))] if found else []


def instruction_flops(inst: Instruction, types: dict[str, str]) -> float:
    """2 × multiply-adds of a dot, a convolution, or a GPU's library call in their place:
    a cuBLAS gemm, cuDNN's fused attention or convolution (0 for anything else)."""
    custom = inst.opcode == "custom-call"
    gemm = custom and _GEMM_TARGETS.search(inst.attrs)
    if custom and _FMHA.search(inst.attrs):
        return _fused_attention_flops(inst, types)
    conv = custom and _CUDNN_CONV.search(inst.attrs)
    if conv:
        return _cudnn_conv_flops(inst, types, conv.group(1))
    if inst.opcode not in ("dot", "convolution") and not gemm:
        return 0.0
    out = arrays(inst.type)
    if not out or len(inst.operands) < 2:
        return 0.0
    out_elems = math.prod(out[0][1])
    lhs, rhs = (arrays(types.get(o, "")) for o in inst.operands[:2])
    if inst.opcode != "convolution":
        lhs_dims = lhs[0][1] if lhs else ()
        contract = math.prod(lhs_dims[d] for d in _contracting(inst))
        return 2.0 * out_elems * contract
    return _convolution_flops(out[0][1], rhs[0][1] if rhs else (), inst.attrs)
