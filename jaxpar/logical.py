"""Logical axis names → mesh ``PartitionSpec``s, and the activation constraint helper.

Models name tensor dims with logical names only (``batch``, ``embed``, ``mlp``,
…). A rules table maps each name to a tuple of mesh axes (empty: the dim is not
sharded). This module is the one place that turns names into specs, so the
checks live here too: a name with no rule, a mesh axis used twice in one array,
and a dim that the mesh axes do not divide are errors, never silent
replication.

Models call :func:`constrain` on key activations. It is a no-op unless a
trainer has activated rules with :func:`activation_rules` while tracing its
step: the model stays free of mesh axis names and runs unchanged outside jaxpar.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.axes import BATCH_AXES
from jaxpar.errors import LayoutError

Rules = Mapping[str, tuple[str, ...]]
T = TypeVar("T")
AxisNames = Sequence[str | tuple[str, ...] | None]

# The logical axes the engine reads to make layout decisions; a model (built-in or a
# user's) names these dims with these words, and the rest of its vocabulary is its own.
#: the examples of a batch (split over ``data`` and ``fsdp``)
BATCH = "batch"
#: the tokens of a sequence (split over ``context``)
SEQ = "seq"
#: the tokens of the residual stream between blocks (split over ``context`` as ``seq`` is, and
#: over ``tensor`` too under sequence parallelism: ``tensor.sequence``)
ACT_SEQ = "act_seq"
#: the stacked layers of a model (split over ``stage``: pipeline stages are layer ranges)
LAYERS = "layers"

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules, Any] | None] = contextvars.ContextVar(
    "jaxpar_activation_rules", default=None
)
#: how many activation constraints have named ``act_seq`` while a step was traced, in this
#: process
_STREAM_CALLS = [0]


def split_over(rules: Rules, sizes: Mapping[str, int], name: str) -> tuple[str, ...]:
    """The mesh axes of size above 1 that the rules split the logical axis ``name`` over
    (``sizes``: each mesh axis's size, e.g. ``mesh.shape``)."""
    return tuple(a for a in rules.get(name, ()) if sizes.get(a, 1) > 1)


def spec_leaves(tree: Any) -> list[PartitionSpec]:
    """The ``PartitionSpec`` leaves of a tree."""
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


def names_of(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The names one entry of a spec or of a dim's logical names holds: a ``None`` entry
    none, a string itself, a tuple its members."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def spec_axes(spec: PartitionSpec | Sequence) -> tuple[str, ...]:
    """Every mesh axis a ``PartitionSpec`` shards over, in order."""
    return tuple(a for entry in spec for a in names_of(entry))


def spec_for(
    names: AxisNames, rules: Rules, mesh: Mesh, shape: Sequence[int], what: str
) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose dims carry logical ``names``.

    Args:
      names: one logical name per dim (or a tuple of names, whose mesh axes are joined);
        ``None`` marks a dim that is never sharded.
      rules: logical name → mesh axes.
      mesh: the mesh (for axis sizes).
      shape: the array shape, checked for divisibility.
      what: how to name the array in errors (a parameter path, an activation).

    Raises:
      LayoutError: naming ``what`` for an unmapped name, a rank mismatch, a mesh
        axis used twice, or a dim the mesh axes do not divide.
    """
    if len(names) != len(shape):
        raise LayoutError(
            f"{what}: {len(names)} logical axes {tuple(names)} for an array of shape "
            f"{tuple(shape)}; give one name per dim"
        )
    entries, used = [], {}
    for dim, (entry, size) in enumerate(zip(names, shape)):
        if entry is None:
            entries.append(None)
            continue
        # A dim may carry several logical names (Flax allows a tuple): their axes, in order.
        group = names_of(entry)
        for name in group:
            if name not in rules:
                raise LayoutError(
                    f"logical axis '{name}' of {what} (dim {dim}, shape {tuple(shape)}) has no "
                    f"rule; add one, e.g. rules.{name}=null to replicate it or rules.{name}=fsdp "
                    f"to shard it"
                )
        name = "+".join(group)
        axes = tuple(a for n in group for a in rules[n])
        for axis in axes:
            if axis not in mesh.shape:
                raise LayoutError(
                    f"rule for logical axis '{name}' names mesh axis '{axis}', which the mesh "
                    f"does not have (mesh axes: {', '.join(mesh.shape)})"
                )
            if axis in used:
                raise LayoutError(
                    f"{what}: mesh axis '{axis}' shards both '{used[axis]}' and '{name}'; "
                    f"change the rule for one of them"
                )
            used[axis] = name
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            fix = (  # a batch entry's rows are the global batch (or a microbatch of it)
                f"make train.batch_size a multiple of {ways} (each microbatch's, under "
                "accumulation or a pipeline), or change the mesh degrees"
                if name == "batch" and what.startswith("batch ")
                else "change the mesh degrees, the model size"
            )
            raise LayoutError(
                f"{what}: dim {dim} ('{name}', size {size}) of shape {tuple(shape)} is not "
                f"divisible by mesh axes {axes} of size {ways}; {fix}, or the rule rules.{name}"
            )
        sharded = tuple(a for a in axes if mesh.shape[a] > 1)
        entries.append(sharded[0] if len(sharded) == 1 else (sharded or None))
    return PartitionSpec(*entries)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules, *options: Any) -> Iterator[None]:
    """Activates ``rules`` for :func:`constrain` while a step is being traced; ``options``:
    the layout's settings that layers read (:func:`active_options`), e.g. how attention
    runs across a split sequence (a :class:`jaxpar.context.ContextConfig`) or how tensor
    parallelism runs (a :class:`jaxpar.tensor_parallel.TensorConfig`); their defaults
    where not given."""
    token = _ACTIVE.set((mesh, rules, options))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> tuple[Mesh, Rules, tuple[Any, ...]] | None:
    """The mesh, rules and options of the step being traced (None outside one)."""
    return _ACTIVE.get()


def active_options(kind: type[T]) -> T | None:
    """The option of type ``kind`` the step being traced was given (None outside a step, or
    when it was given none: the caller's default applies)."""
    active = _ACTIVE.get()
    found = [o for o in active[2] if isinstance(o, kind)] if active is not None else []
    return found[0] if found else None


def shards(name: str) -> int:
    """How many ways the active rules split logical axis ``name`` (1 outside a jaxpar step).

    For a model that keeps one value per shard of an axis, e.g. one copy of a table per
    batch shard, W[G_batch, V, D] constrained to ``("batch", "vocab", None)``.
    """
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, rules, _ = active
    return math.prod(mesh.shape[a] for a in rules.get(name, ()) if a in mesh.shape)


def stream_constraints() -> int:
    """How many times :func:`constrain` has pinned an activation naming ``act_seq`` (the
    residual stream's tokens) while a step was traced, so far: a step compares it before
    and after tracing a loss whose rules split ``act_seq`` over ``tensor`` (sequence
    parallelism), and refuses a model that never named it (the split would do nothing)."""
    return _STREAM_CALLS[0]


def constrain(x: jax.Array, names: AxisNames) -> jax.Array:
    """Pins activation ``x`` to the layout its logical ``names`` map to.

    Outside a jaxpar step (no active rules) this returns ``x`` unchanged.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    if any(ACT_SEQ in names_of(entry) for entry in names):
        _STREAM_CALLS[0] += 1
    mesh, rules, _ = active
    spec = spec_for(names, rules, mesh, x.shape, f"activation {tuple(names)}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def without_batch_axes(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` without the batch axes (``data``, ``fsdp``): a parameter sharded over them
    (FSDP) as it is gathered for use, its tensor and stage splits kept."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in names_of(entry) if a not in BATCH_AXES)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def gathered(w: jax.Array, names: AxisNames) -> jax.Array:
    """Weight ``w`` (its dims named ``names``) as a matmul reads it: gathered over the
    batch axes that shard it (FSDP), split as the rules split it otherwise. One gathered
    value then serves the forward pass and the backward pass's input gradient, where the
    partitioner may gather a weight outside a layer scan for each (docs/lab.md); the
    gradient passes through unconstrained. A ``custom_vjp``: reverse-mode only (no
    ``jax.jvp`` through it). Outside a jaxpar step this returns ``w`` unchanged."""
    active = _ACTIVE.get()
    if active is None:
        return w
    mesh, rules, _ = active
    spec = spec_for(names, rules, mesh, w.shape, f"weight {tuple(names)}")
    return _gather(w, NamedSharding(mesh, without_batch_axes(spec)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(w: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``w`` laid out as ``sharding``; its gradient passes through unconstrained, for the
    partitioner to reduce-scatter into the weight's own layout (a constraint's transpose
    would pin it gathered: an all-reduce of the whole gradient)."""
    return jax.lax.with_sharding_constraint(w, sharding)


def _gather_fwd(w: jax.Array, sharding: NamedSharding) -> tuple[jax.Array, None]:
    return _gather(w, sharding), None


def _gather_bwd(sharding: NamedSharding, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (g,)


_gather.defvjp(_gather_fwd, _gather_bwd)
