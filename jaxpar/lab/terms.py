"""What the layout lab's prediction is made of: a collective (:class:`Term`), the layout as
a family's lab module sees it (:class:`LabLayout`), and what the lab knows of a model
family's activations (:class:`LabModel`).

The lab predicts the gradient and weight collectives of any model from its shardings alone
(:mod:`jaxpar.lab.predict`); where a model's *activations* cross devices is knowledge of
the model. The lab keeps that knowledge itself, one module per family (or one for the
transformer families), registered by family name (:mod:`jaxpar.lab.families`): a model
file holds only the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Term:
    """One collective of a train step the layout lab predicts: what it moves, how often,
    over how many devices."""

    kind: str
    what: str
    payload_bytes: float
    group: int
    times: int = 1
    #: it runs while the matmuls it feeds compute (a collective matmul's sends): the step
    #: time counts it only where it outlasts the compute
    hidden: bool = False
    #: the mesh axes its group spans (``group`` is the product of their degrees), which
    #: place it on the NVLink domains or across the network (:mod:`jaxpar.lab.network`);
    #: empty where unknown: costed inside one domain
    axes: tuple[str, ...] = ()

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends for all ``times`` executions (ring algorithms)."""
        n, s = self.group, self.payload_bytes
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(
            self.kind, (n - 1) / n
        )
        return self.times * s * factor


@dataclass(frozen=True)
class Matmul:
    """One matmul of a step's forward pass on one device: ``[m, k] @ [k, n]``, run
    ``times`` a step (a batched one: once per batch element). Its backward runs two of the
    same FLOPs and sizes (:mod:`jaxpar.lab.kernels`)."""

    m: float
    n: float
    k: float
    times: float = 1
    #: its operands are FP8 (``model.precision=fp8``'s weight matmuls)
    fp8: bool = False

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.times

    def bytes(self, itemsize: int, result_itemsize: int | None = None) -> float:
        """HBM bytes its operands and result move, all ``times`` (the result's elements
        at ``result_itemsize``, by default the operands')."""
        result = self.m * self.n * (result_itemsize or itemsize)
        return ((self.m * self.k + self.k * self.n) * itemsize + result) * self.times


@dataclass(frozen=True)
class LabLayout:
    """What the layout lab tells a family's lab module about one layout (plain values).

    Attributes:
      sizes: the mesh degrees by axis.
      rules: logical axis name → mesh axes.
      rows: examples per device per step (the global batch over the batch axes).
      grad_accum: microbatches accumulated per step.
      stages: ``(ticks, p, v, m)`` of the pipeline's tick table, or None.
      sub_mesh: the sub-mesh pipeline (``pipeline.executor=mpmd``) runs the layout: a
        program per action, and the lab reports a device of its first stage.
      seq_len: tokens per example (text), image_shape: ``(H, W, C)`` (images).
      cpu: the program is XLA:CPU's (bfloat16 activations move as float32).
      context: how attention runs across a split sequence (``context.attention``:
        ``all_gather``, ``ring`` or ``ulysses``).
      residuals: the sub-mesh pipeline's backward programs read the forward's residuals
        (``pipeline.backward=residuals``) rather than recompute it.
      tensor_overlap: how tensor parallelism's communication overlaps the matmuls
        (``tensor.overlap``: ``none``, ``collective_matmul`` or ``xla``).
      in_flight: the most microbatches (chunks × microbatches with virtual stages) whose
        forward a pipeline's device has run and whose backward it has not: it holds
        their activations at once (1 without a pipeline).
    """

    sizes: Mapping[str, int]
    rules: Mapping[str, tuple[str, ...]]
    rows: int
    grad_accum: int
    stages: tuple[int, int, int, int] | None
    seq_len: int = 0
    image_shape: tuple[int, ...] | None = None
    cpu: bool = False
    sub_mesh: bool = False
    context: str = "all_gather"
    residuals: bool = False
    tensor_overlap: str = "none"
    #: the most microbatches whose activations a device of the pipeline holds at once
    in_flight: int = 1


def fp8_itemsize(cpu: bool) -> int:
    """The bytes an FP8 element moves between devices: 1, but 2 on XLA:CPU, whose
    float-normalization passes widen FP8 collectives to float16 after the partitioner
    has placed them on the FP8 tensors (measured)."""
    return 2 if cpu else 1


class TableReads(NamedTuple):
    """How a family reads its top-level parameters' tables in a layout
    (:meth:`LabModel.table_reads`): ``whole``, gathered over every axis (their gradient
    reduced before it is sliced); ``at_once``, by a ``shard_map`` whose transpose sums
    their gradient over every axis that splits the tokens in one all-reduce (a lookup
    where the rows lie); ``apart``, those of ``at_once`` read again outside it (a tied
    output layer), whose gradient XLA reduces apart as any weight's; ``copies``, those of
    ``at_once`` read as a copy per batch shard, whose transpose sums the gradient over the
    sequence's axes only and XLA then over the batch's."""

    whole: frozenset[str] = frozenset()
    at_once: frozenset[str] = frozenset()
    apart: frozenset[str] = frozenset()
    copies: frozenset[str] = frozenset()


class LabModel:
    """A model family's activations for the layout lab's textbook prediction
    (:mod:`jaxpar.lab.predict`), from its config and a :class:`LabLayout`. This base knows
    nothing: a family without a lab module (a user's, or a task without a family) gets no
    activation terms, and its parameters are gathered and reduced as their shardings say.
    """

    #: top-level parameter keys that the model reads whole (gathered over every axis) even
    #: where the rules shard them, so their gradient is reduced before it is sliced
    whole_params: frozenset[str] = frozenset()

    def table_reads(self, cfg: Any, layout: LabLayout) -> TableReads:
        """How the model reads its tables in ``layout`` (this base: :attr:`whole_params`
        whole)."""
        return TableReads(whole=self.whole_params)

    #: how often FSDP gathers a weight outside a layer scan per step: XLA keeps one gathered
    #: copy for the backward pass (1, measured for the transformers and small CNNs) or gathers
    #: it again there (2, ZeRO-3's textbook count; measured for the ResNet's convolutions)
    gathers_outside_scans: int = 1
    #: whether the family names its residual stream ``("batch", "act_seq", …)``, so that
    #: sequence parallelism (``tensor.sequence``) changes its layout: the sweep and the
    #: planner then offer it
    sequence_parallel: bool = False
    #: the parameters, by name, that the family's FP8 matmuls read (``model.precision=
    #: fp8``): quantized before FSDP gathers them, so gathered at :func:`fp8_itemsize`
    fp8_weights: frozenset[str] = frozenset()
    #: copies of its stacked layers' parameter bytes a step holds beside their gradients
    #: under ``model.remat=full`` (0: none beyond the gradients)
    remat_layer_copies: int = 0

    def activation_bytes(self, cfg: Any, layout: LabLayout) -> float | None:
        """Bytes of the activations one device holds at the peak of a step (what the
        compiled program's temporaries mostly are), or None where the family does not
        say (:mod:`jaxpar.lab.analytic` then judges memory on the state alone)."""
        return None

    def matmuls(self, cfg: Any, layout: LabLayout) -> list[Matmul]:
        """The forward pass's matmuls on one device over one step (none known: the step's
        FLOPs run at the profile's achievable rate whatever their shapes)."""
        return []

    def recomputed_share(self, cfg: Any, layout: LabLayout, policy: str = "full") -> float:
        """The share of a layer's forward FLOPs that recomputing it for the backward under
        the ``model.remat`` ``policy`` runs again (1: all of it, where the family does not
        say)."""
        return 1.0

    def fused_backward_share(self, cfg: Any, layout: LabLayout) -> float:
        """The share of a layer's forward FLOPs that a fused kernel's backward computes
        beyond the backward XLA derives (0: none)."""
        return 0.0

    def unsplit_flops(self, cfg: Any, layout: LabLayout) -> float:
        """Training FLOPs a device computes beyond its share of the family's count: for
        weights its layout holds whole where the rules would split them, and what the
        platform computes beyond the count (XLA:CPU's dense products for a mixture of
        experts' grouped ones, where ``layout.cpu``) (0: none)."""
        return 0.0

    def elementwise_bytes(self, cfg: Any, layout: LabLayout) -> float:
        """HBM bytes one device's kernels other than matmuls (norms, activations, softmax,
        residual adds) move in one step, forward and backward (0: not known)."""
        return 0.0

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        """Activation collectives under tensor parallelism."""
        return []

    def context_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        """Activation collectives of a sequence split over devices (``mesh.context``)."""
        return []

    def expert_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        """Token dispatch to experts split over devices (``rules.experts``)."""
        return []

    def scan_group(self, cfg: Any) -> int:
        """The layers one step of the family's layer scan runs (1), whose per-layer
        collectives (a gradient reduction, FSDP's gathers) XLA combines into one."""
        return 1
