"""Orbax checkpoints of a train state: async saves, restore onto any layout, checked restores.

A checkpoint is an Orbax ``CheckpointManager`` step directory with two items:
``state`` (step, params, optimizer state, skipped-step count and, for models that
have it, the non-parameter model state — BatchNorm statistics, RNG keys and
counts; standard Orbax array format) and ``meta`` (JSON: the seed, the resolved config and the metrics
of that step). Saves are asynchronous by default: the caller pays for the
device-to-host copy, Orbax writes in the background, and any write error is
raised as a :class:`CheckpointError` by the next :meth:`Checkpointer.save`,
:meth:`Checkpointer.wait` or :meth:`Checkpointer.close` — never swallowed. A
save in progress lives in a temporary directory that Orbax renames only when
complete, so an interrupted save is never listed.

Which checkpoints stay is an Orbax preservation policy: the latest ``keep``,
plus (with ``keep_best``) the ``keep_best`` best by an eval metric passed to
:meth:`Checkpointer.save`.

Restoring builds the target from the *current* trainer's shardings, so a
checkpoint saved under one mesh and rules restores under any other valid mesh,
rules and device count. Before reading any array, the stored tree is compared
with the trainer's: a different model is an error listing every mismatched
path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.sharding import path_str
from jaxpar.trainer import Trainer, TrainState


class CheckpointError(RuntimeError):
    """Writing a checkpoint failed (raised where the failure becomes known)."""


def _as_tree(state: TrainState) -> dict[str, Any]:
    """The saved tree; ``model_state`` (BatchNorm statistics, RNG streams) only when the
    model has such state, so checkpoints of parameter-only models keep their layout."""
    tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "skipped": state.skipped}
    if jax.tree.leaves(state.model_state):
        tree["model_state"] = state.model_state
    return tree


def _from_tree(tree: dict[str, Any]) -> TrainState:
    return TrainState(tree["step"], tree["params"], tree["opt_state"], tree["skipped"],
                      tree.get("model_state", {}))


class Checkpointer:
    """Saves and restores a :class:`~jaxpar.trainer.Trainer`'s state under ``directory``.

    Args:
      directory: where step directories go (created).
      trainer: gives the restore target (abstract state and shardings).
      keep: how many of the latest checkpoints to keep.
      async_save: write in the background (the default).
      keep_best: also keep this many best checkpoints by ``best_metric`` (0: off).
      best_metric: the key of the ``metrics`` given to :meth:`save` that ranks them.
      best_mode: ``min`` (a loss) or ``max`` (an accuracy).
    """

    def __init__(self, directory: str | Path, trainer: Trainer, *, keep: int = 3,
                 async_save: bool = True, keep_best: int = 0,
                 best_metric: str = "eval_loss", best_mode: str = "min"):
        self.directory = Path(directory).absolute()
        self.trainer = trainer
        self.best_metric = best_metric if keep_best else None
        policies = [ocp.checkpoint_managers.LatestN(n=keep)]
        rank = None
        if keep_best:
            def rank(metrics: dict[str, float]) -> float:
                return metrics[best_metric]

            policies.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=rank, n=keep_best,
                reverse=best_mode == "min",  # BestN keeps the end of the sorted list
                keep_checkpoints_without_metrics=False))
        # ``best_fn`` makes Orbax write each step's metrics to disk (a restarted run must
        # still rank the older checkpoints); which steps stay is the policy's alone.
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            best_fn=rank, best_mode=best_mode, enable_async_checkpointing=async_save,
            create=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    # ---- saving --------------------------------------------------------------------------
    def save(self, step: int, state: TrainState, meta: dict[str, Any] | None = None,
             metrics: dict[str, float] | None = None) -> None:
        """Starts saving ``state`` as ``step`` (returns once the arrays are copied to host).

        Raises:
          ValueError: with ``keep_best``, when ``metrics`` lacks the ranking metric.
          CheckpointError: when an earlier asynchronous save failed.
        """
        if self.best_metric and self.best_metric not in (metrics or {}):
            raise ValueError(
                f"checkpoint.best_metric={self.best_metric} is not among the metrics of step "
                f"{step} ({', '.join(sorted(metrics or {})) or 'none'}); pick one of them")
        args = ocp.args.Composite(state=ocp.args.StandardSave(_as_tree(state)),
                                  meta=ocp.args.JsonSave(meta or {}))
        with self._errors("saving"):
            self._manager.save(step, args=args, metrics=metrics, force=True)

    def wait(self) -> None:
        """Blocks until pending saves are written; raises their error if one failed."""
        with self._errors("writing"):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves (raising their error) and releases the manager."""
        with self._errors("writing"):
            self._manager.close()

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turns an Orbax write failure (now or from a background save) into CheckpointError."""
        try:
            yield
        except Exception as err:
            raise CheckpointError(
                f"{doing} a checkpoint in {self.directory} failed: {type(err).__name__}: {err}. "
                "The checkpoints listed there are complete; fix the cause (disk space, "
                "permissions, the file system) and resume with checkpoint.resume=auto"
            ) from err

    # ---- restoring -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def restore(self, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """The state (sharded for this trainer's mesh and rules) and meta of ``step``.

        Raises:
          ValueError: when there is no such checkpoint, or when it holds a
            different model or optimizer: every mismatched path is listed.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self.steps():
            raise ValueError(f"no complete checkpoint {'' if step is None else step} in "
                             f"{self.directory} (have: {self.steps() or 'none'})")
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            _as_tree(self.trainer.abstract_state), _as_tree(self.trainer.state_shardings))
        self._check_compatible(step, target)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return _from_tree(restored.state), dict(restored.meta or {})

    def _check_compatible(self, step: int, target: dict[str, Any]) -> None:
        """Compares the stored tree's paths, shapes and dtypes with ``target``."""
        stored = self._manager.item_metadata(step).state
        have = _leaves(stored)
        want = _leaves(target)
        problems = []
        for path in sorted(set(want) - set(have)):
            problems.append(f"{path}: missing in the checkpoint (model expects {want[path]})")
        for path in sorted(set(have) - set(want)):
            problems.append(f"{path}: in the checkpoint {have[path]} but not in the model")
        for path in sorted(set(have) & set(want)):
            if have[path] != want[path]:
                problems.append(f"{path}: checkpoint {have[path]}, model {want[path]}")
        if problems:
            raise ValueError(
                f"checkpoint {self.directory / str(step)} does not fit this model/optimizer "
                f"({len(problems)} mismatches):\n  " + "\n  ".join(problems)
                + "\nrestore it with the config it was saved with, or start without it "
                "(checkpoint.resume=never)")


def _leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Path → (shape, dtype) of every array leaf (Orbax metadata or abstract arrays); a
    typed PRNG key as Orbax stores it, its key data."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, leaf.dtype))
        out[path_str(path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return out
