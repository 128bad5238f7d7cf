"""Parameter and optimizer-state shardings from the rules (:mod:`jaxpar.rules`), their
bytes per device, and the sharding report."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import TaskError
from jaxpar.logical import Rules, spec_for, spec_leaves

PathRules = Sequence[tuple[str, tuple[str | None, ...]]]


def path_str(path: tuple[Any, ...]) -> str:
    """'blocks/wq' from a pytree key path."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


#: Where Flax keeps the logical names that ``nnx.with_partitioning(init, names)`` and
#: ``nnx.Param(value, out_sharding=names)`` attach to a variable: ``out_sharding`` (Flax
#: 0.12), ``sharding_names`` (0.11) and ``sharding`` (0.10 and older).
FLAX_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")


def variable_names(var: nnx.Variable, where: str) -> tuple[Any, ...] | None:
    """The logical names Flax's metadata gives ``var`` (one per dim), or None.

    Raises:
      TaskError: when the metadata holds a concrete sharding instead of names.
    """
    meta = var.get_metadata()
    for key in FLAX_NAME_KEYS:
        names = meta.get(key)
        if names is None:
            continue
        if isinstance(names, PartitionSpec | list):
            names = tuple(names)
        if not isinstance(names, tuple):
            raise TaskError(
                f"variable '{where}' carries {key}={names!r}, a concrete sharding; jaxpar needs "
                f"logical names, e.g. nnx.with_partitioning(init, ('embed', 'mlp')), which the "
                f"rules table maps onto the mesh"
            )
        return names
    return None


def logical_axes(
    abstract_state: nnx.State, path_rules: PathRules = ()
) -> tuple[dict[str, Any], list[str]]:
    """Logical names of every variable, as a pure dict like the state, and the paths of
    the variables that have none.

    A variable's names come from Flax's sharding metadata (:data:`FLAX_NAME_KEYS`);
    for one without, the first regex of ``path_rules`` that matches its path
    ('dense1/kernel') gives them. A variable with neither gets ``None`` for every
    dim (replicated); its path is returned so the caller can say so.
    """
    unnamed: list[str] = []

    def names_of(path: tuple[Any, ...], var: nnx.Variable) -> tuple[Any, ...]:
        where = path_str(path)
        names = variable_names(var, where)
        if names is not None:
            return names
        for pattern, rule_names in path_rules:
            if re.fullmatch(pattern, where):
                return tuple(rule_names)
        unnamed.append(where)
        return (None,) * len(var.shape)

    leaves = jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    names = [names_of(path, var) for path, var in leaves]
    # the structure of nnx.to_pure_dict(state), with a tuple of names for each variable
    structure = jax.tree.structure(nnx.to_pure_dict(abstract_state))
    return jax.tree.unflatten(structure, names), unnamed


#: Logical names whose rule falls back to not sharded, with a warning, where its mesh axes do
#: not divide a parameter's dim: grouped-query attention's key/value heads when the tensor
#: degree exceeds them (each device of a tensor group then holds every key/value head, as
#: Megatron and MaxText replicate them).
SOFT_NAMES = ("kv_heads",)


def fit_soft_rules(rules: Rules, abstract_params: Any, axes: Any, mesh: Mesh) -> Rules:
    """``rules`` with the rule of each :data:`SOFT_NAMES` name dropped (and a warning
    saying so) where its mesh axes do not divide a parameter dim of that name."""
    fitted = dict(rules)

    def check(path, leaf, names):
        for dim, entry in enumerate(names):
            for name in entry if isinstance(entry, tuple) else (entry,):
                axes_ = fitted.get(name, ()) if name in SOFT_NAMES else ()
                ways = math.prod(mesh.shape.get(a, 1) for a in axes_)
                if ways > 1 and leaf.shape[dim] % ways:
                    warnings.warn(
                        f"rules.{name}={','.join(axes_)}: {leaf.shape[dim]} {name} of "
                        f"'{path_str(path)}' do not split {ways} ways, so they are not sharded "
                        f"(every device of the group holds them all); set rules.{name}=null "
                        "to say so",
                        stacklevel=4,
                    )
                    fitted[name] = ()
        return None

    jax.tree_util.tree_map_with_path(
        check, abstract_params, axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    return fitted


def param_specs(
    abstract_params: Any, axes: Any, rules: Rules, mesh: Mesh, what: str = "parameter"
) -> Any:
    """``PartitionSpec`` per parameter (pure dict), with every rule check applied; ``what``
    names the arrays in errors (``parameter``, ``model state``)."""

    def one(path, leaf, names):
        return spec_for(names, rules, mesh, leaf.shape, f"{what} '{path_str(path)}'")

    return jax.tree_util.tree_map_with_path(
        one, abstract_params, axes, is_leaf=lambda x: isinstance(x, tuple)
    )


def param_positions(abstract_opt: Any, abstract_params: Any) -> Any:
    """Which parameter each leaf of an Optax state belongs to: a tree like the state with,
    for each leaf, the index of its parameter among the parameters' leaves, or -1.

    Optax keeps per-parameter statistics (momenta, accumulated gradients) in subtrees
    with the parameters' structure — ``optax.masked`` puts a ``MaskedNode`` where a
    parameter is left out (kept as it is here). Each such subtree is matched to the
    parameters position by position; any other leaf (step counts, injected
    hyperparameters) belongs to none. Nothing is guessed from key names or shapes alone.

    ``optax.tree_utils.tree_map_params`` finds the same subtrees by calling the
    optimizer's ``init`` on an opaque placeholder, which fails for optimizers whose
    ``init`` reads the parameters (Adafactor, ``MultiSteps``, a callable mask); the
    structural match here works from the abstract state itself.
    """
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    params_def = jax.tree.structure(abstract_params)

    def params_like(node: Any) -> bool:
        if node is None or is_masked(node):
            return False
        try:
            return jax.tree.structure(node, is_leaf=is_masked) == params_def
        except Exception:  # a node JAX cannot flatten is no parameter tree
            return False

    def one(node: Any) -> Any:
        if not params_like(node):
            return node if is_masked(node) else -1
        leaves, treedef = jax.tree.flatten(node, is_leaf=is_masked)
        return jax.tree.unflatten(
            treedef, [leaf if is_masked(leaf) else i for i, leaf in enumerate(leaves)]
        )

    return jax.tree.map(one, abstract_opt, is_leaf=params_like)


def opt_state_specs(
    abstract_opt: Any, abstract_params: Any, specs: Any
) -> tuple[Any, list[tuple[str, tuple[int, ...]]]]:
    """Specs for an Optax state, from its structure (:func:`param_positions`), and the
    leaves left replicated: a leaf of its parameter's shape gets that parameter's spec;
    any other leaf (step counts, injected hyperparameters, Adafactor's factored rows and
    columns) is replicated.

    Returns:
      The spec tree (with the state's structure) and ``(path, shape)`` of every
      non-scalar leaf that is replicated because it is not parameter-shaped.
    """
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    param_leaves = jax.tree.leaves(abstract_params)
    specs = spec_leaves(specs)
    replicated: list[tuple[str, tuple[int, ...]]] = []

    def leaf_spec(path: tuple, leaf: Any, index: Any) -> Any:
        if is_masked(leaf):
            return leaf
        if index >= 0 and tuple(leaf.shape) == tuple(param_leaves[index].shape):
            return specs[index]
        if math.prod(getattr(leaf, "shape", ())) > 1:
            replicated.append((path_str(path), tuple(leaf.shape)))
        return PartitionSpec()

    positions = param_positions(abstract_opt, abstract_params)
    tree = jax.tree_util.tree_map_with_path(leaf_spec, abstract_opt, positions, is_leaf=is_masked)
    return tree, replicated


def named(mesh: Mesh, specs: Any) -> Any:
    """``NamedSharding`` tree from a ``PartitionSpec`` tree."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def placed_shapes(tree: Any, shardings: Any) -> Any:
    """``tree``'s leaves as ``ShapeDtypeStruct``s laid out by ``shardings`` (a tree of the
    same structure): what a program is lowered for without any array allocated."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def itemsize(dtype: Any) -> int:
    """Bytes per element, also of typed PRNG keys (stored as their key data)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return np.dtype(dtype).itemsize


def bytes_by_device(abstract: Any, shardings: Any) -> dict[Any, int]:
    """Bytes each device holds of a sharded tree (each leaf's shard on every device of its
    sharding: all of them, or one pipeline stage's)."""
    held: dict[Any, int] = {}
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        nbytes = math.prod(sharding.shard_shape(leaf.shape)) * itemsize(leaf.dtype)
        # an abstract mesh (a plan for devices not here) holds each leaf on all its devices
        concrete = isinstance(getattr(sharding, "mesh", None), Mesh) or not hasattr(
            sharding, "mesh"
        )
        for device in sharding.device_set if concrete else ("every device",):
            held[device] = held.get(device, 0) + nbytes
    return held


def bytes_per_device(abstract: Any, shardings: Any) -> int:
    """Bytes the most loaded device holds of a sharded tree (:func:`bytes_by_device`)."""
    return max(bytes_by_device(abstract, shardings).values(), default=0)


def total_bytes(abstract: Any) -> int:
    """Bytes of a whole (unsharded) tree."""
    return sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(abstract))


@dataclass(frozen=True)
class ParamRow:
    """One row of the sharding report."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    spec: PartitionSpec
    bytes_per_device: int


def param_rows(abstract_params: Any, axes: Any, shardings: Any) -> list[ParamRow]:
    """The per-parameter rows of the sharding report."""
    rows = []
    flat = jax.tree_util.tree_leaves_with_path(abstract_params)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    for (path, leaf), names, sharding in zip(flat, flat_axes, jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        rows.append(
            ParamRow(
                path_str(path),
                tuple(leaf.shape),
                names,
                sharding.spec,
                math.prod(shard) * itemsize(leaf.dtype),
            )
        )
    return rows


def place_params(host: Any, abstract: Any, shardings: Any) -> Any:
    """Host (numpy) parameters as global arrays with ``shardings``: each process copies
    only the slices its devices hold (``jax.make_array_from_callback``).

    Raises:
      TaskError: naming each parameter that is missing, extra or of another shape.
    """
    given = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(host)}
    wanted = {path_str(p): a for p, a in jax.tree_util.tree_leaves_with_path(abstract)}
    problems = [f"{k} missing" for k in wanted if k not in given]
    problems += [f"{k} is not a parameter of the model" for k in given if k not in wanted]
    problems += [
        f"{k} has shape {tuple(np.shape(given[k]))}, the model's is {a.shape}"
        for k, a in wanted.items()
        if k in given and np.shape(given[k]) != a.shape
    ]
    if problems:
        raise TaskError("the initial parameters do not fit the model: " + "; ".join(problems))

    def place(path: Any, a: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.Array:
        x = given[path_str(path)]
        return jax.make_array_from_callback(
            a.shape, sharding, lambda index: np.asarray(x[index], dtype=a.dtype)
        )

    return jax.tree_util.tree_map_with_path(place, abstract, shardings)
