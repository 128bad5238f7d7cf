"""What a pipeline's first and last stages read outside the stacked layers: the
parameters (leaf indices) its embedding and head trace to, once per model, stage position
and batch shape (a plan prices many layouts of one model)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxpar.axes import Axis
from jaxpar.plan import Plan

#: :func:`read_outside_stack`'s answers: a plan over many layouts traces each model's
#: embedding and head once, not once per layout
_READ: dict[tuple, frozenset[int]] = {}


def _signature(tree: Any) -> tuple:
    """A tree's structure with its leaves' shapes and dtypes (what tracing it sees)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def read_outside_stack(plan: Plan, stage: int, batch: dict) -> set[int]:
    """The parameters (leaf indices) a stack's embedding reads on the first stage and its
    head on the last: the inputs of their traced programs that any equation uses. Traced
    once per model, stage position and batch shape (the same functions, the same
    :class:`~flax.nnx.GraphDef` and abstract values give the same program), or each time
    for a model whose graph does not hash (a setting held in a mutable dataclass)."""
    split = plan.task.stages
    model = plan.model
    rows = {k: jax.ShapeDtypeStruct((1, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    last = plan.mesh.shape[Axis.STAGE] - 1
    key = (
        split.embed,
        split.head,
        model.graphdef,
        _signature(model.params),
        _signature(model.state),
        _signature(rows),
        stage == 0,
        stage == last,
    )
    try:
        hash(key)
    except TypeError:  # a model holding an unhashable setting: traced each time
        return _trace_outside_stack(plan, stage, rows)
    if key not in _READ:
        if len(_READ) > 64:
            _READ.clear()
        _READ[key] = frozenset(_trace_outside_stack(plan, stage, rows))
    return set(_READ[key])


def _trace_outside_stack(plan: Plan, stage: int, rows: dict) -> set[int]:
    split = plan.task.stages
    model = plan.model
    embed = lambda p, s, b: split.embed(nnx.merge(model.graphdef, p, s), b)
    used: set[int] = set()
    if stage == 0:
        used |= _used_inputs(embed, model.params, model.state, rows)
    if stage == plan.mesh.shape[Axis.STAGE] - 1:
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
