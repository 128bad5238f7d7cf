"""Orbax checkpoints of a train state: async saves, restore onto any layout, checked restores.

A checkpoint is an Orbax ``CheckpointManager`` step directory with two items: ``state``
(step, params, optimizer state, skipped-step count and, for models that have it, the
non-parameter model state — BatchNorm statistics, RNG keys and counts; standard Orbax array
format) and ``meta`` (JSON: the seed, the resolved config and the metrics of that step).
Saves are asynchronous by default: the caller pays for the device-to-host copy, Orbax writes
in the background, and any write error is raised as a :class:`CheckpointError` by the next
:meth:`Checkpointer.save`, :meth:`Checkpointer.wait` or :meth:`Checkpointer.close` — never
swallowed. A save in progress lives in a temporary directory that Orbax renames only when
complete, so an interrupted save is never listed.

Which checkpoints stay is an Orbax preservation policy: the latest ``keep``, plus (with
``keep_best``) the ``keep_best`` best by an eval metric passed to :meth:`Checkpointer.save`;
an older one that cannot be deleted (read-only, immutable) is a warning, not a failed save.

Restoring builds the target from the *current* plan's shardings, so a checkpoint saved under
one mesh and rules restores under any other valid mesh, rules and device count. Before
reading any array, the stored tree is compared with the plan's: a different model is an
error listing every mismatched path.

Every checkpoint is verified (:mod:`jaxpar.integrity`, :mod:`jaxpar.verification`): the
digest of each of its files is recorded before Orbax commits it, and checked before it is
restored; the restored values are checked finite. A checkpoint that fails is a
:class:`CorruptCheckpoint` naming its step, its path and what is wrong.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from pydantic import Field

from jaxpar import integrity, verification
from jaxpar.errors import CheckpointError, ConfigError, RestoreError
from jaxpar.files import disk_full_cause, free_space
from jaxpar.plan import Plan
from jaxpar.schema import section
from jaxpar.sharding import placed_shapes
from jaxpar.state import TrainState


@section("checkpoint")
class CheckpointConfig:
    """Orbax checkpoints of the train state (see ``jaxpar/checkpoint.py``)."""

    dir: str = Field("", description="where checkpoints go (empty: <run.dir>/checkpoints)")
    every_steps: int = Field(
        0, ge=0, description="save every this many steps (0: only after the last step)"
    )
    keep: int = Field(3, ge=1, description="how many of the latest to keep")
    keep_best: int = Field(
        0,
        ge=0,
        description="also keep this many best by best_metric, evaluated at every save (0: off)",
    )
    best_metric: str = Field("eval_loss", description="the eval_* metric keep_best ranks by")
    best_mode: Literal["min", "max"] = Field(
        "min", description="whether the best best_metric is the lowest or the highest"
    )
    async_save: bool = Field(True, description="write in the background")
    resume: str = Field(
        "auto",
        description="auto (continue from the latest complete "
        "checkpoint in dir if there is one), never, a step number in dir, or "
        "the path of a checkpoint directory",
    )
    verify: bool = Field(
        True,
        description="check each file of a checkpoint against the digests "
        "recorded when it was written before restoring it (auto falls back to "
        "the newest checkpoint that verifies); restored values are checked "
        "finite either way",
    )


def _write_whole_shards_in_one_process() -> None:
    """In a single process, Orbax's stock array handler without replica-parallel saving
    (Orbax's default off GPU: a slice per replica, each a compiled ``jit_slice`` — a 0.15
    MiB GPT state on 8 devices saved in 3.6 s, 0.1 s without; the same files). Only the
    stock handler is replaced (a user's is left alone); multi-process runs keep it."""
    if jax.process_count() != 1:
        return
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if type(handler) is ocp.type_handlers.ArrayHandler:
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # no "overriding jax.Array"
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
            )
        finally:
            absl.setLevel(level)


def _as_tree(state: TrainState) -> dict[str, Any]:
    """The saved tree; ``model_state`` (BatchNorm statistics, RNG streams) only when the
    model has such state, so checkpoints of parameter-only models keep their layout."""
    tree = {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "skipped": state.skipped,
    }
    if jax.tree.leaves(state.model_state):
        tree["model_state"] = state.model_state
    return tree


def _from_tree(tree: dict[str, Any]) -> TrainState:
    return TrainState(
        tree["step"],
        tree["params"],
        tree["opt_state"],
        tree["skipped"],
        tree.get("model_state", {}),
    )


class Checkpointer:
    """Saves and restores the train state of a :class:`~jaxpar.plan.Plan` under ``directory``.

    Args:
      directory: where step directories go (created).
      plan: gives the restore target (abstract state and shardings).
      keep: how many of the latest checkpoints to keep.
      async_save: write in the background (the default).
      keep_best: also keep this many best checkpoints by ``best_metric`` (0: off).
      best_metric: the key of the ``metrics`` given to :meth:`save` that ranks them.
      best_mode: ``min`` (a loss) or ``max`` (an accuracy).
      verify: check a checkpoint's files against its integrity record before restoring
        it (its values are checked finite either way).
    """

    def __init__(
        self,
        directory: str | Path,
        plan: Plan,
        *,
        keep: int = 3,
        async_save: bool = True,
        keep_best: int = 0,
        best_metric: str = "eval_loss",
        best_mode: str = "min",
        verify: bool = True,
        settings: dict[str, Any] | None = None,
    ):
        self.directory = Path(directory).absolute()
        self.plan = plan
        #: the run's config as a plain dict (``jaxpar.config.load.to_dict``): a checkpoint
        #: of another model names the settings it was saved with that differ
        self.settings = settings
        self.best_metric = best_metric if keep_best else None
        self.async_save = async_save
        self.verify = verify
        self._saving: int | None = None
        #: seconds and bytes of the last verification (the docs' cost figure:
        #: docs/performance.md)
        self.last_verification: integrity.Verification | None = None
        policies = [ocp.checkpoint_managers.LatestN(n=keep)]
        rank = None
        if keep_best:

            def rank(metrics: dict[str, float]) -> float:
                return metrics[best_metric]

            policies.append(
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=rank,
                    n=keep_best,
                    reverse=best_mode == "min",  # BestN keeps the end of the sorted list
                    keep_checkpoints_without_metrics=False,
                )
            )
        # ``best_fn`` makes Orbax write each step's metrics to disk (a restarted run must still
        # rank the older checkpoints); which steps stay is the policy's alone. Saves always go
        # through Orbax's async checkpointer, whose post-finalization callback runs in its
        # background thread after every file of the step is written and before the temporary
        # directory is renamed: there the integrity record is written (a synchronous save just
        # waits for it); then it deletes the checkpoints past ``keep`` (``_delete_or_warn``).
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            best_fn=rank,
            best_mode=best_mode,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_record),
            create=True,
        )
        _write_whole_shards_in_one_process()
        with self._errors("creating the checkpoint directory"):
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    "state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(),
                },
            )
        if hasattr(deleter := getattr(self._manager, "_checkpoint_deleter", None), "delete"):
            deleter.delete = functools.partial(_delete_or_warn, deleter.delete, self.directory)

    # ---- saving --------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: TrainState,
        meta: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Starts saving ``state`` as ``step`` (returns once the arrays are copied to host).

        Raises:
          ConfigError: with ``keep_best``, when ``metrics`` lacks the ranking metric.
          CheckpointError: when an earlier asynchronous save failed.
        """
        if self.best_metric and self.best_metric not in (metrics or {}):
            raise ConfigError(
                f"checkpoint.best_metric={self.best_metric} is not among the metrics of step "
                f"{step} ({', '.join(sorted(metrics or {})) or 'none'}); pick one of them"
            )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_as_tree(state)), meta=ocp.args.JsonSave(meta or {})
        )
        with self._errors("saving"):
            # Orbax waits for the previous save before starting this one anyway; waiting
            # here first tells the record callback which step it is writing for.
            self._manager.wait_until_finished()
            self._saving = step
            self._manager.save(step, args=args, metrics=metrics, force=True)
        if not self.async_save:
            self.wait()

    def _write_record(self) -> None:
        """Orbax's post-finalization callback (background thread, primary process): the
        integrity record of the step being saved, inside its still temporary directory."""
        step = self._saving
        tmp = sorted(
            self.directory.glob(f"{step}.orbax-checkpoint-tmp*"), key=lambda p: p.stat().st_mtime
        )
        integrity.write_record(tmp[-1] if tmp else self.path(step))

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
            if (cause := disk_full_cause(err)) is not None:
                error = CheckpointError(
                    f"disk full: {doing} a checkpoint in {self.directory} failed: "
                    f"{str(cause).splitlines()[0]} ({free_space(self.directory)} there). The "
                    "checkpoints listed there are complete; free space (or lower "
                    "checkpoint.keep) and resume with checkpoint.resume=auto"
                )
                error.disk_full = True
                raise error from err
            raise CheckpointError(
                f"{doing} a checkpoint in {self.directory} failed: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}. The checkpoints listed there "
                "are complete; fix the cause (disk space, permissions, the file system) and "
                "resume with checkpoint.resume=auto"
            ) from err

    # ---- restoring -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def path(self, step: int) -> Path:
        """The directory of checkpoint ``step``."""
        return self.directory / str(step)

    def restore(self, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """The state (sharded for the plan's mesh and rules) and meta of ``step``, verified:
        its files match its integrity record (unless ``verify`` is off) and every restored
        value is finite.

        Raises:
          CorruptCheckpoint: when the checkpoint fails verification, cannot be decoded
            or holds non-finite values.
          RestoreError: when there is no such checkpoint, or when it holds a
            different model or optimizer: every mismatched path is listed.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self.steps():
            raise RestoreError(
                f"no complete checkpoint{'' if step is None else f' {step}'} in "
                f"{self.directory} (have: {self.steps() or 'none'})"
            )
        if self.verify:
            self.verify_step(step)
        target = placed_shapes(
            _as_tree(self.plan.abstract_state), _as_tree(self.plan.state_shardings)
        )
        try:
            verification.check_compatible(
                self.path(step),
                self._manager.item_metadata(step).state,
                target,
                lambda: self._saved_with(step),
            )
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as err:
            # verified files are intact: the error is the error; else an unreadable file is damage
            if isinstance(err, RestoreError) or not self._unverified():
                raise
            raise verification.unreadable(step, self.path(step), err) from err
        verification.check_finite(step, self.path(step), restored.state)
        return _from_tree(restored.state), dict(restored.meta or {})

    def _saved_with(self, step: int) -> str:
        """The settings checkpoint ``step`` was saved with that differ from
        :attr:`settings` and may shape its arrays — the ``model`` section's and
        ``optim.name`` (``model.d_ff=512 (this run: 256)``; a learning rate shapes none);
        "" where either is unknown."""
        if not self.settings:
            return ""
        try:
            saved = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            ).meta["config"]
            pairs = [("model", k, v) for k, v in sorted(saved["model"].items())]
            pairs.append(("optim", "name", saved["optim"]["name"]))
        except Exception:  # a checkpoint without its config: the generic advice
            return ""
        return ", ".join(
            f"{section}.{key}={value} (this run: {self.settings[section].get(key)})"
            for section, key, value in pairs
            if section in self.settings and value != self.settings[section].get(key)
        )

    def _unverified(self) -> bool:
        """Whether the checkpoint being restored was not checked against a record."""
        return not self.verify or not getattr(self.last_verification, "recorded", False)

    def verify_step(self, step: int) -> integrity.Verification:
        """Checks checkpoint ``step``'s files against its integrity record; with several
        processes each reads its share of the files and all agree on the result. Warns when
        the checkpoint has no record (written before jaxpar kept them).

        Raises:
          CorruptCheckpoint: naming the step, the path and the first problems found.
        """
        result = verification.verify_files(self.path(step))
        self.last_verification = result
        verification.check_verified(step, self.path(step), result, stacklevel=3)
        return result

    def set_aside(self, step: int) -> Path:
        """Renames checkpoint ``step`` to ``<step>.corrupt`` (kept for inspection, never
        listed, never pruned) and returns the new path; a RestoreError if it cannot."""
        src = self.path(step)
        dst = self.directory / f"{step}.corrupt"
        n = 1
        while dst.exists():
            n += 1
            dst = self.directory / f"{step}.corrupt-{n}"
        if jax.process_index() == 0:
            try:
                os.replace(src, dst)
            except OSError as err:  # e.g. an immutable directory
                raise RestoreError(
                    f"moving the checkpoint of step {step} in {src} aside (it "
                    f"failed verification) failed: {err.strerror or err}: "
                    f"{err.filename}; make it writable or move it away by "
                    "hand"
                ) from err
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxpar set aside checkpoint {step}")
        self._manager.reload()
        return dst


def _delete_or_warn(delete: Callable[[int], None], directory: Path, step: int) -> None:
    """Orbax's deletion of an old checkpoint; a failure only leaves it on disk: a warning."""
    try:
        delete(step)
    except OSError as err:
        warnings.warn(
            f"could not delete the old checkpoint of step {step} in {directory}/{step} "
            f"({err.strerror or err}: {err.filename}); delete it by hand — training "
            "goes on",
            stacklevel=2,
        )
