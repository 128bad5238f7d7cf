"""The non-finite guard: a train step keeps its new state only when the step was finite.

A step is finite when its loss, its gradient norm and its new parameters hold no inf or
NaN (a non-finite floating update ``u`` makes ``p + u`` non-finite, so checking the new
parameters checks the update too; integer leaves cannot be non-finite). The new state
cannot overwrite the old one in place before that is known, so keeping the old state
costs memory traffic; two ways to pay it:

* ``where`` — the new state, computed once, is selected leaf by leaf with
  ``jnp.where(finite, new, old)``: every state byte read twice more and written once
  more (on ``gpt_tiny`` ``data=8``, XLA's bytes accessed of the step +12.6% over a step
  without a guard). The numbers of a finite step are the unguarded update's.
* ``cond`` — the new parameters are computed once for the check only (XLA fuses that
  into a reduction: nothing is stored), then ``lax.cond`` computes the update again and
  writes it in place, or keeps the old state (+6.7% bytes, +2.2% FLOPs on the same
  step). The optimizer's own reductions (a clipping norm, Adafactor's factored moments)
  run again inside the conditional, where XLA may sum in another order: the two guards
  agree to float32 rounding (tested: ≤ 8 ulps per leaf; 1 ulp seen, with Adam under an
  active clip), bit for bit where the optimizer does not reduce. The update is traced
  twice (a ``jax.debug.print`` in a user's transformation prints twice). On a GPU, XLA
  may read a conditional's predicate back to the host mid-step, so ``auto`` keeps
  ``where`` there until that is measured.

A step must return its state with the structure, shapes and dtypes it was given (the old
state stands in for it): a one-line error names the first leaf that changed.
``python benchmarks/step_overhead.py --breakdown`` measures both guards.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxpar.errors import TaskError

#: ``train.nonfinite_guard`` values: ``auto`` picks one of the others per platform.
Guard = Literal["auto", "cond", "where"]
GUARDS: tuple[str, ...] = typing.get_args(Guard)

#: ``(finite, new, recompute, old) -> state``: ``new`` is the step's new state as computed
#: for the check, ``recompute()`` computes it again, ``old`` is the state before the step.
Keep = Callable[[jax.Array, Any, Callable[[], Any], Any], Any]


def all_finite(*values: Any) -> jax.Array:
    """True when every floating leaf of ``values`` holds no inf or NaN (on device)."""
    checked = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(values)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.stack(checked).all() if checked else jnp.array(True)


def keep_where(finite: jax.Array, new: Any, recompute: Callable[[], Any], old: Any) -> Any:
    """``new`` where ``finite``, else ``old``, selected leaf by leaf."""
    check_same_types(new, old)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def keep_cond(finite: jax.Array, new: Any, recompute: Callable[[], Any], old: Any) -> Any:
    """``recompute()`` inside a ``lax.cond`` taken only when ``finite``, else ``old``."""
    check_same_types(new, old)
    return jax.lax.cond(finite, recompute, lambda: old)


def check_same_types(new: Any, old: Any) -> None:
    """Raises a one-line ``ValueError`` naming the first leaf of the step's new state whose
    structure, shape or dtype differs from the state before the step (a step must return
    the state it was given, or the old one could not stand in for it)."""
    old_leaves = jax.tree_util.tree_flatten_with_path(old)[0]
    new_leaves = jax.tree_util.tree_flatten_with_path(new)[0]
    fix = (
        "the old state stands in for a non-finite step, so the optimizer's update must "
        "return its state with the structure, shapes and dtypes of its init"
    )
    old_paths = [jax.tree_util.keystr(p) for p, _ in old_leaves]
    new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
    if old_paths != new_paths:
        first = next(
            (f"{o} → {n}" for o, n in zip(old_paths, new_paths) if o != n),
            f"{len(old_paths)} leaves → {len(new_paths)}",
        )
        raise TaskError(f"the train step changed the structure of its state ({first}): {fix}")
    for path, (_, n), (_, o) in zip(new_paths, new_leaves, old_leaves):
        if (jnp.shape(n), jnp.result_type(n)) != (jnp.shape(o), jnp.result_type(o)):
            raise TaskError(
                f"the train step changed state leaf {path} from {jnp.result_type(o).name}"
                f"{list(jnp.shape(o))} to {jnp.result_type(n).name}{list(jnp.shape(n))}: "
                f"{fix}"
            )


def choose(name: Guard, platform: str) -> Keep:
    """The guard ``name`` (``auto``: ``where`` on a GPU, ``cond`` elsewhere)."""
    if name == "auto":
        name = "where" if platform == "gpu" else "cond"
    return keep_where if name == "where" else keep_cond
