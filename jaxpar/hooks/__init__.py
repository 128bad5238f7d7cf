"""Hooks on the training loop (see :mod:`jaxpar.hooks.base` for the protocol).

Built in: :class:`MetricsLog` (``metrics.jsonl``), :class:`Progress`,
:class:`TensorBoard`, the experiment trackers :class:`WandB` and :class:`MLflow`,
:class:`Evaluation`, :class:`Checkpointing`, :class:`Profiler` and
:class:`NonFiniteGuard`; :func:`default_hooks` assembles them from a run's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxpar.errors import TaskError
from jaxpar.hooks.base import Context, Hook
from jaxpar.hooks.checkpointing import Checkpointing
from jaxpar.hooks.evaluation import Evaluation, is_eval_step
from jaxpar.hooks.metrics import MetricsLog, NonFiniteGuard, TensorBoard
from jaxpar.hooks.profiling import Profiler
from jaxpar.hooks.progress import Progress
from jaxpar.hooks.trackers import TRACKER_HOOKS, MLflow, Tracker, WandB
from jaxpar.user_code import load_object

__all__ = [
    "Checkpointing",
    "Context",
    "Evaluation",
    "Hook",
    "MLflow",
    "MetricsLog",
    "NonFiniteGuard",
    "Profiler",
    "Progress",
    "TensorBoard",
    "Tracker",
    "WandB",
    "default_hooks",
    "is_eval_step",
    "load_hooks",
]


def default_hooks(
    run: Any, run_dir: Path | None, ckpt: Any = None, wait: Any = None, echo: bool = True
) -> list[Hook]:
    """The built-in hooks a run's config asks for, in calling order: the profiler, eval,
    checkpoints (with ``ckpt``), the non-finite guard, the metrics log, TensorBoard, the
    experiment trackers (``train.trackers``; each checks its library is installed, on every
    process) and the progress display (``train.progress``, unless ``echo`` is False)."""
    cfg = run.config.train
    hooks: list[Hook] = [Profiler(run_dir, cfg), Evaluation()]
    if ckpt is not None:
        hooks.append(Checkpointing(ckpt))
    hooks += [NonFiniteGuard(), MetricsLog(wait)]
    if cfg.tensorboard and run_dir is not None:
        hooks.append(TensorBoard(run_dir))
    hooks += [TRACKER_HOOKS[name]() for name in dict.fromkeys(cfg.trackers)]
    if cfg.progress and echo:
        hooks.append(Progress())
    return hooks


def load_hooks(specs: tuple[str, ...] | list[str]) -> list[Hook]:
    """The hooks ``train.hooks`` names: a :class:`Hook` subclass (built with no
    arguments) or instance. What a name gives is checked before anything is called, so
    naming another callable (``os:abort``) runs nothing.

    Raises:
      TaskError: naming the entry, for what :func:`~jaxpar.user_code.load_object` refuses
        or an object that is not a Hook subclass or instance.
    """
    hooks = []
    for spec in specs:
        obj = load_object(spec, "train.hooks")
        if isinstance(obj, type) and issubclass(obj, Hook):
            obj = obj()
        elif not isinstance(obj, Hook):
            kind = (
                f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
            )
            raise TaskError(
                f"train.hooks entry '{spec}' is {kind}, not a jaxpar.Hook "
                "subclass or instance, so it is not called; name a class that "
                "subclasses jaxpar.Hook"
            )
        hooks.append(obj)
    return hooks
