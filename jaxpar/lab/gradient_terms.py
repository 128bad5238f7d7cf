"""A step's gradient reductions and FSDP weight gathers, per parameter, from its sharding
alone (the first two items of :mod:`jaxpar.lab.predict`'s accounting; the sequence's
axes sum gradients as the batch axes do, reduced over them first, then over the batch
axes).

Wire bytes per device under ring algorithms, as :mod:`jaxpar.hlo` measures a compiled
program: a parameter's gradient is partial over every batch axis (``data``, ``fsdp``) and,
in a pipeline, over ``stage`` for parameters outside the stacked layers. Axes that shard
the parameter reduce-scatter it (FSDP: (n−1)/n·S, per microbatch with
``train.grad_accum``; XLA:CPU all-reduces and slices instead); the others all-reduce what
is left (2(n−1)/n·S), once per step (per microbatch only where
:attr:`~jaxpar.plan.Plan.accumulates_per_data_shard` is false). Every parameter sharded
over a batch axis is all-gathered before use: in the forward and again in the backward
scan for the stacked layers (ZeRO-3), once for the others; a weight an FP8 matmul reads is
quantized before its gather (:func:`jaxpar.lab.terms.fp8_itemsize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxpar.axes import BATCH_AXES, Axis
from jaxpar.buckets import groups
from jaxpar.lab.stage_reads import read_outside_stack
from jaxpar.lab.terms import LabModel, TableReads, Term, fp8_itemsize
from jaxpar.logical import LAYERS, SEQ, spec_axes, spec_leaves
from jaxpar.pipeline.views import STACKED, WHOLE
from jaxpar.plan import Plan


class _Leaf(NamedTuple):
    """A parameter as the gradient terms see it (:func:`_param_leaves`)."""

    key: str | None
    nbytes: float
    axes: tuple[str, ...]
    scanned: bool
    own: tuple[str, ...]
    rank: int
    gathered: float = 1.0


def _param_leaves(plan: Plan, batch: dict, fp8: frozenset[str], cpu: bool) -> list[_Leaf]:
    """(top-level key — None for a parameter another stage of the sub-mesh pipeline
    holds —, bytes, mesh axes sharding it, stacked on ``layers``, the axes that
    split its experts, its dims a layer) per parameter. A stacked parameter runs in a layer
    scan: FSDP gathers it in the forward scan and again in the backward scan (the scan keeps
    the shards, not the gathered weights). A device keeps its own experts (never gathered)
    and their gradients whole (the dispatch brought them every token routed to them) — but
    in the spmd pipeline, whose stages take them in gathered as FSDP's weights. A weight
    named in ``fp8`` is quantized before it is gathered: ``gathered`` is the bytes its
    gathers move per byte it holds."""
    leaves = jax.tree_util.tree_leaves_with_path(plan.model.params)
    names = jax.tree.leaves(plan.model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    mine = _held_by_heaviest_stage(plan, len(leaves), batch)
    own_experts = plan.pipeline is None or plan.executor == "mpmd"
    return [
        _Leaf(
            str(getattr(path[0], "key", "")) if held else None,
            math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize,
            spec_axes(spec),
            LAYERS in axes,
            plan.rules.get("experts", ()) if "experts" in axes and own_experts else (),
            leaf.ndim - (LAYERS in axes),
            _gathered(path, leaf, fp8, cpu),
        )
        for (path, leaf), spec, axes, held in zip(
            leaves, spec_leaves(plan.param_specs), names, mine
        )
    ]


def _gathered(path: Any, leaf: Any, fp8: frozenset[str], cpu: bool) -> float:
    """The bytes a gather of ``leaf`` moves per byte of it (FP8: :func:`fp8_itemsize`)."""
    if str(getattr(path[-1], "key", "")) not in fp8:
        return 1.0
    return fp8_itemsize(cpu) / np.dtype(leaf.dtype).itemsize


def _held_by_heaviest_stage(plan: Plan, n: int, batch: dict) -> list[bool]:
    """Which parameters a device of the sub-mesh pipeline's heaviest stage holds and
    reduces the gradient of (all of them under another executor): its own layers', and of
    the parameters outside a stack those its embedding (first stage) or head (last stage)
    reads."""
    if plan.executor != "mpmd":
        return [True] * n
    ex = plan.gradients
    stage = ex.heaviest_stage
    homes = jax.tree.leaves(ex.homes.params)
    read = read_outside_stack(plan, stage, batch) if WHOLE in homes else set()
    return [
        home == stage or home == STACKED or (home == WHOLE and i in read)
        for i, home in enumerate(homes)
    ]


def _gathers(plan: Plan, pipelined: bool, scanned: bool, outside: int) -> int:
    """How often FSDP all-gathers one weight per step.

    The spmd pipeline gathers every weight once, at the executor's entry; so does
    ``train.fsdp_gather=once``, before the accumulation loop. The sub-mesh pipeline runs a
    program per action, each gathering its chunk's weights: forward and backward (or its
    two halves) of every microbatch. Otherwise a weight in a layer scan is gathered by each
    microbatch's forward and backward scans, and one outside the scans ``outside`` times
    per step, however many microbatches: its gather is loop-invariant, and XLA hoists it
    out of the accumulation loop.
    """
    accum = plan.grad_accum
    if plan.executor == "mpmd":
        return plan.microbatches * len({a.kind for a in plan.pipeline.tick})
    if pipelined or (accum > 1 and plan.fsdp_gather_once):
        return 1
    return 2 * accum if scanned else outside


@dataclass(frozen=True)
class _Step:
    """What a step's gradient reductions depend on beside each parameter's own sharding.

    Attributes:
      seq: the sequence's axes beyond the batch's that split it.
      in_ticks: the spmd pipeline sums over ``seq`` inside its ticks.
      batch: the axes that sum gradients once a pass.
      accum: passes a step: microbatches, or pipelined passes.
      once: the data all-reduce runs once a step (else once a pass).
      layers_key: the stacked layers' top-level parameter key, or None.
      reads: how the family reads its tables here (:meth:`LabModel.table_reads`).
      outside: :attr:`LabModel.gathers_outside_scans`.
      head: the parameters (leaf indices) the last stage's head reads, where ``in_ticks``.
      homes: each parameter's home under the sub-mesh pipeline (else empty).
    """

    plan: Plan
    sizes: dict[str, int]
    cpu: bool
    seq: tuple[str, ...]
    in_ticks: bool
    batch: list[str]
    accum: int
    once: bool
    layers_key: str | None
    reads: TableReads
    outside: int
    head: set[int]
    homes: list[Any]

    @property
    def pipelined(self) -> bool:
        return self.plan.pipeline is not None

    @property
    def mpmd(self) -> bool:
        return self.plan.executor == "mpmd"


def _step(
    plan: Plan,
    lab: LabModel,
    sizes: dict[str, int],
    cpu: bool,
    example: dict,
    reads: TableReads,
) -> _Step:
    """What ``plan``'s step reduces its gradients over, and how often."""
    pipelined = plan.pipeline is not None
    mpmd = plan.executor == "mpmd"
    # every axis that splits the examples or their sequences sums gradients
    seq = tuple(a for a in plan.rules.get(SEQ, ()) if a not in BATCH_AXES and sizes[a] > 1)
    # the spmd pipeline's shard_map leaves the sequence's axes automatic: the partitioner
    # sums a tick's gradients over them inside the tick (measured), not once a step
    in_ticks = pipelined and not mpmd and bool(seq)
    batch = [a for a in (*BATCH_AXES, *(() if in_ticks else seq)) if sizes[a] > 1]
    # with a pipeline: one pipelined pass per microbatch; the sub-mesh pipeline reduces each
    # microbatch's gradients in its backward program
    accum = plan.microbatches if mpmd else plan.grad_accum
    split = plan.task.stages
    last_stage = sizes[Axis.STAGE] - 1
    return _Step(
        plan=plan,
        sizes=sizes,
        cpu=cpu,
        seq=seq,
        in_ticks=in_ticks,
        batch=batch,
        accum=accum,
        once=accum == 1 or plan.accumulates_per_data_shard,
        layers_key=split.layers_key if split is not None else None,
        reads=reads,
        outside=lab.gathers_outside_scans,
        head=read_outside_stack(plan, last_stage, example) if in_ticks else set(),
        homes=jax.tree.leaves(plan.gradients.homes.params) if mpmd else [],
    )


def gradient_terms(
    plan: Plan,
    lab: LabModel,
    sizes: dict[str, int],
    cpu: bool,
    example: dict,
    fp8: frozenset,
    reads: TableReads,
) -> list[Term]:
    """Each parameter's FSDP gathers and gradient reductions in one step (the module
    docstring's first two items); ``fp8``: the weights FP8 matmuls read; ``reads``: how
    the family reads its tables (:meth:`LabModel.table_reads`)."""
    step = _step(plan, lab, sizes, cpu, example, reads)
    terms = []
    for i, leaf in enumerate(_param_leaves(plan, example, fp8, cpu)):
        terms += _leaf_terms(step, i, leaf)
    return _in_buckets(terms, plan, sizes[Axis.DATA])


#: what the lab calls a gradient's all-reduce over the batch's devices (:func:`_all_reduce_terms`)
ALL_REDUCED = "gradient all-reduce"
BUCKETS = "gradient buckets all-reduced over data"


def _in_buckets(terms: list[Term], plan: Plan, n: int) -> list[Term]:
    """``terms`` with the gradients' all-reduces over ``data`` laid in buckets where the
    step sums them so (:mod:`jaxpar.buckets`): the same bytes, a collective per bucket
    instead of one per array."""
    size = getattr(plan.gradients, "bucket_bytes", 0)
    if not size:
        return terms
    reduced = [t for t in terms if t.what == ALL_REDUCED]
    kept = [t for t in terms if t.what != ALL_REDUCED]
    shapes = [jax.ShapeDtypeStruct((round(t.payload_bytes),), np.uint8) for t in reduced]
    buckets = groups(shapes, size)
    payloads = [sum(reduced[i].payload_bytes for i in group) for group in buckets]
    return kept + [Term("all-reduce", BUCKETS, b, n, 1, axes=(Axis.DATA,)) for b in payloads]


def _leaf_terms(step: _Step, i: int, leaf: _Leaf) -> list[Term]:
    """The gathers and gradient reductions of parameter ``i``."""
    sizes = step.sizes
    # the sub-mesh pipeline sums the stages' gradients of a parameter on the whole mesh
    # (every device, whichever stage reads it), sharded as the parameter is
    shard = leaf.nbytes / math.prod(sizes[a] for a in leaf.axes)
    if leaf.key is None:  # under the sub-mesh pipeline, a parameter of another stage
        if step.homes[i] != WHOLE:
            return []
        return [Term("all-reduce", STAGE_REDUCED, shard, sizes[Axis.STAGE], axes=STAGE_AXES)]
    in_layers = leaf.key == step.layers_key
    local = leaf.nbytes / math.prod(
        sizes[a]
        for a in leaf.axes
        if (a not in step.batch or a in leaf.own) and leaf.key not in step.reads.whole
    )
    gather = tuple(a for a in leaf.axes if a in step.batch and a not in leaf.own)
    rest = tuple(a for a in step.batch if a not in leaf.axes)
    terms = _stage_terms(step, in_layers, shard, local)
    if step.in_ticks and (in_layers or i in step.head):
        terms.append(_tick_reduction(step.plan, sizes, step.seq, local, in_layers))
    if leaf.key in step.reads.at_once:  # a shard_map's transpose: one sum, then sliced
        over = (*gather, *rest)
        times = 1 if step.once else step.accum
        seq = tuple(a for a in over if a in step.seq) if leaf.key in step.reads.copies else ()
        for axes in (tuple(a for a in over if a not in seq), seq):
            if _degree(sizes, axes) > 1:
                terms.append(
                    Term("all-reduce", ALL_REDUCED, local, _degree(sizes, axes), times, axes=axes)
                )
        if leaf.key not in step.reads.apart:  # gathered once, as outside a scan
            fsdp = (
                _fsdp_terms(step, leaf, local, gather, rest)[0]
                if _degree(sizes, gather) > 1
                else []
            )
            return terms + fsdp[:1]
    if _degree(sizes, gather) > 1:
        fsdp, local, rest = _fsdp_terms(step, leaf, local, gather, rest)
        terms += fsdp
    return terms + _all_reduce_terms(step, leaf, local, rest)


def _degree(sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    """The devices a group over ``axes`` holds."""
    return math.prod(sizes[a] for a in axes)


def _stage_terms(step: _Step, in_layers: bool, shard: float, local: float) -> list[Term]:
    """The stages' gradients of a parameter outside the stack, summed: after every pass
    (spmd), once per step (mpmd)."""
    stages = step.sizes[Axis.STAGE]
    if not step.pipelined or in_layers or stages == 1 or not step.layers_key:
        return []
    if step.mpmd:
        return [Term("all-reduce", STAGE_REDUCED, shard, stages, 1, axes=STAGE_AXES)]
    return [Term("all-reduce", STAGE_REDUCED, local, stages, step.accum, axes=STAGE_AXES)]


#: what the lab calls a gradient's all-reduce over the pipeline's stages, and its axes
STAGE_REDUCED = "gradient all-reduce over stage"
STAGE_AXES = (Axis.STAGE,)


def _fsdp_terms(
    step: _Step, leaf: _Leaf, local: float, gather: tuple[str, ...], rest: tuple[str, ...]
) -> tuple[list[Term], float, tuple[str, ...]]:
    """FSDP's gathers of a weight sharded over the batch axes ``gather`` and its
    gradient's reduction there; returns them with the gradient's bytes after it (``local``)
    and the axes that still sum it (``rest``)."""
    sizes = step.sizes
    terms = [
        Term(
            "all-gather",
            "FSDP weight gathers",
            local * leaf.gathered,
            _degree(sizes, gather),
            _gathers(step.plan, step.pipelined, leaf.scanned, step.outside),
            # gathered once before the accumulation loop (fsdp_gather=once): exposed
            hidden=_overlapped(step, leaf) and not (step.accum > 1 and step.plan.fsdp_gather_once),
            axes=gather,
        )
    ]
    spmd_pipeline = step.pipelined and not step.mpmd
    if spmd_pipeline:  # the executor scatters over fsdp; over the other batch axes that
        # split a parameter (its experts over data) it sums the whole
        fsdp = Axis.FSDP in leaf.axes and Axis.FSDP in step.batch
        scatter = (Axis.FSDP,) if fsdp else ()
        rest = rest + tuple(a for a in gather if a not in scatter)
        gather = scatter
    n = _degree(sizes, gather)
    if n == 1:
        pass
    elif not step.cpu or spmd_pipeline:  # one program reduces: scatters
        terms.append(
            Term(
                "reduce-scatter",
                "gradient reduce-scatter",
                local,
                n,
                step.accum,
                hidden=_overlapped(step, leaf),
                axes=gather,
            )
        )
    elif step.accum > 1 and not step.mpmd:  # XLA:CPU: an all-reduce over fsdp per microbatch
        terms.append(
            Term("all-reduce", "gradient all-reduce over fsdp", local, n, step.accum, axes=gather)
        )
    else:  # XLA:CPU: one all-reduce over every batch axis (per program), then a slice
        rest = rest + gather
        n = 1
    return terms, local / n, rest


def _all_reduce_terms(step: _Step, leaf: _Leaf, local: float, over: tuple[str, ...]) -> list[Term]:
    """The all-reduce of what is left of a gradient (``local`` bytes) over the axes
    ``over`` that sum it, over the sequence's axes first where XLA does so."""
    sizes = step.sizes
    times = 1 if step.once else step.accum
    rest = _degree(sizes, over)
    terms = []
    # data × context: XLA reduces over the sequence's axes (c devices) first, then over
    # the batch's (b), both of the whole gradient: 2(b−1)(c−1)/(bc)·S more than one
    # all-reduce over the b·c devices (measured, with or without tensor). Under fsdp ×
    # context XLA:CPU does so for a gradient summed over the tokens (a bias, a norm's
    # scale: one dim a layer) or of a table read whole; a matmul's gradient it reduces
    # over fsdp first and the slice over the rest (measured): one all-reduce's bytes.
    seq = tuple(a for a in step.seq if a in step.batch)
    split_seq = _degree(sizes, seq)
    read_whole = leaf.key in step.reads.whole or leaf.rank == 1
    summed = step.cpu and (step.accum == 1 or step.mpmd) and read_whole
    if 1 < split_seq < rest and (sizes[Axis.FSDP] == 1 or summed):
        terms.append(
            Term(
                "all-reduce", "gradient all-reduce over context", local, split_seq, times, axes=seq
            )
        )
        rest //= split_seq
        over = tuple(a for a in over if a not in seq)
    if rest > 1:  # reduced once after the accumulation loop: exposed
        hidden = _overlapped(step, leaf) and not (step.once and step.accum > 1)
        terms.append(Term("all-reduce", ALL_REDUCED, local, rest, times, hidden, axes=over))
    return terms


def _overlapped(step: _Step, leaf: _Leaf) -> bool:
    """Whether a stacked layer's gather or gradient reduction runs while other layers
    compute: in a GPU's layer scan XLA's latency-hiding scheduler starts the next layer's
    FSDP gather during this layer's matmuls and reduces a layer's gradient during the
    next one's backward (what FSDP and DDP overlap by design). Not on XLA:CPU (one
    stream), not in a pipeline (gathered at its entry, summed per tick), and not
    for weights outside the scan (the embedding and head: gathered first, reduced last)."""
    return leaf.scanned and not step.cpu and not step.pipelined


def _tick_reduction(
    plan: Plan, sizes: dict[str, int], seq: tuple[str, ...], local: float, in_layers: bool
) -> Term:
    """A gradient the spmd pipeline's ticks sum over the sequence's axes. Every tick counts
    as its costliest branch (:func:`jaxpar.hlo.program_cost`): the last stage's backward,
    whose gradients are its chunk's layers and its head's parameters (the first stage's
    embedding gathers its output gradient instead: :mod:`jaxpar.lab.staged`)."""
    table = plan.pipeline
    chunk = local / table.v if in_layers else local  # a device holds v chunks, runs one
    return Term(
        "all-reduce",
        "context: a tick's gradients all-reduced over context",
        chunk,
        _degree(sizes, seq),
        table.ticks * plan.grad_accum,
        axes=seq,
    )
