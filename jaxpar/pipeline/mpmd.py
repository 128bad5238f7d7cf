"""The sub-mesh pipeline executor (``pipeline.executor=mpmd``): one program per stage, on
that stage's own devices.

With ``mesh.stage = p`` the mesh is cut into p sub-meshes along ``stage``
(:func:`jaxpar.pipeline.cut.stage_meshes`); each keeps the ``data``, ``fsdp`` and
``tensor`` axes, so the rules apply inside every stage unchanged. The model is cut by layer
into ``p·v`` chunks of any shapes (:func:`jaxpar.pipeline.cut.cut_by_layer`); chunk ``c``
runs on stage ``c % p``, where its layers live. A stack of layers (``Task.stages``) stays
stored as the spmd executor stores it, stage ``s`` holding layers ``s·L/p`` onward: with
``v > 1`` chunk ``c``'s rows lie in stage ``c div v``'s slab, move to the stage that runs
it each step, and its gradients move back (:class:`jaxpar.pipeline.stacked.ByStack`).
The schedule's tick table (``gpipe``, ``1f1b``, ``interleaved``,
``zb_h1``: the same tables as the SPMD executor's) is played in tick order: each action —
forward, backward, input- or weight-gradient of one microbatch on one chunk — is a jitted
program on its stage's sub-mesh, dispatched asynchronously, so stages run side by side
where the devices can. Activations move right and gradients left with ``jax.device_put``.
A backward recomputes its chunk's forward from the stashed input and the stashed model
state (``jax.vjp``), so BatchNorm statistics and dropout draws are those of the forward.

Every variable lives on one stage (a layer's parameters, optimizer statistics, BatchNorm
statistics and RNG streams on the stage of the layer; a stack's rows on the stage of their
slab); the step counters and the
optimizer's scalars live on the whole mesh, replicated, and each stage reads them in place
(a view of its devices' buffers: nothing is copied). The optimizer update runs per stage,
with the gradient norm of the whole model (jaxpar's global-norm clipping reads it) and one
finiteness for the whole step: a non-finite step is skipped on every stage. So a step with
``m`` microbatches equals one device with ``train.grad_accum=m``: each microbatch
normalized by its own statistics, running averages and RNG counts advanced microbatch by
microbatch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import guard
from jaxpar.errors import LayoutError
from jaxpar.pipeline.chunks import ByLayer, Run, chunk_program
from jaxpar.pipeline.layout import Layout
from jaxpar.pipeline.programs import Lowered
from jaxpar.pipeline.stacked import ByStack
from jaxpar.pipeline.views import (
    STACKED,
    WHOLE,
    chunk_spec,
    chunk_view,
    stack_of,
    view_of,
    whole_of,
)
from jaxpar.state import TrainState
from jaxpar.task import Batch, loss_weights
from jaxpar.update import Update, optimizer_update

#: the whole batch's ``loss_mask`` weighed before the stages split it (one program)
_weigh = jax.jit(loss_weights)


@dataclass(frozen=True, eq=False)
class SubMeshPipeline:
    """The executor (a gradient strategy of the plan: the trainer builds its programs from
    it). ``homes`` holds, for each leaf of the train state, the stage it lives on or
    :data:`WHOLE` or :data:`STACKED`; ``cut`` says what each chunk runs; ``heaviest_stage``
    is the one whose devices hold the most parameter bytes (the layout lab reports its
    collectives); ``layout`` holds the whole mesh, the rules, the context settings, the
    tick table and ``train.grad_accum`` (the table runs that many times per step);
    ``meshes`` are the stages' sub-meshes."""

    cut: ByLayer | ByStack
    layout: Layout
    meshes: tuple[Mesh, ...]
    homes: TrainState
    shardings: TrainState
    heaviest_stage: int = 0
    in_order: bool = False
    residuals: bool = False
    _programs: dict = field(default_factory=dict, repr=False)

    # ---- the trainer's programs --------------------------------------------------------------
    def build_step(self, update: Update, shardings: TrainState) -> Callable:
        return _Stepper(self, update, shardings)

    def build_eval(self, shardings: TrainState) -> Callable:
        def evaluate(params, model_state, batch):
            loss, aux = self.evaluate(params, model_state, batch)
            return {"loss": loss, **aux}

        return evaluate

    def build_grads(self, shardings: TrainState) -> Callable:
        return lambda params, batch, model_state: self.gradients(params, model_state, batch)[:3]

    def build_init(self, create: Callable[..., TrainState], shardings: TrainState) -> Callable:
        """Each stage builds the whole state in one program and keeps its share (XLA drops
        the rest): every stage's layers start from the values one device would give them."""

        def init() -> TrainState:
            shares = []
            for s, mesh in enumerate(self.meshes):

                def keep(home: int, leaf: Any, s: int = s) -> Any:
                    if home == STACKED:  # this stage's chunk of the stack
                        n = leaf.shape[0] // len(self.meshes)
                        return leaf[s * n : (s + 1) * n]
                    return leaf if home in (s, WHOLE) else None

                out = self.share_shardings(shardings, self.homes, s)
                shares.append(
                    self.ordered(
                        jax.jit(
                            lambda mesh=mesh, keep=keep: jax.tree.map(
                                keep, self.homes, create(mesh)
                            ),
                            out_shardings=out,
                        )
                    )()
                )
            return self.assemble(shares, self.homes)

        return init

    def __call__(self, params: Any, model_state: Any, batch: Batch):
        raise LayoutError(
            "the mpmd executor runs one program per stage: it cannot be traced "
            "into one program (use the trainer's step, grads and evaluate)"
        )

    # ---- each stage's share: its own leaves, the whole-mesh ones read in place -------------
    def share(self, tree: Any, homes: Any, s: int, whole: bool = True) -> Any:
        """Stage ``s``'s share of ``tree`` (leaves placed as ``homes`` says): its own
        leaves, its chunk of the stacked ones, the whole-mesh ones as views on its devices
        (None with ``whole=False``), None elsewhere."""

        def one(home: int, leaf: Any) -> Any:
            if home == s:
                return leaf
            if home == STACKED:
                return chunk_view(leaf, self.meshes[s])
            return view_of(leaf, self.meshes[s]) if home == WHOLE and whole else None

        return jax.tree.map(one, homes, tree)

    def share_shardings(self, shardings: Any, homes: Any, s: int) -> Any:
        """The shardings of :meth:`share`'s leaves (a whole-mesh one moved to stage ``s``)."""

        def one(home: int, sharding: NamedSharding) -> Any:
            if home not in (s, WHOLE, STACKED):
                return None
            spec = chunk_spec(sharding.spec) if home == STACKED else sharding.spec
            return NamedSharding(self.meshes[s], spec)

        return jax.tree.map(one, homes, shardings)

    def assemble(self, shares: list[Any], homes: Any) -> Any:
        """One tree from the stages' shares: each leaf from its stage, a stacked one from
        every stage's chunk, a whole-mesh leaf from every stage's replica."""

        def one(home: int, *leaves: Any) -> Any:
            if home == STACKED:
                return stack_of(list(leaves), self.layout.mesh)
            return leaves[home] if home != WHOLE else whole_of(list(leaves), self.layout.mesh)

        return jax.tree.map(one, homes, *shares, is_leaf=lambda x: x is None)

    def param_shardings(self, c: int) -> Any:
        """The shardings of chunk ``c``'s parameters on its stage."""
        shares = [
            self.share_shardings(self.shardings.params, self.homes.params, s)
            for s in range(len(self.meshes))
        ]
        return self.cut.chunk_tree(shares, c)

    @property
    def last_stage(self) -> int:
        return (len(self.cut.chunks) - 1) % len(self.meshes)

    # ---- the schedule ---------------------------------------------------------------------------
    def gradients(
        self, params: Any, model_state: Any, batch: Batch
    ) -> tuple[jax.Array, dict, Any, Any]:
        """Loss and metrics (means over the step's microbatches), gradients and the model
        state after every microbatch's forward — as one device with ``grad_accum`` =
        microbatches would have them."""
        run = Run(self, params, model_state, _weigh(batch), train=True)
        for r in range(self.layout.grad_accum):
            run.play(r)
        return run.results()

    def evaluate(self, params: Any, model_state: Any, batch: Batch) -> tuple[jax.Array, dict]:
        """Loss and metrics in evaluation mode through the stages (forward only, the
        table's ``m`` microbatches, the model state read as it is)."""
        return Run(self, params, model_state, _weigh(batch), train=False).forward_only()

    def program(self, kind: str, c: int) -> Callable:
        """Chunk ``c``'s jitted program ``kind`` (``F``, ``B``, ``I``, ``W``, ``eval``,
        ``zeros``), built once."""
        if (kind, c) not in self._programs:
            self._programs[(kind, c)] = self.ordered(chunk_program(self, kind, c))
        return self._programs[(kind, c)]

    def ordered(self, program: Callable) -> Callable:
        """``program``, run to its end before the call returns when ``in_order`` (the CPU
        backend: it does not run one device's programs in the order they are dispatched,
        and two programs whose collectives share devices can wait on each other forever).
        On a GPU each device runs its programs in dispatch order, and the stages overlap."""
        return _InOrder(program) if self.in_order else program


class _InOrder:
    """A jitted program whose calls block until their results are ready."""

    def __init__(self, program: Callable):
        self.program = program

    def __call__(self, *args: Any) -> Any:
        return jax.block_until_ready(self.program(*args))

    def __getattr__(self, name: str) -> Any:  # lower, eval_shape, …
        return getattr(self.program, name)


class _Stepper:
    """The train step: the schedule's gradients, then the update on every stage with the
    whole model's gradient norm and one finiteness for the whole step."""

    def __init__(self, ex: SubMeshPipeline, update: Update, shardings: TrainState):
        self.ex = ex
        self.update = update
        replicated = [NamedSharding(m, P()) for m in ex.meshes]
        whole = NamedSharding(ex.layout.mesh, P())
        jit = lambda fn, **kw: ex.ordered(jax.jit(fn, **kw))
        self.norm = [jit(_sum_of_squares, out_shardings=r) for r in replicated]
        self.propose = [
            jit(
                functools.partial(_propose, update.tx),
                out_shardings=(
                    ex.share_shardings(shardings.params, ex.homes.params, s),
                    ex.share_shardings(shardings.opt_state, ex.homes.opt_state, s),
                    r,
                ),
            )
            for s, r in enumerate(replicated)
        ]
        self.keep = jit(_keep)
        self.reduce_norm = jit(_reduce_norm, out_shardings=(whole, whole))
        self.reduce_finite = jit(_reduce_finite, out_shardings=(whole, whole, whole))

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        ex = self.ex
        homes = ex.homes
        loss, aux, grads, model_state = ex.gradients(state.params, state.model_state, batch)
        stages = range(len(ex.meshes))
        grad_shares = [ex.share(grads, homes.params, s) for s in stages]
        zero = jnp.zeros((), jnp.float32)
        rows = [
            self.norm[s](
                ex.share(grads, homes.params, s, whole=s == 0), loss if s == ex.last_stage else zero
            )
            for s in stages
        ]
        grad_norm, clean = self.reduce_norm(stack_of(rows, ex.layout.mesh))
        proposed = [
            self.propose[s](
                ex.share(state.params, homes.params, s),
                ex.share(state.opt_state, homes.opt_state, s),
                grad_shares[s],
                view_of(grad_norm, ex.meshes[s]),
            )
            for s in stages
        ]
        finite, step, skipped = self.reduce_finite(
            stack_of([flag for *_, flag in proposed], ex.layout.mesh),
            clean,
            state.step,
            state.skipped,
        )
        kept = [
            self.keep(
                view_of(finite, ex.meshes[s]),
                proposed[s][:2],
                ex.share(model_state, homes.model_state, s),
                ex.share(state.params, homes.params, s),
                ex.share(state.opt_state, homes.opt_state, s),
                ex.share(state.model_state, homes.model_state, s),
            )
            for s in stages
        ]
        params, opt_state, new_model_state = (
            ex.assemble([k[i] for k in kept], h)
            for i, h in enumerate((homes.params, homes.opt_state, homes.model_state))
        )
        new_state = TrainState(step, params, opt_state, skipped, new_model_state)
        # the logged lr: what stage 0's update recorded, applied or not (as one program's)
        return new_state, self.update.metrics(
            new_state, proposed[0][1], loss, grad_norm, finite, aux
        )

    def lower(self, state: TrainState, batch: dict) -> Lowered:
        """The step for abstract arguments: compiling it compiles every chunk program."""
        return Lowered(self, state, batch)


def _sum_of_squares(grads: Any, loss: jax.Array) -> jax.Array:
    """[1, 2]: this stage's gradients' sum of squares, and 1 when the loss it holds is not
    finite (0 on the other stages)."""
    total = sum(
        (jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)),
        jnp.zeros((), jnp.float32),
    )
    return jnp.stack([total, (~jnp.isfinite(loss)).astype(jnp.float32)])[None]


def _reduce_norm(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The whole model's gradient norm, and whether the loss and the norm are finite."""
    total = rows.sum(0)
    grad_norm = jnp.sqrt(total[0])
    return grad_norm, (total[1] == 0) & jnp.isfinite(grad_norm)


def _propose(tx: Any, params: Any, opt_state: Any, grads: Any, grad_norm: jax.Array):
    """This stage's new parameters and optimizer state, and [1]: whether they are finite."""
    params, opt_state = optimizer_update(tx, grads, opt_state, params, grad_norm)
    return params, opt_state, guard.all_finite(params)[None]


def _reduce_finite(flags: jax.Array, clean: jax.Array, step: jax.Array, skipped: jax.Array):
    """One finiteness for the whole step, and the step counters after it."""
    finite = flags.all() & clean
    return finite, step + 1, skipped + (~finite).astype(jnp.int32)


def _keep(
    finite: jax.Array,
    proposed: tuple,
    model_state: Any,
    params: Any,
    opt_state: Any,
    old_model_state: Any,
) -> tuple:
    """The step's new share where it is finite, else the old one."""
    pick = lambda new, old: jnp.where(finite, new, old)
    return (
        jax.tree.map(pick, proposed[0], params),
        jax.tree.map(pick, proposed[1], opt_state),
        jax.tree.map(pick, model_state, old_model_state),
    )
