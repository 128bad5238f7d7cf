"""The sub-mesh executor's step compiled for the layout lab (``jaxpar inspect``, ``sweep``,
``plan``): every chunk program the tick table runs, compiled for one batch shape, and what
a device of each stage holds and does in one step.

Per stage, on one of its devices:

* **arguments** and **outputs** — its share of the train state (parameters, optimizer and
  model state of its layers, the whole-mesh scalars) and of the batch; the step writes a
  new state next to the old one (as the spmd step does without donation);
* **temporaries** — the largest temporaries of its compiled chunk programs, plus what the
  executor keeps between programs: the gradient sums (one per chunk, the size of its
  parameters) and the stash (each forward's input and model state, or with
  ``pipeline.backward=residuals`` its residuals, kept until its backward; the peak count
  read off the tick table);
* **FLOPs and collectives** — each program's (from its compiled HLO) times the actions of
  the table that run it, times ``train.grad_accum``, and the whole-mesh program that sums
  the stages' gradients of the parameters outside a stack (embedding, head) once a step;
* **transfers** — the activations it sends right and the gradients it sends left
  (``jax.device_put`` between sub-meshes), from the programs' output shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import hlo
from jaxpar.axes import Axis
from jaxpar.logical import BATCH, split_over
from jaxpar.pipeline.chunks import kept, sent_and_counted
from jaxpar.pipeline.schedule import simulate
from jaxpar.pipeline.views import STACKED, WHOLE, chunk_spec, sum_over_stages


@dataclass(frozen=True)
class Memory:
    """Bytes per device, as ``Compiled.memory_analysis()`` names them."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int


@dataclass(frozen=True)
class StageCost:
    """One stage's step on one of its devices (see the module docstring)."""

    stage: int
    chunks: tuple[int, ...]
    memory: Memory
    program_temp_bytes: int
    grad_sum_bytes: int
    stash_bytes: int
    stash_peak: int
    sent_bytes: int
    cost: hlo.ProgramCost
    #: each of its programs' FLOPs, by (action kind, chunk)
    action_flops: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Lowered:
    """The step for abstract arguments, as ``jax.stages.Lowered`` (compile to measure it)."""

    step: Any
    state: Any
    batch: dict

    def compile(self) -> StagePrograms:
        return StagePrograms(self.step, self.state, self.batch)


class StagePrograms:
    """The step's programs compiled; quacks like ``jax.stages.Compiled`` where the lab reads
    one (``memory_analysis``, calling it) and gives :meth:`program_cost` in place of the
    HLO text. Figures are the most loaded stage's (largest peak bytes; most FLOPs)."""

    def __init__(self, step: Any, abstract_state: Any, abstract_batch: dict):
        self.step = step
        ex = step.ex
        self.stages = _stage_costs(ex, abstract_state, abstract_batch)

    def __call__(self, state: Any, batch: Any) -> Any:
        return self.step(state, batch)

    def memory_analysis(self) -> Memory:
        peak = lambda m: m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return max((s.memory for s in self.stages), key=peak)

    def program_cost(self) -> hlo.ProgramCost:
        """The FLOPs and collectives of a device of the stage holding the most parameter
        bytes (the one :func:`jaxpar.lab.predict.predict_comm` predicts)."""
        return self.stages[self.step.ex.heaviest_stage].cost

    @property
    def scheduled_flops(self) -> float:
        """FLOPs per device in the step-time view: the busiest stage's, stretched over the
        schedule's critical path (each stage runs an action as soon as its input arrives),
        each action lasting its compiled program's FLOPs (a backward's recompute and the
        last chunk's head included)."""
        ex = self.step.ex
        s, busiest = max(enumerate(self.stages), key=lambda sc: sc[1].cost.flops)
        table = ex.layout.table
        flops = {key: f for stage in self.stages for key, f in stage.action_flops.items()}
        timing = simulate(table.orders, table.v, cost=lambda a: flops[(a.kind, a.chunk)])
        return busiest.cost.flops * timing.makespan / timing.busy[s]

    @property
    def transfer_bytes(self) -> int:
        """Bytes the busiest stage sends to its neighbours in one step."""
        return max(s.sent_bytes for s in self.stages)


def _nbytes(x: Any) -> int:
    """Bytes one device holds of an abstract array (with its sharding)."""
    if x is None:
        return 0
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def _tree_bytes(tree: Any) -> int:
    return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def _abstract_share(ex: Any, tree: Any, homes: Any, s: int) -> Any:
    """Stage ``s``'s share of an abstract tree (as :meth:`SubMeshPipeline.share`)."""
    mesh = ex.meshes[s]

    def one(home: int, x: Any) -> Any:
        if home == STACKED:
            shape = (x.shape[0] // len(ex.meshes), *x.shape[1:])
            return jax.ShapeDtypeStruct(
                shape, x.dtype, sharding=NamedSharding(mesh, chunk_spec(x.sharding.spec))
            )
        if home in (s, WHOLE):
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)
            )
        return None

    return jax.tree.map(one, homes, tree)


def _stage_costs(ex: Any, state: Any, batch: dict) -> list[StageCost]:
    p = len(ex.meshes)
    chunks = len(ex.cut.chunks)
    table = ex.layout.table
    j = jax.ShapeDtypeStruct((), np.int32)
    counts: dict[tuple[str, int], int] = {}
    for action in table.tick:
        counts[(action.kind, action.chunk)] = (
            counts.get((action.kind, action.chunk), 0) + ex.layout.grad_accum
        )
    shares = [_abstract_share(ex, state, ex.homes, s) for s in range(p)]
    batches = [
        {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, v.sharding.spec))
            for k, v in batch.items()
        }
        for m in ex.meshes
    ]
    x = None
    compiled = {}
    outputs = {}
    inputs = {}
    stashed = {}
    chunk_params = []
    for c in range(chunks):
        s = c % p
        params = ex.cut.chunk_tree([share.params for share in shares], c)
        chunk_params.append(params)
        model_state = ex.cut.chunk_tree([share.model_state for share in shares], c)
        inputs[c] = x
        forward = (params, model_state, x, batches[s], j)
        compiled[("F", c)] = ex.program("F", c).lower(*forward).compile()
        result = jax.tree.map(_abstract, compiled[("F", c)].out_info)
        y, _, keep, _ = kept(ex, forward, result)
        if not ex.residuals:  # a chunk's own loss terms ride with its output: not sent
            y = sent_and_counted(y, c == chunks - 1)[0]
        stashed[c] = keep[0] if ex.residuals else (x, model_state)
        dy = None if c == chunks - 1 else _placed(y, ex.meshes[s], ex)
        args = {"B": (*keep, dy, params), "I": (*keep, dy), "W": (*keep, dy, params)}
        for kind in {k for k, cc in counts if cc == c} - {"F"}:
            compiled[(kind, c)] = ex.program(kind, c).lower(*args[kind]).compile()
        outputs[c] = dy
        x = None if dy is None else _placed(y, ex.meshes[(c + 1) % p], ex)
    moves = ex.cut.moves(chunk_params, p)
    out = []
    for s in range(p):
        mine = [c for c in range(chunks) if c % p == s]
        # a stack's chunks' rows, copied where they run for the step; those run away from
        # their slab: the slab sends them, the running stage sends their gradients back
        held = sum(_tree_bytes(rows) for runs, rows in ex.cut.copied(chunk_params, p) if runs == s)
        state_bytes = _tree_bytes(shares[s]) + _tree_bytes(batches[s])
        temp = max(
            int(compiled[key].memory_analysis().temp_size_in_bytes)
            for key in compiled
            if key[1] in mine
        )
        grads = sum(_tree_bytes(chunk_params[c]) for c in mine)
        peak, stash = _stash_peak(table, mine, {c: _tree_bytes(stashed[c]) for c in mine})
        # the activation each forward sends right and the gradient each backward sends left
        sent = (
            sum(counts.get(("F", c), 0) * _tree_bytes(outputs[c]) for c in mine)
            + sum(
                n * _tree_bytes(inputs[c])
                for (kind, c), n in counts.items()
                if c in mine and kind in ("B", "I")
            )
            + sum(_tree_bytes(rows) for slab, runs, rows in moves if s in (slab, runs))
        )
        cost = _summed(
            [(compiled[key], counts[key]) for key in compiled if key[1] in mine]
            + [(whole, 1) for whole in _stage_sums(ex, state.params)]
        )
        memory = Memory(state_bytes, state_bytes, 0, temp + grads + stash + held)
        actions = {
            key: hlo.program_cost(compiled[key].as_text()).flops
            for key in compiled
            if key[1] in mine
        }
        out.append(StageCost(s, tuple(mine), memory, temp, grads, stash, peak, sent, cost, actions))
    return out


def _stage_sums(ex: Any, params: Any) -> list[Any]:
    """The compiled sums over the stages of the whole-mesh parameters' gradients."""
    out = []
    for home, x in zip(jax.tree.leaves(ex.homes.params), jax.tree.leaves(params)):
        if home == WHOLE:
            rows = jax.ShapeDtypeStruct(
                (len(ex.meshes), *x.shape),
                x.dtype,
                sharding=NamedSharding(ex.layout.mesh, P(Axis.STAGE, *x.sharding.spec)),
            )
            out.append(sum_over_stages(x.sharding).lower(rows).compile())
    return out


def _abstract(x: Any) -> Any:
    """A compiled program's output as an abstract argument of the next (its sharding)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _placed(y: Any, mesh: Any, ex: Any) -> Any:
    """An activation (or its gradient) as it arrives on ``mesh``: rows split as the batch."""
    axes = split_over(ex.layout.rules, mesh.shape, BATCH)
    spec = axes[0] if len(axes) == 1 else (axes or None)
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=NamedSharding(mesh, P(spec, *[None] * (len(v.shape) - 1)))
        ),
        y,
    )


def _stash_peak(table: Any, chunks: list[int], nbytes: dict[int, int]) -> tuple[int, int]:
    """The most microbatches a stage holds stashed at once (a forward stashes its input
    until its backward, or weight-gradient half, is done), and their bytes then."""
    held = {c: 0 for c in chunks}
    peak = 0
    peak_bytes = 0
    for action in sorted(table.tick, key=table.tick.get):
        if action.chunk not in held:
            continue
        if action.kind == "F":  # stashes its input
            held[action.chunk] += 1
        elif action.kind in ("B", "W"):  # frees it
            held[action.chunk] -= 1
        total = sum(held.values())
        if total > peak:
            peak, peak_bytes = total, sum(held[c] * nbytes[c] for c in chunks)
    return peak, peak_bytes


def _summed(programs: list[tuple[Any, int]]) -> hlo.ProgramCost:
    """The cost of running each compiled program its number of times."""
    flops = 0.0
    stats = {}
    unknown = 0
    for compiled, times in programs:
        cost = hlo.program_cost(compiled.as_text())
        flops += times * cost.flops
        unknown += cost.unknown_loops
        for kind, stat in cost.collectives.items():
            old = stats.get(kind, hlo.CollectiveStat())
            stats[kind] = hlo.CollectiveStat(
                *(getattr(old, f.name) + times * getattr(stat, f.name) for f in fields(stat))
            )
    for kind in hlo.COLLECTIVES:
        stats.setdefault(kind, hlo.CollectiveStat())
    return hlo.ProgramCost(flops, stats, unknown)
