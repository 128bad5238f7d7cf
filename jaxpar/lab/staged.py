"""Context parallelism inside a pipeline: what a stage's attention moves over ``context``.

Without a pipeline the model family gives a step's context terms
(:meth:`~jaxpar.lab.terms.LabModel.context_terms`). Inside one, a stage runs its chunk
of ``Lc = L/(p·v)`` layers once per microbatch in each of its programs. The family is asked
for the terms of one microbatch (``b/m`` of a device's rows) through the whole model
without a pipeline — what one layer moves, and what a pass moves once — and the
executor's programs are counted here (all measured on XLA:CPU, ``tests/test_context.py``,
``tests/test_ulysses.py``):

* **spmd executor** — every tick counts as its costliest branch
  (:func:`jaxpar.hlo.program_cost`: each count and size the largest any branch has), a
  backward: ``jax.vjp`` recomputes the chunk's forward from its stashed input, then runs
  the backward. ``all_gather``: per layer K and V gathered (again in a rematerialized
  block) and dK, dV reduce-scattered; the positions gathered once. ``ulysses`` likewise:
  per layer q, k, v and the output exchanged all-to-all (again in a rematerialized
  block), then their 4 gradients; the positions gathered once. ``ring``: the recomputed
  forward's block sends serve the backward too (one program: XLA merges the identical
  sends), so per layer 2(c−1) K/V block sends and 2c dK/dV sends home; the positions'
  c−1. Under ``model.remat`` a chunk of several layers gathers the positions again in
  each rematerialized layer (``1 + Lc`` a tick; one layer: once, merged with the
  recompute). The first stage's backward also gathers its embedding's output gradient
  (one message, ``[b/m, T, D]``) and the token ids it looked up: the table's scatter-add
  gathers its updates over ``context`` rather than reduce the table. The gradients a tick
  sums over ``context`` are :mod:`jaxpar.lab.predict`'s.
* **mpmd executor** (a device of the heaviest stage) — per microbatch a forward program (K
  and V gathered once per layer, the positions once; ``ulysses``: q, k, v and the output
  exchanged once per layer; ``ring``: 2(c−1) block sends per layer, the positions' c−1)
  and a backward program: the chunk's forward recomputed, then its backward. Under
  ``model.remat`` the backward runs each layer's forward once more (K and V gathered, or
  q, k, v and the output exchanged, and the positions gathered, per layer), but for a
  one-layer chunk, where XLA merges the rematerialized layer with the recompute. With
  ``pipeline.backward=residuals`` nothing is recomputed (the forward kept K and V), but a
  rematerialized layer still is. ``ring``'s sends are the spmd backward's either way.

Left out: a learned position table's gradient, which the first stage's backward also
gathers (its ``T`` rows of ``D``, with their indices: about 1% of a tiny GPT's step, but a
third of the spmd pipeline's all-gather bytes for ``tests/test_ulysses.py``'s d_model=32
GPT). Measured as predicted (counts and bytes of each collective kind) for ``all_gather``
and ``ulysses`` with 1, 2 and 4 layers a chunk, with and without remat and residuals, but
``all_gather``'s one-layer chunk under remat in the spmd executor: its costliest tick
gathers K and V twice (the last stage's backward), but not the embedding's gradient and
token ids (the first stage's, whose K/V gathers XLA merges): 0.966 of the predicted
bytes. ``ring`` was measured with one layer a chunk: with more, XLA no longer merges its
sends (``Lc=2``: 1.09× the spmd step, 1.06× the mpmd step without residuals).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.lab.terms import LabLayout, LabModel, Term
from jaxpar.logical import SEQ
from jaxpar.pipeline.branches import Parts
from jaxpar.run import Run

#: The family's context terms (:mod:`jaxpar.lab.context_terms`) this module counts.
KV_GATHERED = "context: K and V gathered"
DKV_SCATTERED = "context: dK and dV reduce-scattered"
POSITIONS_GATHERED = "context: positions gathered"
KV_RING = "context: K and V blocks round the ring"
DKV_HOME = "context: dK and dV blocks home"
POSITIONS_RING = "context: positions round the ring"
Q_EXCHANGED = "context: q and output exchanged"
KV_EXCHANGED = "context: K and V exchanged"
DQ_EXCHANGED = "context: dq and d(output) exchanged"
DKV_EXCHANGED = "context: dK and dV exchanged"
#: Per layer, each forward's collective (all_gather's, ulysses's) and its gradient's.
FORWARD_AND_GRADIENT = {
    KV_GATHERED: DKV_SCATTERED,
    Q_EXCHANGED: DQ_EXCHANGED,
    KV_EXCHANGED: DKV_EXCHANGED,
}
#: The family's expert dispatch terms (:mod:`jaxpar.lab.experts`) this module counts.
TOKENS_GATHERED = "experts: tokens and routing gathered"
OUTPUTS_SCATTERED = "experts: outputs reduce-scattered"
GRADS_GATHERED = "experts: output gradients gathered"
GRADS_SCATTERED = "experts: input and weight gradients reduce-scattered"


def first_stage_message(run: Run, cpu: bool) -> tuple[tuple[int, ...], float]:
    """The shape of what the first stage hands the next for one microbatch of one device's
    rows (its ``StageSplit.embed`` output, the whole sequence) and one device's bytes of it
    (its part of the sequence under context parallelism; float32 on XLA:CPU)."""
    plan = run.plan
    micro = _microbatch(run)
    message = _traced(
        plan.model,
        ("message", _key(micro)),
        lambda: jax.eval_shape(
            lambda p, s, b: plan.task.stages.embed(nnx.merge(plan.model.graphdef, p, s), b),
            plan.model.params,
            plan.model.state,
            micro,
        ),
    )
    itemsize = 4 if cpu else np.dtype(message.dtype).itemsize
    return message.shape, math.prod(message.shape) * itemsize / _degree(run)


def check_chunk(run: Run) -> None:
    """Traces one chunk of a stacked model's pipeline on one microbatch (shapes only), so
    that a chunk its family refuses (Gemma's local/global pattern cut apart: a
    :class:`~jaxpar.errors.JaxparError`) is refused by an estimate as by the compiled
    step. A stage that fails otherwise outside the executor (one that names the mesh's
    axes, as a user's may) is not checked here: the compiled step is where it runs."""
    plan = run.plan
    split = plan.task.stages
    if plan.pipeline is None or split is None:
        return
    params = plan.model.params
    layers = _chunk_layers(run)
    chunk = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((layers, *a.shape[1:]), a.dtype), params[split.layers_key]
    )
    rest = {k: v for k, v in params.items() if k != split.layers_key}
    parts = Parts(split, plan.model.graphdef)
    micro = _microbatch(run)
    state = plan.model.state

    def trace() -> bool:
        try:
            x = jax.eval_shape(parts.embed, rest, chunk, state, micro)
            jax.eval_shape(
                lambda c, r, s, x, b: parts.stage(c, r, s, x, b, 0), chunk, rest, state, x, micro
            )
        except JaxparError:
            raise
        except Exception:  # noqa: BLE001 — not traceable alone (the docstring)
            return False
        return True

    _traced(plan.model, ("chunk", layers, _key(micro)), trace)


#: what was traced of the last model, by key (a plan of many layouts hands every layout
#: the same abstract model; the model is held, so another cannot take its place unseen)
_TRACED: dict[str, Any] = {"model": None, "values": {}}


def _traced(model: Any, key: tuple, trace: Callable[[], Any]) -> Any:
    """``trace()``, or what it returned for ``model`` and ``key`` before (what raises is
    traced again)."""
    if _TRACED["model"] is not model:
        _TRACED.update(model=model, values={})
    values = _TRACED["values"]
    if key not in values:
        values[key] = trace()
    return values[key]


def _key(micro: dict[str, jax.ShapeDtypeStruct]) -> tuple:
    return tuple((k, v.shape, str(v.dtype)) for k, v in sorted(micro.items()))


def _microbatch(run: Run) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one microbatch of one device's rows."""
    plan = run.plan
    batch = run.data.batch(0, run.config.train.batch_size)
    rows = run.config.train.batch_size // plan.batch_ways() // (plan.pipeline.m * plan.grad_accum)
    return {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype) for k, v in batch.items()}


def _degree(run: Run) -> int:
    """Devices a sequence is split over (``c``)."""
    return math.prod(run.plan.mesh.shape[a] for a in run.plan.rules.get(SEQ, ()))


def context_terms_in_pipeline(run: Run, lab: LabModel, layout: LabLayout, cpu: bool) -> list[Term]:
    """The attention's context collectives of one step of a pipelined layout (the module
    docstring); none without a pipeline or a split sequence."""
    plan = run.plan
    table = plan.pipeline
    c = _degree(run)
    if table is None or c == 1:
        return []
    k, m = plan.grad_accum, table.m
    one = dataclasses.replace(
        layout, stages=None, sub_mesh=False, grad_accum=1, rows=layout.rows // (m * k)
    )
    family = {t.what: t for t in lab.context_terms(run.config.model, one)}
    if not family:
        return []
    chunk = Chunk(1 / (table.p * table.v), _chunk_layers(run), _rematerialized(family))
    if layout.sub_mesh:  # each microbatch runs through the stage's v chunks
        return _sub_mesh(family, chunk, m * k * table.v, layout.residuals)
    shape, message = first_stage_message(run, cpu)
    seq = tuple(plan.rules.get(SEQ, ()))
    return _ticks(family, chunk, table.ticks * k, shape, message, seq, c)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What a chunk runs of the model: its ``share`` of the layers (``1/(p·v)``), how many
    that is, and whether each layer is rematerialized in the backward (``model.remat``)."""

    share: float
    layers: int
    remat: bool

    @property
    def merged(self) -> bool:
        """XLA merges a rematerialized layer with the recompute where the chunk is one layer
        (measured: the sub-mesh backward's whole forward; the spmd tick's positions), not
        in a loop of several."""
        return self.layers == 1


def _chunk_layers(run: Run) -> int:
    """A chunk's layers: the stacked layers over ``p·v`` (1 for a model cut by layer)."""
    plan = run.plan
    split = plan.task.stages
    if split is None:
        return 1
    n = jax.tree.leaves(plan.model.params[split.layers_key])[0].shape[0]
    return max(1, n // (plan.pipeline.p * plan.pipeline.v))


def _rematerialized(family: dict[str, Term]) -> bool:
    """Whether the family counts each layer's forward collectives twice (``model.remat``:
    its forward collectives outnumber their gradients')."""
    return any(
        family[f].times > family[g].times for f, g in FORWARD_AND_GRADIENT.items() if f in family
    )


def _scaled(t: Term, what: str, times: float) -> Term:
    return dataclasses.replace(t, what=what, times=round(times))


def _ticks(
    family: dict[str, Term],
    chunk: Chunk,
    ticks: int,
    shape: tuple[int, ...],
    message: float,
    seq: tuple[str, ...],
    c: int,
) -> list[Term]:
    """Every tick of the spmd executor as its costliest branch, a backward (``seq``: the
    axes that split the sequence, over ``c`` devices)."""
    share = chunk.share
    # per layer the recomputed forward's collectives (again where rematerialized) and
    # their gradients': the family's count for the layer
    out = [
        _scaled(t, w, ticks * t.times * share)
        for w, t in family.items()
        if w in FORWARD_AND_GRADIENT or w in FORWARD_AND_GRADIENT.values()
    ]
    if POSITIONS_GATHERED in family:  # again in each rematerialized layer of a loop
        pos = family[POSITIONS_GATHERED]
        again = chunk.layers if chunk.remat and not chunk.merged else 0
        out.append(_scaled(pos, POSITIONS_GATHERED, ticks * (pos.times + again)))
    if KV_RING in family:
        kv, home, pos = family[KV_RING], family[DKV_HOME], family[POSITIONS_RING]
        out += [
            _scaled(kv, KV_RING, ticks * kv.times * share / 2),
            _scaled(home, DKV_HOME, ticks * home.times * share),
            _scaled(pos, POSITIONS_RING, ticks * pos.times),
        ]
    ids = math.prod(shape[:-1]) * 4  # an int32 token id per row of the message
    out += [
        Term(
            "all-gather",
            "context: the first stage's embedding gradient gathered",
            message * c,
            c,
            ticks,
            axes=seq,
        ),
        Term(
            "all-gather", "context: the first stage's token ids gathered", ids, c, ticks, axes=seq
        ),
    ]
    return out


def _sub_mesh(
    family: dict[str, Term], chunk: Chunk, microbatches: int, residuals: bool
) -> list[Term]:
    """A device of the sub-mesh pipeline's heaviest stage: a forward and a backward
    program per microbatch and chunk (``microbatches`` counts each chunk's)."""
    share = chunk.share
    out = []
    pairs = [(f, g) for f, g in FORWARD_AND_GRADIENT.items() if f in family]
    if pairs:
        # the programs that run a layer's forward: the forward, the backward's recompute
        # (without residuals) and its rematerialized layers (unless merged with the
        # recompute), each as much of a pass as the family counts again (Ulysses's output
        # is not exchanged again where the policy keeps it); each gathers the positions
        # once, a rematerialized layer each time
        remat = chunk.remat and (residuals or not chunk.merged)
        positions = 1 + (not residuals) + remat * chunk.layers
        for f, g in pairs:
            grad = family[g]
            passes = 1 + (not residuals) + remat * (family[f].times / grad.times - 1)
            out += [
                _scaled(family[f], f, microbatches * grad.times * share * passes),
                _scaled(grad, g, microbatches * grad.times * share),
            ]
        pos = family[POSITIONS_GATHERED]
        out.append(_scaled(pos, POSITIONS_GATHERED, microbatches * pos.times * positions))
    if KV_RING in family:
        kv, home, pos = family[KV_RING], family[DKV_HOME], family[POSITIONS_RING]
        out += [
            _scaled(kv, KV_RING, microbatches * kv.times * share),  # forward, backward
            _scaled(home, DKV_HOME, microbatches * home.times * share),
            _scaled(pos, POSITIONS_RING, microbatches * pos.times * 2),
        ]
    return out


def expert_terms_in_pipeline(run: Run, lab: LabModel, layout: LabLayout) -> list[Term]:
    """The experts' dispatch of one step of a pipelined layout, on a device of the sub-mesh
    pipeline's heaviest stage (measured on XLA:CPU, ``tests/test_moe.py``). The family gives
    one microbatch's dispatch through the whole model without a pipeline; a chunk runs its
    ``1/(p·v)`` of the MoE layers in each of its programs:

    * a forward program gathers each layer's tokens and routing and reduce-scatters its
      outputs — the last chunk's only to keep residuals (``pipeline.backward=residuals``;
      else it computes nothing: its backward runs the loss);
    * a backward program (or either half of a zero-bubble one: the first chunk's input
      half is empty) gathers the output gradients and reduce-scatters the input and routing
      weights' gradients per layer, and without residuals recomputes the forward first:
      the tokens gathered again, the outputs reduce-scattered (but a one-layer chunk's,
      whose output feeds nothing there, the last chunk's loss aside: XLA drops it where
      no loop is left to share it); ``model.remat`` gathers each layer's tokens once more,
      but in one layer without residuals (merged with the recompute).

    The spmd executor's stages dispatch nothing: they take the experts in gathered, whose
    gathers and gradients :mod:`jaxpar.lab.predict` counts as FSDP's."""
    plan = run.plan
    table = plan.pipeline
    if table is None or plan.executor != "mpmd":
        return []
    k, m = plan.grad_accum, table.m
    chunks = table.p * table.v
    one = dataclasses.replace(
        layout, stages=None, sub_mesh=False, grad_accum=1, rows=layout.rows // (m * k)
    )
    dispatch = (TOKENS_GATHERED, OUTPUTS_SCATTERED, GRADS_GATHERED, GRADS_SCATTERED)
    family = {t.what: t for t in lab.expert_terms(run.config.model, one) if t.what in dispatch}
    if OUTPUTS_SCATTERED not in family:
        return []
    layers = family[OUTPUTS_SCATTERED].times // chunks  # a chunk's MoE layers
    residuals = plan.gradients.residuals
    times = dict.fromkeys(family, 0)
    # rematerialized (the family's gathers outnumber its scatters)
    again = family[TOKENS_GATHERED].times > family[OUTPUTS_SCATTERED].times and (
        residuals or layers > 1
    )
    for action in table.tick:
        if action.chunk % table.p != plan.gradients.heaviest_stage:
            continue
        last = action.chunk == chunks - 1
        if action.kind == "F" and (residuals or not last):
            times[TOKENS_GATHERED] += layers
            times[OUTPUTS_SCATTERED] += layers
        elif action.kind != "F" and not (action.kind == "I" and action.chunk == 0):
            times[GRADS_GATHERED] += layers
            times[GRADS_SCATTERED] += layers
            times[TOKENS_GATHERED] += layers * ((not residuals) + again)
            if not residuals:  # a one-layer chunk's output: dead but the last chunk's loss
                times[OUTPUTS_SCATTERED] += layers if layers > 1 or last else 0
    return [_scaled(t, t.what, times[t.what] * k) for t in family.values()]
