"""jaxpar: SPMD training of Flax models over one device mesh, from one description of the
layout.

Models name logical axes; a rules table maps them onto the mesh axes (data, stage, fsdp,
context, tensor: :class:`jaxpar.axes.Axis`); a :class:`Plan` makes every layout decision;
``jit`` does the rest.

The package holds what a research script touches (``__all__``, the list on the API page):

* training: :func:`train` (the whole loop), :func:`build` (a run from a config),
  :func:`fit` (the loop of a built run), :func:`load_config`, :func:`logits`
* your model: :class:`Task`, :class:`Layers`, :class:`StageSplit`, :class:`Linen` (a Flax
  Linen module as the model), :class:`Hook` (extend the loop), :func:`task_for` (a
  built-in model's task)
* layouts and steps: :func:`setup_devices`, :func:`make_plan` / :class:`Plan` (every
  layout decision), :class:`Trainer` (the jitted steps), :class:`TrainState`,
  :func:`constrain`, :func:`attend` (attention over a sequence split across devices),
  :func:`clip_by_global_norm` (clipping that spans the stages of a pipeline)
* errors: :class:`JaxparError` (its kinds are in :mod:`jaxpar.errors`)

Everything else is imported from its module (:mod:`jaxpar.config`, :mod:`jaxpar.errors`,
:mod:`jaxpar.context`, :mod:`jaxpar.mesh`, :mod:`jaxpar.rules`, :mod:`jaxpar.sharding`,
:mod:`jaxpar.optim`, :mod:`jaxpar.hlo`, … — the API page lists them).

``import jaxpar`` imports nothing else and changes no process state: each name is
imported from its module on first use (PEP 562), and the command's start-up signal
handlers are installed by the command (:mod:`jaxpar.cli`), not by the package.
"""

import typing as _typing

from jaxpar import lazy as _lazy

if _typing.TYPE_CHECKING:  # for type checkers and the API page (griffe reads these)
    from jaxpar.config import load_config
    from jaxpar.context import attend
    from jaxpar.errors import JaxparError
    from jaxpar.hooks import Hook
    from jaxpar.linen import Linen
    from jaxpar.logical import constrain
    from jaxpar.loop import fit, train
    from jaxpar.mesh import setup_devices
    from jaxpar.optim import clip_by_global_norm
    from jaxpar.plan import Plan, make_plan
    from jaxpar.run import build, logits, task_for
    from jaxpar.state import TrainState
    from jaxpar.task import Layers, StageSplit, Task
    from jaxpar.trainer import Trainer

#: each public name's module, imported on first use
_HOMES = {
    "train": "jaxpar.loop",
    "fit": "jaxpar.loop",
    "build": "jaxpar.run",
    "load_config": "jaxpar.config",
    "logits": "jaxpar.run",
    "Task": "jaxpar.task",
    "Layers": "jaxpar.task",
    "StageSplit": "jaxpar.task",
    "Linen": "jaxpar.linen",
    "Hook": "jaxpar.hooks",
    "task_for": "jaxpar.run",
    "setup_devices": "jaxpar.mesh",
    "clip_by_global_norm": "jaxpar.optim",
    "Plan": "jaxpar.plan",
    "make_plan": "jaxpar.plan",
    "Trainer": "jaxpar.trainer",
    "TrainState": "jaxpar.state",
    "constrain": "jaxpar.logical",
    "attend": "jaxpar.context",
    "JaxparError": "jaxpar.errors",
}

__all__ = [
    "train",
    "fit",
    "build",
    "load_config",
    "logits",
    "Task",
    "Layers",
    "StageSplit",
    "Linen",
    "Hook",
    "task_for",
    "setup_devices",
    "Plan",
    "make_plan",
    "Trainer",
    "TrainState",
    "constrain",
    "attend",
    "clip_by_global_norm",
    "JaxparError",
]


__getattr__, __dir__ = _lazy.exports(__name__, _HOMES, globals())
