"""The textbook's collective bytes and memory of a layout, from its shardings alone.

Every term is wire bytes per device under ring algorithms (see :mod:`jaxpar.hlo`
for the same accounting applied to a compiled program), for one train step of
global batch ``B`` (``b`` rows per device), sequence ``T``, width ``D``:

* **gradient reduction** — a parameter's gradient is partial over every batch
  axis (``data``, ``fsdp``) and, in a pipeline, over ``stage`` for parameters
  outside the stacked layers. Axes that shard the parameter reduce-scatter it
  (FSDP: (n−1)/n·S, per microbatch with ``train.grad_accum``); the others
  all-reduce what is left (2(n−1)/n·S), once per step (per microbatch only on
  the layouts where :attr:`~jaxpar.plan.Plan.accumulates_per_data_shard`
  is false). XLA:CPU has no reduce-scatter pass: there the partitioner
  all-reduces the gradient and slices it, and the prediction for a CPU program
  says so (``backend="cpu"``); GPU and TPU programs reduce-scatter.
* **FSDP weight gathers** — every parameter sharded over a batch axis is
  all-gathered before use, per microbatch with ``train.grad_accum``. Weights of
  the scanned layers are gathered in the forward scan and again in the
  backward scan (the scan saves the shards, not the gathered weights — ZeRO-3);
  weights outside the scan (embedding, head) are gathered once and the copy
  serves the backward pass too. Inside a pipeline everything is gathered once
  per step.
* **activations under ``tensor``** — where a model's activations cross devices is
  model knowledge: the run's model family gives these terms
  (:class:`jaxpar.models.family.LabModel`; GPT: per layer two all-reduces of
  ``[b, T, D]`` forward and two backward, Megatron's count; ResNet: one
  all-reduce per block each way). A user's task without a family gets none.
* **pipeline sends** — the SPMD executor sends one activation (the first stage's
  output for one microbatch, e.g. ``[b/m, T, D]``, its part of the sequence under
  ``context``) right and one gradient left every tick (bubbles included).
* **context** — the sequence's axes sum gradients as the batch axes do (XLA reduces
  over them first, then over the batch axes: see :func:`_gradient_terms`); inside the
  spmd pipeline they stay automatic, and every tick sums its gradients over them (the
  last stage's: its chunk's layers and its head's parameters). The attention's
  collectives are the family's (:meth:`LabModel.context_terms`), counted as a pipeline
  runs them by :mod:`jaxpar.lab.staged`.

Scalar reductions (loss, gradient norm) are left out: a few bytes. XLA:CPU
computes bfloat16 in float32 (its float-normalization pass), so a CPU program
moves bfloat16 activations as float32, twice the bytes: the CPU prediction
says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar.lab.staged import (
    context_terms_in_pipeline,
    expert_terms_in_pipeline,
    first_stage_message,
)
from jaxpar.logical import BATCH_AXES, spec_axes, spec_leaves
from jaxpar.models.family import LabLayout, LabModel, Term
from jaxpar.pipeline.views import STACKED, WHOLE
from jaxpar.plan import Plan
from jaxpar.run import Run


@dataclass(frozen=True)
class CommPrediction:
    """The predicted collectives of one step."""

    terms: tuple[Term, ...]

    def by_kind(self) -> dict[str, float]:
        """Wire bytes per collective kind."""
        out: dict[str, float] = {}
        for t in self.terms:
            out[t.kind] = out.get(t.kind, 0.0) + t.wire_bytes
        return out

    @property
    def total_bytes(self) -> float:
        return sum(t.wire_bytes for t in self.terms)


def _param_leaves(
    plan: Plan, batch: dict
) -> list[tuple[str, float, tuple[str, ...], bool, tuple[str, ...], int]]:
    """(top-level key, bytes, mesh axes sharding it, stacked on ``layers``, the axes that
    split its experts, its dims a layer) per parameter. A stacked parameter runs in a layer
    scan: FSDP gathers it in the forward scan and again in the backward scan (the scan keeps
    the shards, not the gathered weights). A device keeps its own experts (never gathered)
    and their gradients whole (the dispatch brought them every token routed to them) — but
    in the spmd pipeline, whose stages take them in gathered as FSDP's weights."""
    leaves = jax.tree_util.tree_leaves_with_path(plan.model.params)
    names = jax.tree.leaves(plan.model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    mine = _held_by_heaviest_stage(plan, len(leaves), batch)
    own_experts = plan.pipeline is None or plan.executor == "mpmd"
    return [
        (
            str(getattr(path[0], "key", "")) if held else None,
            math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize,
            spec_axes(spec),
            "layers" in axes,
            plan.rules.get("experts", ()) if "experts" in axes and own_experts else (),
            leaf.ndim - ("layers" in axes),
        )
        for (path, leaf), spec, axes, held in zip(
            leaves, spec_leaves(plan.param_specs), names, mine
        )
    ]


def _held_by_heaviest_stage(plan: Plan, n: int, batch: dict) -> list[bool]:
    """Which parameters a device of the sub-mesh pipeline's heaviest stage holds and
    reduces the gradient of (all of them under another executor): its own layers', and of
    the parameters outside a stack those its embedding (first stage) or head (last stage)
    reads."""
    if plan.executor != "mpmd":
        return [True] * n
    ex = plan.gradients
    stage, homes = ex.heaviest_stage, jax.tree.leaves(ex.homes.params)
    read = _read_outside_stack(plan, stage, batch) if WHOLE in homes else set()
    return [
        home == stage or home == STACKED or (home == WHOLE and i in read)
        for i, home in enumerate(homes)
    ]


def _read_outside_stack(plan: Plan, stage: int, batch: dict) -> set[int]:
    """The parameters (leaf indices) a stack's embedding reads on the first stage and its
    head on the last: the inputs of their traced programs that any equation uses."""
    split, model = plan.task.stages, plan.model
    rows = {k: jax.ShapeDtypeStruct((1, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    embed = lambda p, s, b: split.embed(nnx.merge(model.graphdef, p, s), b)
    used: set[int] = set()
    if stage == 0:
        used |= _used_inputs(embed, model.params, model.state, rows)
    if stage == plan.mesh.shape["stage"] - 1:
        x = jax.eval_shape(embed, model.params, model.state, rows)
        head = lambda p, s, xb: split.head(nnx.merge(model.graphdef, p, s), *xb)
        used |= _used_inputs(head, model.params, model.state, (x, rows))
    return used


def _used_inputs(fn: Any, params: Any, state: Any, batch: Any) -> set[int]:
    """The leaves of ``params`` that ``fn(params, state, batch)``'s jaxpr reads."""
    closed = jax.make_jaxpr(fn)(params, state, batch)
    read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    read |= {id(v) for v in closed.jaxpr.outvars}
    n = len(jax.tree.leaves(params))
    return {i for i, v in enumerate(closed.jaxpr.invars[:n]) if id(v) in read}


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


def _gradient_terms(
    plan: Plan, lab: LabModel, sizes: dict[str, int], cpu: bool, example: dict
) -> list[Term]:
    pipelined = plan.pipeline is not None
    mpmd = plan.executor == "mpmd"
    # every axis that splits the examples or their sequences sums gradients
    seq = tuple(a for a in plan.rules.get("seq", ()) if a not in BATCH_AXES and sizes[a] > 1)
    # the spmd pipeline's shard_map leaves the sequence's axes automatic: the partitioner
    # sums a tick's gradients over them inside the tick (measured), not once a step
    in_ticks = pipelined and not mpmd and bool(seq)
    batch = [a for a in (*BATCH_AXES, *(() if in_ticks else seq)) if sizes[a] > 1]
    # with a pipeline: one pipelined pass per microbatch; the sub-mesh pipeline reduces each
    # microbatch's gradients in its backward program
    accum = plan.microbatches if mpmd else plan.grad_accum
    once = accum == 1 or plan.accumulates_per_data_shard  # the data all-reduce
    split = plan.task.stages
    layers_key = split.layers_key if split is not None else None
    # a parameter the model reads whole (LabModel.whole_params: gathered over every axis, as
    # a transformer's token table) has a whole-table gradient, reduced before it is sliced
    whole, outside = lab.whole_params, lab.gathers_outside_scans
    head = _read_outside_stack(plan, sizes["stage"] - 1, example) if in_ticks else set()
    homes = jax.tree.leaves(plan.gradients.homes.params) if mpmd else []
    terms = []
    for i, (key, nbytes, axes, scanned, own, rank) in enumerate(_param_leaves(plan, example)):
        # the sub-mesh pipeline sums the stages' gradients of a parameter on the whole mesh
        # (every device, whichever stage reads it), sharded as the parameter is
        shard = nbytes / math.prod(sizes[a] for a in axes)
        if key is None:  # under the sub-mesh pipeline, a parameter of another stage
            if homes[i] == WHOLE:
                terms.append(
                    Term("all-reduce", "gradient all-reduce over stage", shard, sizes["stage"])
                )
            continue
        in_layers = key == layers_key
        local = nbytes / math.prod(
            sizes[a] for a in axes if (a not in batch or a in own) and key not in whole
        )
        gather = math.prod(sizes[a] for a in axes if a in batch and a not in own)
        rest = math.prod(sizes[a] for a in batch if a not in axes)
        if pipelined and not in_layers and sizes["stage"] > 1 and layers_key:
            # the stages' gradients of the parameters outside the stack, summed: after
            # every pass (spmd), once per step (mpmd)
            terms.append(
                Term(
                    "all-reduce",
                    "gradient all-reduce over stage",
                    shard if mpmd else local,
                    sizes["stage"],
                    1 if mpmd else accum,
                )
            )
        if in_ticks and (in_layers or i in head):
            terms.append(_tick_reduction(plan, sizes, seq, local, in_layers))
        if gather > 1:
            terms.append(
                Term(
                    "all-gather",
                    "FSDP weight gathers",
                    local,
                    gather,
                    _gathers(plan, pipelined, scanned, outside),
                )
            )
            if pipelined and not mpmd:  # the executor scatters over fsdp; over the other
                # batch axes that split a parameter (its experts over data) it sums the whole
                scatter = sizes["fsdp"] if "fsdp" in axes and "fsdp" in batch else 1
                rest, gather = rest * gather // scatter, scatter
            if gather == 1:
                pass
            elif not cpu or (pipelined and not mpmd):  # one program reduces: scatters
                terms.append(
                    Term("reduce-scatter", "gradient reduce-scatter", local, gather, accum)
                )
            elif accum > 1 and not mpmd:  # XLA:CPU: an all-reduce over fsdp per microbatch
                terms.append(
                    Term("all-reduce", "gradient all-reduce over fsdp", local, gather, accum)
                )
            else:  # XLA:CPU: one all-reduce over every batch axis (per program), then a slice
                rest, gather = rest * gather, 1
            local /= gather
        # data × context: XLA reduces over the sequence's axes (c devices) first, then over
        # the batch's (b), both of the whole gradient: 2(b−1)(c−1)/(bc)·S more than one
        # all-reduce over the b·c devices (measured, with or without tensor). Under fsdp ×
        # context XLA:CPU does so for a gradient summed over the tokens (a bias, a norm's
        # scale: one dim a layer) or of a table read whole; a matmul's gradient it reduces
        # over fsdp first and the slice over the rest (measured): one all-reduce's bytes.
        split_seq = math.prod(sizes[a] for a in seq if a in batch)
        summed = cpu and (accum == 1 or mpmd) and (key in whole or rank == 1)
        if 1 < split_seq < rest and (sizes["fsdp"] == 1 or summed):
            terms.append(
                Term(
                    "all-reduce",
                    "gradient all-reduce over context",
                    local,
                    split_seq,
                    1 if once else accum,
                )
            )
            rest //= split_seq
        if rest > 1:
            terms.append(
                Term("all-reduce", "gradient all-reduce", local, rest, 1 if once else accum)
            )
    return terms


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
        math.prod(sizes[a] for a in seq),
        table.ticks * plan.grad_accum,
    )


def lab_layout(run: Run, cpu: bool) -> LabLayout:
    """What the model family is told of ``run``'s layout (plain values)."""
    plan, data = run.plan, run.data
    table = plan.pipeline
    return LabLayout(
        sizes=dict(plan.mesh.shape),
        rules=plan.rules,
        rows=run.config.train.batch_size // plan.batch_ways(),
        grad_accum=plan.grad_accum,
        stages=(table.ticks, table.p, table.v, table.m) if table is not None else None,
        seq_len=getattr(data, "seq_len", 0),
        image_shape=getattr(data, "image_shape", None),
        cpu=cpu,
        sub_mesh=plan.executor == "mpmd",
        context=plan.settings["context"].attention,
        residuals=plan.executor == "mpmd" and plan.gradients.residuals,
    )


def _pipeline_terms(run: Run, cpu: bool) -> list[Term]:
    """One activation right and one gradient left every tick: the message is what the
    model's first stage hands the next (its ``StageSplit.embed`` output) for one microbatch
    of one device's rows, and of its part of their sequences under context parallelism."""
    plan, table = run.plan, run.plan.pipeline
    if table is None or plan.executor == "mpmd":  # no collective: device_put between stages
        return []
    _, size = first_stage_message(run, cpu)
    return [
        Term(
            "collective-permute",
            "pipeline sends (activation right, gradient left)",
            2 * size,
            table.p,
            table.ticks * plan.grad_accum,
        )
    ]


def predict_comm(run: Run, backend: str = "gpu") -> CommPrediction:
    """The textbook's collectives of one train step of ``run``'s layout.

    Args:
      run: a built run (its plan, batch and model shape).
      backend: ``gpu`` (or ``tpu``): FSDP gradients are reduce-scattered and bfloat16
        activations move as bfloat16; ``cpu``: what XLA:CPU compiles instead
        (all-reduce + slice; bfloat16 activations as float32).
    """
    sizes = dict(run.plan.mesh.shape)
    cpu = backend == "cpu"
    # a user's task brings no family: no activation terms (where they are is model knowledge)
    lab = run.family.lab if run.family is not None else LabModel()
    layout = lab_layout(run, cpu)
    activations = (
        [
            *lab.tensor_terms(run.config.model, layout),
            *lab.context_terms(run.config.model, layout),
            *context_terms_in_pipeline(run, lab, layout, cpu),
            *lab.expert_terms(run.config.model, layout),
            *expert_terms_in_pipeline(run, lab, layout),
        ]
        if run.family is not None
        else []
    )
    batch = run.data.batch(0, run.config.train.batch_size)
    terms = [
        *_gradient_terms(run.plan, lab, sizes, cpu, batch),
        *activations,
        *_pipeline_terms(run, cpu),
    ]
    return CommPrediction(tuple(terms))


def predict_argument_bytes(run: Run, batch: dict[str, Any]) -> int:
    """Per-device bytes of the step's arguments: parameters, optimizer state and batch
    shards (from the shardings; the compiled program's argument size should match)."""
    plan = run.plan
    state = plan.state_bytes()
    shardings = plan.batch_shardings(batch)
    data = sum(
        math.prod(shardings[k].shard_shape(v.shape)) * np.dtype(v.dtype).itemsize
        for k, v in batch.items()
    )
    return state.total + data
