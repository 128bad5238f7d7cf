"""The jitted steps of a :class:`~jaxpar.plan.Plan`: init, train, eval.

One init path: the plan gives every parameter and optimizer-state leaf a
``NamedSharding``, and ``jit(init, out_shardings=...)`` creates the state already
sharded, so no parameter is ever whole on one device. The same shardings are the
step's ``in_shardings``/``out_shardings`` (the state is donated). The train step
has no layout branch: the plan's gradient strategy gives loss and gradients, the
optimizer updates, and the non-finite guard keeps the old state of a bad step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import guard
from jaxpar.buckets import platform_of
from jaxpar.errors import TaskError
from jaxpar.logical import activation_rules
from jaxpar.plan import Plan, global_batch_shapes, sizes
from jaxpar.sharding import place_params, placed_shapes
from jaxpar.state import TrainState
from jaxpar.task import Batch
from jaxpar.update import Update


def _on_device(eval_params: Any, offloaded: Any) -> Any:
    """``eval_params(opt_state, params)`` of an optimizer state held in host memory
    (``offloaded``: its shardings) moved to the devices first."""
    if offloaded is None:
        return eval_params
    device = jax.tree.map(lambda s: s.with_memory_kind("device"), offloaded)
    return lambda opt_state, params: eval_params(jax.device_put(opt_state, device), params)


class Trainer:
    """Sharded state, train step and eval step of a plan.

    Args:
      plan: the layout (with the task and the optimizer it lays out).
      seed: the parameters' init seed.
      nonfinite_guard: how a non-finite step keeps the old state: ``cond``, ``where``
        or ``auto`` (``where`` on a GPU, ``cond`` elsewhere); see ``jaxpar/guard.py``.
    """

    def __init__(self, plan: Plan, *, seed: int = 0, nonfinite_guard: str = "auto"):
        self.plan = plan
        self.seed = seed
        self.nonfinite_guard = nonfinite_guard
        self.keep = guard.choose(nonfinite_guard, plan.layout.platform or platform_of(plan.mesh))
        if plan.task.eval_params is not None and plan.executor == "mpmd":
            raise TaskError(
                "Task.eval_params needs the whole optimizer state in one "
                "program, which pipeline.executor=mpmd splits by stage; use "
                "pipeline.executor=spmd or leave eval_params out"
            )

    # The programs are made when first used: a plan that only estimates a layout (many
    # layouts, none run) makes none.
    @property
    def _offloaded(self) -> Any:
        plan = self.plan
        return plan.state_shardings.opt_state if plan.optimizer_offload else None

    @functools.cached_property
    def _step(self) -> Callable:
        update = Update(self.plan.optimizer, self.keep, self._offloaded)
        return self.plan.gradients.build_step(update, self.plan.state_shardings)

    @functools.cached_property
    def _eval(self) -> Callable:
        return self.plan.gradients.build_eval(self.plan.state_shardings)

    @functools.cached_property
    def _init(self) -> Callable:
        return self.plan.gradients.build_init(self._create, self.plan.state_shardings)

    @functools.cached_property
    def _grads_jit(self) -> Callable:
        return self.plan.gradients.build_grads(self.plan.state_shardings)

    @functools.cached_property
    def _eval_params(self) -> Callable | None:
        eval_params = self.plan.task.eval_params
        if eval_params is None:
            return None
        return jax.jit(
            _on_device(eval_params, self._offloaded),
            out_shardings=self.plan.state_shardings.params,
        )

    def with_plan(self, plan: Plan) -> Trainer:
        """A trainer of another plan with this one's seed and guard."""
        return Trainer(plan, seed=self.seed, nonfinite_guard=self.nonfinite_guard)

    def _create(self, mesh: Any = None) -> TrainState:
        """The fresh state (traced); ``mesh``: the mesh of the activation rules while the
        model is built (default: the plan's; a stage's sub-mesh under the mpmd executor)."""
        mesh = self.plan.mesh if mesh is None else mesh
        with activation_rules(mesh, self.plan.rules), nnx.use_eager_sharding(False):
            # logical names only: Flax would otherwise shard each annotated variable at
            # construction over a mesh named by its logical names
            model = self.plan.task.model_fn(nnx.Rngs(self.seed))
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(
            zero, params, self.plan.optimizer.init(params), zero, nnx.to_pure_dict(model_state)
        )

    def init(self) -> TrainState:
        """A fresh state, born sharded (``jit`` with ``out_shardings``).

        With the task's ``init_params`` (pretrained weights) the parameters are those,
        each device receiving only its slice (:func:`place_params`); the optimizer state
        starts fresh.

        Raises:
          TaskError: when ``init_params`` gives parameters that do not fit the model.
          LayoutError: when the state does not fit the devices' memory.
        """
        plan = self.plan
        sizes.check_state(plan, sizes.device_memory(list(plan.mesh.devices.flat)), {})
        if plan.task.init_params is None:
            return self._init()

        def create_from(params: Any) -> TrainState:
            # the model's own parameters are built too, unused (XLA drops them): the other
            # state (RNG streams, statistics) comes from the same init path
            state = self._create()
            return TrainState(
                state.step, params, plan.optimizer.init(params), state.skipped, state.model_state
            )

        shardings = plan.state_shardings
        params = place_params(plan.task.init_params(), plan.model.params, shardings.params)
        return jax.jit(
            create_from, in_shardings=(shardings.params,), out_shardings=shardings, donate_argnums=0
        )(params)

    def compile_init(self) -> jax.stages.Compiled:
        """The compiled init program (its memory analysis shows what one device holds)."""
        return self._init.lower().compile()

    def shard_batch(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host arrays (this process's rows) → global ``jax.Array``s with the batch sharding."""
        shapes = global_batch_shapes(host_batch, self.plan.row_share[1])
        shardings = self.plan.batch_shardings(shapes)
        return {
            k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v), shapes[k].shape)
            for k, v in host_batch.items()
        }

    def apply(
        self, params: Any, model_state: Any, batch: Batch, *, train: bool
    ) -> tuple[jax.Array, dict, Any]:
        """The task's loss, metrics and the model's new state on the whole batch, in
        training or evaluation mode, with the plan's activation rules (traceable)."""
        plan = self.plan
        return plan.loss(params, model_state, batch, train=train, layout=plan.layout)

    def loss(
        self, params: Any, batch: Batch, model_state: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The task's loss and metrics of ``params`` in training mode (traceable)."""
        return self.apply(params, self._state_or_empty(model_state), batch, train=True)[:2]

    def _state_or_empty(self, model_state: Any) -> Any:
        if model_state is None and self.plan.model.stateful:
            raise TaskError(
                "this model has state besides its parameters "
                f"({', '.join(self.plan.model.state_kinds)}): pass model_state "
                "(TrainState.model_state)"
            )
        return {} if model_state is None else model_state

    def step(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        """One optimizer step (donates ``state``)."""
        return self._step(state, batch)

    def grads(
        self, params: Any, batch: Mapping[str, jax.Array], model_state: Any = None
    ) -> tuple[jax.Array, dict, Any]:
        """Loss, metrics and gradients of one step's batch, as the train step computes them."""
        return self._grads_jit(params, batch, self._state_or_empty(model_state))

    def evaluate(
        self, state: TrainState | Any, batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        """Loss (and task metrics) on one batch in evaluation mode (``model.eval()``: no
        dropout, BatchNorm on its running averages). ``state`` is a :class:`TrainState`,
        or the parameters of a model without other state. With pipeline stages the batch
        runs through them as ``pipeline.microbatches`` microbatches.

        Raises:
          LayoutError: with stages, for a batch that does not split into that many
            microbatches on each device sharing its batch dim.
        """
        self.plan.check_eval_batch(batch)
        if isinstance(state, TrainState):
            params = (
                state.params
                if self._eval_params is None
                else self._eval_params(state.opt_state, state.params)
            )  # the task's evaluation parameters
            return self._eval(params, state.model_state, batch)
        return self._eval(state, self._state_or_empty(None), batch)

    def lower_step(self, batch: Mapping[str, Any]) -> jax.stages.Lowered:
        """The train step for batches shaped like ``batch``, lowered (not yet compiled)."""
        abstract_batch = placed_shapes(dict(batch), self.plan.batch_shardings(batch))
        abstract_state = placed_shapes(self.plan.abstract_state, self.plan.state_shardings)
        return self._step.lower(abstract_state, abstract_batch)

    def compile_step(self, batch: Mapping[str, Any]) -> jax.stages.Compiled:
        """The compiled train step for batches shaped like ``batch`` (no data needed)."""
        return self.lower_step(batch).compile()
