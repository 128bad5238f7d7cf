"""``jaxpar train`` as a Python API: a loop of train steps with hooks.

:func:`train` builds a run from a config — the built-in model it names, or a user's
:class:`~jaxpar.task.Task` with its own data and Optax optimizer — prepares the run
dir, resumes from a checkpoint, and calls :func:`fit`: a loop that fetches a batch,
runs the step and calls the hooks (``jaxpar/hooks/``). The metrics file, progress,
TensorBoard, evaluation, checkpoints, the profiler and the non-finite guard are hooks
on that loop, and so is any hook a user passes or names in ``train.hooks``.
"""

from __future__ import annotations

import contextlib
import errno
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from jaxpar import compiler_notes, rundir
from jaxpar import config as config_lib
from jaxpar import resume as resume_lib
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.data import Loader
from jaxpar.errors import Preempted, RestoreError, UserCodeFailed
from jaxpar.export import export_params
from jaxpar.hooks import Context, Hook, default_hooks, load_hooks
from jaxpar.mesh import describe_devices, describe_mesh, setup_devices
from jaxpar.pipeline.chart import describe_pipeline
from jaxpar.run import Run, build, evaluate, host_value
from jaxpar.state import TrainState
from jaxpar.task import Task

__all__ = [
    "DataWait",
    "History",
    "Preempted",
    "Run",
    "build",
    "evaluate",
    "export_params",
    "fit",
    "open_loader",
    "prepare_run_dir",
    "summarize",
    "train",
]


@dataclass
class History:
    """What :func:`fit` returns: the logged rows (``metrics.jsonl``) and the final state."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    state: TrainState | None = None
    #: seconds spent on evaluation and checkpoints (``Context.paused``)
    paused: dict[str, float] = field(default_factory=dict)

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if "loss" in r]

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if "loss" not in r]


def prepare_run_dir(
    config: Config,
    start_step: int = 0,
    saved_config: dict[str, Any] | None = None,
    echo: bool = True,
) -> Path:
    """Creates the run dir and readies it for a run starting after ``start_step``
    (see :mod:`jaxpar.rundir`: nothing there is overwritten).

    ``metrics.jsonl`` keeps the rows of steps ≤ ``start_step`` (a resumed run appends
    after them without duplicating steps; later rows move to
    ``metrics.discarded.jsonl``); a fresh start keeps an earlier run's files as
    ``metrics.old-N.jsonl`` / ``config.old-N.yaml``. ``config.yaml`` is written on a
    fresh start; a resumed run whose settings differ from ``saved_config`` (its
    checkpoint's) writes ``config.<start_step>.yaml`` and says what changed.

    Raises:
      RestoreError: when the run dir cannot be created or written, or ``metrics.jsonl``
        has a damaged line before its last.
    """
    run_dir = rundir.ensure_dir(config.run.dir, "run.dir")
    for note in rundir.prepare(run_dir, config_lib.to_dict(config), start_step, saved_config):
        if echo:
            print(f"jaxpar: {note}", flush=True)
    return run_dir


class DataWait:
    """Time the loop spends waiting for host batches, per logging interval, and a one-time
    warning when, over at least 3 intervals after the first (compile-bound) one, more than
    ``data.wait_warn`` of the loop's time went to waiting."""

    MIN_INTERVALS = 3

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.seconds = 0.0
        self.warned = False
        self.intervals = 0
        self.total_wait = self.total_time = 0.0
        self.total_steps = 0

    def next(self, loader: Loader) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        batch = next(loader)
        self.seconds += time.perf_counter() - start
        return batch

    def fraction(self, interval_s: float, steps: int, cfg: Config) -> float:
        """The waiting share of the interval just ended (and resets the count)."""
        frac = min(self.seconds / max(interval_s, 1e-9), 1.0)
        self.intervals += 1
        if self.intervals > 1:
            self.total_wait += self.seconds
            self.total_time += interval_s
            self.total_steps += steps
        self.seconds = 0.0
        overall = self.total_wait / max(self.total_time, 1e-9)
        if (
            self.threshold
            and not self.warned
            and overall > self.threshold
            and self.intervals > self.MIN_INTERVALS
        ):
            self.warned = True
            warnings.warn(
                f"input-bound: the loop waited for data {overall:.0%} of the time over the "
                f"last {self.total_steps} steps ({self.total_time / self.total_steps * 1e3:.1f} "
                f"ms/step); raise data.threads={cfg.data.threads}, data.prefetch="
                f"{cfg.data.prefetch} or data.workers={cfg.data.workers} (warning threshold "
                f"data.wait_warn={self.threshold})",
                stacklevel=3,
            )
        return frac


def open_loader(
    run: Run, data_state: dict[str, Any] | None = None, step: int | None = None
) -> Loader:
    """The training stream, positioned after the batches a checkpoint's loader had read
    (with ``step``, the step that checkpoint holds: the position must match it).

    Raises:
      RestoreError: when the saved position comes from other data settings, or does not
        belong to ``step``.
    """
    loader = run.data.loader(run.config.train.batch_size, run.config.data)
    if data_state:
        try:
            loader.set_state(data_state)
        except ValueError as err:
            loader.close()
            raise RestoreError(
                f"the checkpoint's data position does not fit this run ({err}) — keep "
                "train.batch_size, run.seed and the data settings of the run you resume, "
                "or start afresh in a new run.dir"
            ) from err
    if step is not None and loader.batches_consumed != step:
        loader.close()
        raise RestoreError(
            f"the checkpoint of step {step} holds a data position after "
            f"{loader.batches_consumed} batches; it is not a jaxpar train "
            "checkpoint of this run — start afresh in a new run.dir"
        )
    return loader


def fit(
    run: Run,
    run_dir: Path | None = None,
    state: TrainState | None = None,
    ckpt: Checkpointer | None = None,
    data_state: dict[str, Any] | None = None,
    hooks: Sequence[Hook] = (),
    stream: Loader | None = None,
    echo: bool = True,
) -> History:
    """Trains for ``train.steps`` steps, calling the built-in hooks and then ``hooks``.

    Each step's metrics reach the hooks' ``on_step`` one step late (read while the next
    step runs), so the loop never waits for the device on the hot path. A ``state``
    passed in continues from its step, and ``data_state`` (the loader position saved
    with it) makes the loader yield the batches the uninterrupted run would have; with
    ``ckpt`` the state and the loader position are saved every ``checkpoint.every_steps``,
    after the last step and when the run is preempted (then :class:`~jaxpar.errors.
    Preempted` is raised once the save is complete, unless the step was the last).
    ``stream`` is the training stream already positioned (by :func:`open_loader`); fit
    opens it otherwise, and closes it at the end. ``echo=False`` shows no progress.
    """
    state = state if state is not None else run.trainer.init()
    first = int(host_value(state.step)) + 1
    stream = stream if stream is not None else open_loader(run, data_state, first - 1)
    wait = DataWait(run.config.data.wait_warn)
    ctx = Context(
        run,
        run_dir,
        state,
        first,
        run.config.train.steps,
        stream,
        [*default_hooks(run, run_dir, ckpt, wait, echo), *hooks],
    )
    try:
        ctx.emit("on_start")
        for step in range(first, ctx.last_step + 1):
            if step == first:  # its compilation: XLA's warnings explained
                with compiler_notes.explained(_parameters_by_shape(run)):
                    _train_step(ctx, step, wait, ckpt)
            else:
                _train_step(ctx, step, wait, ckpt)
    except UserCodeFailed as err:  # a loss traced as the step compiles: say which step
        ctx.error = err.where(f"at step {ctx.current_step}")
        raise ctx.error from err.__cause__
    except BaseException as err:
        ctx.error = err
        raise
    finally:
        stream.close()
        ctx.emit("on_end")
    return History(ctx.rows, ctx.state, dict(ctx.paused))


def _parameters_by_shape(run: Run) -> dict[tuple[int, ...], str]:
    """The path of a parameter of each shape (to name what a compiler warning names)."""
    leaves = jax.tree_util.tree_leaves_with_path(run.plan.model.params)
    return {
        tuple(leaf.shape): "/".join(str(getattr(k, "key", k)) for k in path)
        for path, leaf in leaves
    }


def _train_step(ctx: Context, step: int, wait: DataWait, ckpt: Checkpointer | None) -> None:
    """One step of :func:`fit`: fetch, step (marked ``train`` with its ``step_num`` in
    profiler traces), deliver the previous step's metrics, raise the step's events, and
    stop after a checkpoint when the run is preempted."""
    trainer = ctx.run.trainer
    ctx.current_step = step
    ctx.emit("before_step", step)
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
        batch = trainer.shard_batch(wait.next(ctx.stream))
        ctx.state, ctx.step_metrics = trainer.step(ctx.state, batch)
    ctx.stopping = ckpt is not None and resume_lib.preempted(step)
    ctx.flush()  # the previous step's metrics, read while this step runs
    ctx.pending.append((step, ctx.step_metrics))
    ctx.emit("on_state", step)
    if step == ctx.last_step or ctx.stopping:
        ctx.flush()
    if ctx.stopping and step < ctx.last_step:
        raise Preempted(step, ckpt.directory, resume_lib.stop_signal())


def summarize(run: Run, history: History) -> str:
    """The final summary: steps, final loss and the last eval metrics, throughput (the median
    over the logged intervals after the first, which holds the compile; evaluation and
    checkpoint time left out and reported apart), per-device state bytes."""
    rows = history.train_rows
    if not rows:
        return "no step was logged"
    last = rows[-1]
    evals = history.eval_rows
    state = run.plan.state_bytes()
    shown = "".join(
        f"  {k.replace('_', ' ')}: {v:.4f}"
        for k, v in (evals[-1] if evals else {}).items()
        if k.startswith("eval_") and k != "eval_time_s"
    )
    steady = rows[1:] or rows
    examples = statistics.median(r["examples_per_s"] for r in steady)
    tokens = (
        f", {statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s"
        if "tokens_per_s" in last
        else ""
    )
    apart = ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in history.paused.items())
    lines = [
        f"steps: {last['step']}  final loss: {last['loss']:.4f}{shown}",
        f"throughput: {examples:,.1f} examples/s{tokens} (median of {len(steady)} logged "
        f"interval{'s' * (len(steady) != 1)}); first step logged after {rows[0]['time']:.1f} s "
        f"(compile included)" + (f"; not counted: {apart}" if apart else ""),
        f"state per device: params {state.params / 2**20:.2f} MiB, optimizer "
        f"{state.opt_state / 2**20:.2f} MiB" + (" (in host memory)" if state.host else ""),
        f"skipped non-finite steps: {last['skipped']}",
    ]
    return "\n".join(lines)


def _setup_devices(count: int) -> None:
    """Simulated CPU devices for a script that calls :func:`train` before using JAX (the
    CLI does this itself); on an accelerator, or once JAX runs, the devices stand. A count
    already set (a script's ``setup_devices(8)``) is never lowered: ``run.devices`` then
    takes the first devices, so the script's later layouts still have all of them."""
    if max(count, 1) <= jax.config.jax_num_cpu_devices:
        return
    try:
        setup_devices(count)
    except ValueError:
        if jax.default_backend() == "cpu":
            raise


def train(
    config: Config | None = None,
    *,
    task: Task | None = None,
    optimizer: optax.GradientTransformation | None = None,
    hooks: Sequence[Hook] = (),
    echo: bool = True,
) -> History:
    """Runs ``jaxpar train``: lock the run dir, build, resume, write the run dir, fit,
    summarize.

    The run holds the locks of ``run.dir`` and ``checkpoint.dir`` throughout;
    ``checkpoint.resume=auto`` falls back past checkpoints that fail verification; the run
    dir is written only once the resume decision stands (see :mod:`jaxpar.rundir`); a
    SIGTERM or a first Ctrl-C checkpoints the current step.

    Args:
      config: the run configuration (default: ``jaxpar.load_config()``).
      task: a user's :class:`~jaxpar.task.Task` (default: the built-in model
        ``config.model.name``).
      optimizer: any Optax transformation (default: ``task.optimizer``, else the config's
        ``optim`` section).
      hooks: extra hooks, called after the built-in ones and those named in
        ``train.hooks``.
      echo: print the start-up lines, the progress and the summary (process 0);
        ``False``: nothing on stdout (warnings still go to stderr).

    Raises:
      ConfigError, LayoutError, DataError, TaskError, PathError, RestoreError: a bad
        setting, layout, data, task, path (a run dir another run holds: ``RunDirBusy``)
        or checkpoint (all ``jaxpar.errors.JaxparError`` and ``ValueError``).
      Preempted: after a SIGTERM or a first Ctrl-C, once the checkpoint is written.
      NonFiniteStop: a non-finite step (``TooManySkipped`` under ``train.nonfinite=skip``).
      CheckpointError: a checkpoint could not be written.
    """
    config = config if config is not None else config_lib.load_config()
    if task is not None:
        config = config_lib.run_dir_for(config, task.name)
    hooks = [*load_hooks(config.train.hooks), *hooks]
    _setup_devices(config.run.devices)
    with _locked_run_dirs(config):
        run = build(config, task, optimizer, fit_memory=True)
        say = print if echo and jax.process_index() == 0 else (lambda *a, **k: None)
        say(
            f"jaxpar: running on {describe_devices(run.devices)}; {describe_mesh(run.plan.mesh)}",
            flush=True,
        )
        say(
            f"jaxpar: data {run.data.name}; model {run.name}; rules preset {config.rules.preset}",
            flush=True,
        )
        if run.plan.pipeline is not None:
            say(f"jaxpar: {describe_pipeline(run.plan.pipeline, run.plan.executor)}", flush=True)
        history = _resume_and_fit(run, hooks, say, echo)
    if history.rows:
        say(summarize(run, history), flush=True)
    return history


def _locked_run_dirs(config: Config) -> Any:
    """The locks of the run dir and of the checkpoint dir, wherever it lies (process 0
    takes them; every process learns whether it could): a run whose ``checkpoint.dir``
    points into another run's directory is refused, not let write there."""
    run_dir = Path(config.run.dir).absolute()
    ckpt_dir = resume_lib.checkpoint_dir(config).absolute()
    dirs = [(run_dir, "run.dir")]
    if run_dir.resolve() != ckpt_dir.resolve():
        dirs.append((ckpt_dir, "checkpoint.dir"))
    return rundir.locked(dirs)


def _resume_and_fit(run: Run, hooks: Sequence[Hook], say: Any, echo: bool) -> History:
    """Resume (falling back past checkpoints that fail verification), position the data,
    and only then write the run dir; fit; wait for the last save."""
    config = run.config
    ckpt = resume_lib.open_checkpoints(run)
    closed = False
    try:
        state, start, meta, source = resume_lib.resume(config, run, ckpt)
        if start >= config.train.steps:
            say(
                f"jaxpar: the run in {config.run.dir} is finished (step {start} of "
                f"train.steps={config.train.steps}); to train it longer, run again with "
                f"train.steps=N (N > {start}); to start fresh, pass run.dir=NEW_DIR (or "
                f"delete {config.run.dir})"
            )
            return History(state=state)
        data_state = meta.get("data")  # not a mesh axis: the loader's position
        stream = open_loader(run, data_state, start) if start else None
        try:
            if start:
                say(
                    f"jaxpar: resumed from the checkpoint of step {start} in {source}",
                    flush=True,
                )
            run_dir = (
                prepare_run_dir(config, start, meta.get("config"), echo)
                if jax.process_index() == 0
                else None
            )
        except BaseException:
            if stream is not None:
                stream.close()
            raise
        with resume_lib.sigterm_checkpoints():  # also while the last save is written
            try:
                return fit(run, run_dir, state, ckpt, data_state, hooks, stream, echo)
            except UserCodeFailed as err:
                with contextlib.suppress(Exception):  # a save in flight (close raises its error)
                    ckpt.wait()
                if ckpt.latest_step() is not None or config.checkpoint.resume != "auto":
                    raise  # (a named checkpoint is what the same command starts from again)
                raise err.where(then=UserCodeFailed.RESTARTS) from err.__cause__
            except OSError as err:
                if err.errno == errno.ENOSPC and not err.filename:  # say where
                    raise OSError(
                        errno.ENOSPC, err.strerror or "No space left on device", str(config.run.dir)
                    ) from err
                raise
            finally:
                closed = True
                ckpt.close()  # waits for pending saves; a failed save raises here
    finally:
        if not closed:
            ckpt.close()
