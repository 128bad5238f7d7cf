"""The non-finite guard: a train step keeps its new state only when the step was finite.

A step is finite when its loss, its gradient norm and the new parameters are (an inf or
NaN in a floating update ``u`` makes ``p + u`` non-finite, so checking the new parameters
checks the update too; integer parameter leaves are not checked). The new state cannot
overwrite the old one in place before that is known, so keeping the old state costs
memory traffic; two ways to pay it, the same numbers either way:

* ``where`` — the new state is computed once and ``jnp.where(finite, new, old)`` selects,
  leaf by leaf: every state byte read twice more and written once more (on ``gpt_tiny``
  ``data=8``, XLA's bytes accessed of the step +12.6% over a step without a guard).
* ``cond`` — the new parameters are computed once for the check only (XLA fuses that
  into a reduction: nothing is stored), then ``lax.cond`` computes the update again and
  writes it in place, or keeps the old state (+6.7% bytes, +2.2% FLOPs on the same
  step). On a GPU, XLA may read a conditional's predicate back to the host mid-step,
  so ``auto`` keeps ``where`` there until that is measured.

``python benchmarks/step_overhead.py --breakdown`` measures both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

GUARDS = ("auto", "cond", "where")

#: ``(finite, new, old) -> state``: ``new`` and ``old`` are thunks returning the state.
Keep = Callable[[jax.Array, Callable[[], Any], Callable[[], Any]], Any]


def all_finite(*values: Any) -> jax.Array:
    """True when every floating leaf of ``values`` holds no inf or NaN (on device)."""
    checked = [jnp.isfinite(x).all() for x in jax.tree.leaves(values)
               if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(checked).all() if checked else jnp.array(True)


def keep_where(finite: jax.Array, new: Callable[[], Any], old: Callable[[], Any]) -> Any:
    """``new()`` where ``finite``, else ``old()``, selected leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new(), old())


def keep_cond(finite: jax.Array, new: Callable[[], Any], old: Callable[[], Any]) -> Any:
    """``new()`` computed inside a ``lax.cond`` taken only when ``finite``."""
    return jax.lax.cond(finite, new, old)


def choose(name: str, platform: str) -> Keep:
    """The guard ``name`` (``auto``: ``where`` on a GPU, ``cond`` elsewhere).

    Raises:
      ValueError: for a name not in :data:`GUARDS`.
    """
    if name not in GUARDS:
        raise ValueError(f"config key 'train.nonfinite_guard' must be one of "
                         f"{', '.join(GUARDS)}, got {name!r}")
    if name == "auto":
        name = "where" if platform == "gpu" else "cond"
    return keep_where if name == "where" else keep_cond
