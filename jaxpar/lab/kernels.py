"""What a step's kernels achieve on a GPU, beside its FLOPs: how fast its matmuls run for
their shapes, and how long the kernels that are not matmuls take.

**Matmuls.** No matmul reaches the datasheet's peak: the best shapes a brute-force search
finds reach a share of it, the chip's MAMF (:attr:`~jaxpar.lab.hardware.Hardware.
matmul_efficiency`, each figure's source in ``hardware.yaml``). A matmul of ``[m, k] @
[k, n]`` is priced on the roofline of its own arithmetic intensity (NVIDIA's "GPU
Performance Background" and "Matrix Multiplication Background" user guides: a GEMM is
math-limited where its FLOPs over the bytes of its operands and result exceed the chip's
ops:byte ratio, memory-limited below)::

    time = max(2·m·n·k / (peak · MAMF share),  (m·k + k·n + m·n) · itemsize / HBM)

and the step's matmuls together run at :func:`shape_efficiency` of the achievable rate:
their FLOPs' time at that rate over the sum of their times. The family's lab module names
the matmuls (:meth:`~jaxpar.lab.terms.LabModel.matmuls`: the forward's; each has two of
the same size in the backward); a model without one runs at the achievable rate. Those
it marks FP8 (``model.precision=fp8``'s weight matmuls) run at the chip's FP8 rate and its
measured share of it (``flops_fp8``, ``matmul_efficiency_fp8``), on that rate's own
roofline with one-byte operands; at the bf16 rate where the chip has no FP8 one.

**The other kernels** (norms, activations, softmax, dropout, residual adds) are limited by
HBM bandwidth and run between the matmuls, so their time adds to the matmuls'
(:attr:`~jaxpar.lab.hardware.StepTime.elementwise_s`): the bytes the family's lab module
counts (:meth:`~jaxpar.lab.terms.LabModel.elementwise_bytes`, from the activations it
keeps) over the HBM bandwidth, stretched in a pipeline as its FLOPs are. A fitted CPU
profile (:mod:`jaxpar.lab.fit`) prices the step as fitted, without either.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from jaxpar.axes import Axis
from jaxpar.lab.activations import remat_of
from jaxpar.lab.families import lab_for
from jaxpar.lab.hardware import Hardware, Kernels
from jaxpar.lab.pipeline_cost import layer_share, pipeline_stretch
from jaxpar.lab.predict import lab_layout
from jaxpar.lab.terms import Matmul
from jaxpar.run import Run


def shape_efficiency(
    matmuls: Sequence[Matmul], itemsize: int, rate: float, hbm: float, fp8_rate: float = 0.0
) -> float:
    """The share of the achievable rate ``matmuls`` run at together, each on its own
    roofline: their time at the achievable FLOP/s (``rate``; FP8 ones at ``fp8_rate``
    with one-byte operands, where the chip has one) over the sum of their times, each the
    longer of that and its bytes over the HBM's bytes/s (``hbm``)."""
    ideal = actual = 0.0
    for mm in matmuls:
        fp8 = mm.fp8 and fp8_rate > 0
        at_rate = mm.flops / (fp8_rate if fp8 else rate)
        ideal += at_rate
        # an FP8 matmul reads one-byte operands and writes its result in the compute dtype
        actual += max(at_rate, mm.bytes(1 if fp8 else itemsize, itemsize) / hbm)
    return ideal / actual if actual else 1.0


def kernels(run: Run, hw: Hardware, dtype: str, asynchronous: bool = False) -> Kernels:
    """The step's matmul shape efficiency and other kernels' bytes on ``hw`` (nothing on a
    fitted profile or a CPU's: it prices the step as fitted, :attr:`Hardware.as_fitted`);
    in a pipeline the bytes are stretched as its FLOPs are
    (:func:`~jaxpar.lab.pipeline_cost.pipeline_stretch`, ``asynchronous`` as there)."""
    if hw.as_fitted:
        return Kernels()
    lab = lab_for(run.family)
    layout = lab_layout(run, cpu=False)
    cfg = run.config.model
    matmuls = lab.matmuls(cfg, layout)
    efficiency = shape_efficiency(
        matmuls,
        jnp.dtype(dtype).itemsize,
        hw.peak_flops(dtype) * hw.matmul_efficiency,
        hw.hbm_bandwidth,
        hw.flops_fp8 * hw.matmul_efficiency_fp8,
    )
    flops = sum(m.flops for m in matmuls)
    fp8 = sum(m.flops for m in matmuls if m.fp8) / flops if flops else 0.0
    moved = lab.elementwise_bytes(cfg, layout) * pipeline_stretch(run, asynchronous)
    return Kernels(efficiency, moved, fp8)


def recomputed(run: Run, gpu: bool) -> float:
    """A step's FLOPs over those it would have without recomputation: 1 + the stacked
    layers' share of them × what the model's ``model.remat`` runs again of a layer (a third
    of a layer's share is its forward) — and on a GPU (``gpu``), where attention may run as
    cuDNN's fused kernel, what that kernel adds: its forward again under a recomputing
    policy, the scores again in its backward."""
    return 1 + layer_share(run) * _again(run, gpu) / 3


def gpu_flops_factor(run: Run) -> float:
    """A GPU step's FLOPs over those of the step XLA:CPU compiles for the same layout: the
    extra products of cuDNN's fused attention kernel, which XLA:CPU writes out; a mixture
    of experts' grouped matmuls, which XLA:CPU computes densely over every local expert
    (:mod:`jaxpar.lab.experts`); 1 where neither runs or the family counts no FLOPs."""
    gpu, cpu = flops_per_device(run, gpu=True), flops_per_device(run, gpu=False)
    return gpu / cpu if gpu and cpu else 1.0


def model_flops_per_device(run: Run) -> float | None:
    """The model's FLOPs for the step's examples (the family's count: forward and backward,
    nothing recomputed, no pipeline bubble, no weight computed twice) over the devices: what
    MFU divides by the step and the peak (None: the family does not count them)."""
    family = run.family
    if family is None or family.counts is None:
        return None
    per_example = family.counts(run.config.model, run.data).train_flops_per_example
    return per_example * run.config.train.batch_size / run.plan.mesh.size


def flops_per_device(run: Run, asynchronous: bool = False, gpu: bool = True) -> float | None:
    """The step's FLOPs on one device (None: the family does not count them);
    ``asynchronous``: its pipeline's stages run as the sub-mesh executor runs them
    (:func:`~jaxpar.lab.pipeline_cost.pipeline_stretch`); ``gpu``: on a GPU, where
    attention may run as cuDNN's fused kernel (elsewhere as XLA computes it)."""
    family = run.family
    if family is None or family.counts is None:
        return None
    plan = run.plan
    sizes = plan.mesh.shape
    per_example = family.counts(run.config.model, run.data).train_flops_per_example
    split = plan.batch_ways() * sizes[Axis.CONTEXT] * sizes[Axis.TENSOR] * sizes[Axis.STAGE]
    flops = per_example * run.config.train.batch_size / split
    lab, layout = lab_for(family), lab_layout(run, cpu=not gpu)
    # and what a device computes beyond its share (weights held whole)
    flops += lab.unsplit_flops(run.config.model, layout)
    flops *= pipeline_stretch(run, asynchronous)
    return flops * recomputed(run, gpu)


def _again(run: Run, gpu: bool) -> float:
    """The share of a layer's forward FLOPs a step runs again: what ``model.remat``
    recomputes, and what a fused attention kernel's backward adds (:func:`recomputed`)."""
    lab, layout = lab_for(run.family), lab_layout(run, cpu=not gpu)
    cfg = run.config.model
    policy = remat_of(cfg)
    again = lab.recomputed_share(cfg, layout, policy) if policy != "none" else 0.0
    return again + lab.fused_backward_share(cfg, layout)
