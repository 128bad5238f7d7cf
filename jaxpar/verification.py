"""Checking a checkpoint before and after it is restored: its files against the integrity
record written with it (:mod:`jaxpar.integrity`), its stored tree against the model's,
and its restored values finite. Each failure names the step, the path and what is wrong
(:class:`~jaxpar.errors.CorruptCheckpoint`; a different model is a
:class:`~jaxpar.errors.RestoreError` listing every mismatched path)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import integrity
from jaxpar.errors import CorruptCheckpoint, RestoreError
from jaxpar.sharding import path_str

#: files every checkpoint jaxpar writes holds (Orbax's metadata of its two items): one
#: without them and without an integrity record was emptied or partly copied, not written
#: by an older jaxpar
REQUIRED = ("state/_METADATA", "meta/metadata")


def verify_files(path: Path) -> integrity.Verification:
    """The files of the checkpoint in ``path`` checked against its integrity record; with
    several processes each reads its share of the files, and the result holds every
    process's problems."""
    result = integrity.verify(path, (jax.process_index(), jax.process_count()), required=REQUIRED)
    if jax.process_count() > 1:
        result.problems = _gather_problems(result.problems)
    return result


def check_verified(
    step: int, path: Path, result: integrity.Verification, stacklevel: int = 2
) -> None:
    """Judges the :func:`verify_files` ``result`` of checkpoint ``step`` (in ``path``): warns
    when the checkpoint has no record (written before jaxpar kept them), pointing
    ``stacklevel`` frames up.

    Raises:
      CorruptCheckpoint: naming the step, the path and the first problems found.
    """
    if result.problems:
        raise CorruptCheckpoint(step, path, integrity.summarize(result.problems))
    if not result.recorded:
        warnings.warn(
            f"the checkpoint of step {step} in {path} has no integrity record "
            f"({integrity.RECORD}: it was written by an older jaxpar); it is "
            "restored unverified (its values are still checked finite)",
            stacklevel=stacklevel + 1,
        )


def check_compatible(
    step_dir: Path, stored: Any, target: dict[str, Any], saved_with: Callable[[], str] = str
) -> None:
    """Compares the paths, shapes and dtypes of the checkpoint in ``step_dir`` (``stored``: its
    Orbax metadata) with the restore ``target``; ``saved_with`` names the settings the
    checkpoint was saved with that differ from the run's ("" where unknown).

    Raises:
      RestoreError: listing the mismatches, the parameters first.
    """
    have, want = _leaves(stored), _leaves(target)
    problems = {
        path: f"{path}: missing in the checkpoint (model expects {want[path]})"
        for path in set(want) - set(have)
    }
    problems |= {
        path: f"{path}: in the checkpoint {have[path]} but not in the model"
        for path in set(have) - set(want)
    }
    problems |= {
        path: f"{path}: checkpoint {have[path]}, model {want[path]}"
        for path in set(have) & set(want)
        if have[path] != want[path]
    }
    problems = [
        problems[p] for p in sorted(problems, key=lambda p: (not p.startswith("params"), p))
    ]  # the parameters first: they say the most
    if problems:
        differ = saved_with()
        settings = (
            f"the settings it was saved with: {differ}"
            if differ
            else "the settings it was saved with (a run dir's config.yaml edited by hand no "
            "longer holds them)"
        )
        raise RestoreError(
            f"checkpoint {step_dir} does not fit this model/optimizer "
            f"({len(problems)} mismatches: {integrity.summarize(problems, 6)}); run with "
            f"{settings}, or start afresh in a new run.dir"
        )


def check_finite(step: int, path: Path, tree: dict[str, Any]) -> None:
    """One jitted reduction per floating leaf of the restored ``tree``.

    Raises:
      CorruptCheckpoint: naming the leaves that are not finite.
    """
    leaves = [
        (path_str(p), x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    groups: dict[Any, list[tuple[str, jax.Array]]] = {}
    for name, x in leaves:  # one program per device set (a pipeline stage's sub-mesh)
        groups.setdefault(x.sharding.mesh, []).append((name, x))
    bad = []
    for mesh, group in groups.items():
        flags = jax.jit(
            lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]),
            out_shardings=NamedSharding(mesh, PartitionSpec()),
        )([x for _, x in group])
        flags = np.asarray(flags.addressable_data(0))
        bad += [name for (name, _), ok in zip(group, flags) if not ok]
    if bad:
        raise CorruptCheckpoint(
            step, path, f"non-finite values (inf or NaN) in {integrity.summarize(bad)}"
        )


def unreadable(step: int, path: Path, err: BaseException) -> CorruptCheckpoint:
    """The error of a checkpoint whose files Orbax cannot read (``err``)."""
    text = str(err).strip()
    first = text.splitlines()[0][:300] if text else type(err).__name__
    return CorruptCheckpoint(step, path, f"it cannot be read ({type(err).__name__}: {first})")


def _gather_problems(problems: list[str]) -> list[str]:
    """Every process's problems, on every process (a fixed-size all-gather of JSON)."""
    size = 4096
    text = json.dumps(problems[:20]).encode()
    while len(text) > size:  # keep it valid JSON: drop problems until it fits
        problems = problems[:-1]
        text = json.dumps(problems[:20]).encode()
    local = np.frombuffer(text.ljust(size, b" "), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, size)
    return [p for row in every for p in json.loads(row.tobytes().decode())]


def _leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Path → (shape, dtype) of every array leaf (Orbax metadata or abstract arrays); a
    typed PRNG key as Orbax stores it, its key data."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if getattr(leaf, "shape", None) is None:
            continue
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        out[path_str(path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return out
