"""What the layout lab knows of the ResNet (:mod:`jaxpar.models.resnet`): where its
activations cross devices under ``tensor``, and how often FSDP gathers its convolutions."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.lab.terms import LabLayout, LabModel, Term
from jaxpar.models.resnet import DEPTHS, RESNET, block_shapes


class ResNetLab(LabModel):
    """Under ``tensor``, each block all-reduces its row-parallel convolution's output in the
    forward pass and its column-parallel convolution's input gradient in the backward.
    Under ``fsdp``, XLA gathers a convolution's weights again for the backward pass."""

    gathers_outside_scans = 2

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        t = layout.sizes[Axis.TENSOR]
        if t == 1:
            return []
        rows = layout.rows
        k = layout.grad_accum
        act = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
        forward = backward = 0.0
        for h, w, c_in, width, stride, c_out in block_shapes(cfg, layout.image_shape):
            forward += rows * -(-h // stride) * -(-w // stride) * c_out * act
            # conv1's input: the block's (basic), the 1×1 reduction's output (bottleneck)
            backward += rows * h * w * (width if DEPTHS[cfg.depth][1] else c_in) * act
        over = (Axis.TENSOR,)
        return [
            Term("all-reduce", "row-parallel conv outputs (forward)", forward / k, t, k, axes=over),
            Term(
                "all-reduce",
                "column-parallel conv input gradients (backward)",
                backward / k,
                t,
                k,
                axes=over,
            ),
        ]


#: What the lab knows of the ResNet family, by family name.
LABS: dict[str, LabModel] = {RESNET.name: ResNetLab()}
