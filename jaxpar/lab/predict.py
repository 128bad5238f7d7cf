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
  model knowledge: the lab's module for the run's model family gives these terms
  (:class:`jaxpar.lab.terms.LabModel`, found by :mod:`jaxpar.lab.families`; GPT: per
  layer two all-reduces of ``[b, T, D]`` forward and two backward, Megatron's count;
  ResNet: one all-reduce per block each way). A user's task without a family gets none.
* **pipeline sends** — the SPMD executor sends one activation (the first stage's
  output for one microbatch, e.g. ``[b/m, T, D]``, its part of the sequence under
  ``context``) right and one gradient left every tick (bubbles included).
* **context** — the sequence's axes sum gradients as the batch axes do (XLA reduces
  over them first, then over the batch axes: see :mod:`jaxpar.lab.gradient_terms`); inside the
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

from jaxpar.axes import Axis
from jaxpar.lab.families import lab_for
from jaxpar.lab.gradient_terms import gradient_terms
from jaxpar.lab.staged import (
    context_terms_in_pipeline,
    expert_terms_in_pipeline,
    first_stage_message,
)
from jaxpar.lab.terms import LabLayout, LabModel, TableReads, Term
from jaxpar.logical import ACT_SEQ, SEQ, split_over
from jaxpar.pipeline.schedule import KINDS
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

    @property
    def hidden_bytes(self) -> float:
        """Wire bytes that run while the matmuls they feed compute (:attr:`Term.hidden`)."""
        return sum(t.wire_bytes for t in self.terms if t.hidden)

    @property
    def hidden_ops(self) -> int:
        """How many of the step's collectives are hidden with their latency: a collective
        matmul's sends, each a send of its own in the compiled program. A gather or
        reduction that overlaps other layers' compute still pays its α (its launch and
        synchronization), so it stays in the count the latency term prices."""
        return sum(t.times for t in self.terms if t.hidden and t.kind == "collective-permute")


def lab_layout(run: Run, cpu: bool, asynchronous: bool = False) -> LabLayout:
    """What the model family is told of ``run``'s layout (plain values); ``asynchronous``:
    its stages run as the sub-mesh executor runs them, a program per action (an estimate
    of that executor plans its stages as the one-program executor holds them)."""
    plan = run.plan
    data = run.data
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
        sub_mesh=plan.executor == "mpmd" or (asynchronous and table is not None),
        context=plan.context.attention,
        residuals=plan.executor == "mpmd" and plan.gradients.residuals,
        tensor_overlap=plan.tensor.overlap,
        in_flight=in_flight(table) if table is not None else 1,
    )


def in_flight(table: Any) -> int:
    """The most forwards a device of ``table`` has run whose backward (its input-gradient
    half, in a split one) it has not, at any tick."""
    kinds = np.asarray(table.kind)
    started = np.cumsum(kinds == KINDS.index("F"), axis=0)
    done = np.cumsum(np.isin(kinds, [KINDS.index("B"), KINDS.index("I")]), axis=0)
    return int((started - done).max())


def _pipeline_terms(run: Run, cpu: bool, asynchronous: bool = False) -> list[Term]:
    """One activation right and one gradient left every tick: the message is what the
    model's first stage hands the next (its ``StageSplit.embed`` output) for one microbatch
    of one device's rows, and of its part of their sequences under context parallelism
    (the one-program executor's; the sub-mesh executor sends the rows' whole sequences).

    ``asynchronous`` (an estimate of the sub-mesh executor, whose sends are copies between
    stages, no collective): one message per action that sends — each chunk's forward but
    the last's, each backward but the first chunk's: ``2v·m`` a step on a middle stage,
    ``(2v − 1)·m`` on the first or last — and an interleaved stack's rows moved
    (:func:`stack_moves`)."""
    plan = run.plan
    table = plan.pipeline
    if table is None or plan.executor == "mpmd":  # no collective: device_put between stages
        return []
    _, size = first_stage_message(run, cpu)
    what = "pipeline sends (activation right, gradient left)"
    stage = (Axis.STAGE,)
    if not asynchronous:
        # under sequence parallelism the residual stream crosses stages split over tensor
        rules, sizes = plan.rules, plan.mesh.shape
        size /= math.prod(
            sizes[a] for a in split_over(rules, sizes, ACT_SEQ) if a not in rules[SEQ]
        )
        times = table.ticks * plan.grad_accum
        return [Term("collective-permute", what, 2 * size, table.p, times, axes=stage)]
    # the sub-mesh executor sends each device's rows whole: its sequences too
    size *= math.prod(plan.mesh.shape[a] for a in plan.rules.get(SEQ, ()))
    times = (2 * table.v - (table.p == 2)) * table.m * plan.grad_accum
    terms = [Term("collective-permute", what, size, table.p, times, axes=stage)]
    sent, _ = stack_moves(run)
    if sent:
        terms.append(Term("collective-permute", STACK_ROWS, sent, table.p, 1, axes=stage))
    return terms


#: what the lab calls an interleaved stack's rows moved under the sub-mesh executor
STACK_ROWS = "interleaved stack: chunks' rows moved to their stage, gradients back"


def stack_moves(run: Run) -> tuple[float, float]:
    """Bytes a device sends and holds for the step when the sub-mesh executor runs a stack
    of layers with ``v`` chunks a stage (:class:`jaxpar.pipeline.stacked.ByStack`): chunk
    ``c`` lies in stage ``c div v``'s slab and runs on stage ``c mod p``, so its rows go
    there and its gradients come back; each stage holds a copy of the rows of the v chunks
    it runs (a slab's worth). The busiest stage's: (sent, held); (0, 0) for one chunk a
    stage or a model given by its layers."""
    plan = run.plan
    table, split = plan.pipeline, plan.task.stages
    if table is None or table.v == 1 or split is None or plan.task.layers is not None:
        return 0.0, 0.0
    key = split.layers_key
    slab = sum(
        math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_leaves_with_path(plan.model.params),
            jax.tree.leaves(plan.state_shardings.params),
        )
        if getattr(path[0], "key", None) == key
    )
    p, v = table.p, table.v
    chunk = slab / v
    runs = [[c for c in range(p * v) if c % p == s and c // v != s] for s in range(p)]
    lent = [[c for c in range(p * v) if c // v == s and c % p != s] for s in range(p)]
    sent = max(len(runs[s]) + len(lent[s]) for s in range(p)) * chunk
    return sent, float(slab)


def _read(run: Run, lab: LabModel, layout: Any) -> TableReads:
    """How the family reads its tables (nothing special for a user's task, which brings
    no family)."""
    return TableReads() if run.family is None else lab.table_reads(run.config.model, layout)


def _fp8_weights(run: Run, lab: LabModel) -> frozenset[str]:
    """The weights the model's FP8 matmuls read (none in the default precision)."""
    fp8 = getattr(run.config.model, "precision", "default") == "fp8"
    return lab.fp8_weights if fp8 else frozenset()


def predict_comm(run: Run, backend: str = "gpu", asynchronous: bool = False) -> CommPrediction:
    """The textbook's collectives of one train step of ``run``'s layout.

    Args:
      run: a built run (its plan, batch and model shape).
      backend: ``gpu`` (or ``tpu``): FSDP gradients are reduce-scattered and bfloat16
        activations move as bfloat16; ``cpu``: what XLA:CPU compiles instead
        (all-reduce + slice; bfloat16 activations as float32).
      asynchronous: the family's activation collectives as the sub-mesh executor runs
        them (:func:`lab_layout`); the sends between stages stay priced.
    """
    sizes = dict(run.plan.mesh.shape)
    cpu = backend == "cpu"
    # a user's task brings no family: no activation terms (where they are is model knowledge)
    lab = lab_for(run.family)
    layout = lab_layout(run, cpu, asynchronous)
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
        *gradient_terms(
            run.plan,
            lab,
            sizes,
            cpu,
            batch,
            _fp8_weights(run, lab),
            _read(run, lab, layout),
        ),
        *activations,
        *_pipeline_terms(run, cpu, asynchronous),
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
