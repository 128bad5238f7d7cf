"""jaxpar: SPMD training of Flax models over one device mesh, from one description of the
layout.

Models name logical axes; a rules table maps them onto the mesh axes (data, stage, fsdp,
tensor); a :class:`Plan` makes every layout decision; ``jit`` does the rest. This module
lists the whole public API:

* config: :func:`load_config`, :class:`Config` and its sections
* devices, mesh and rules: :func:`setup_devices`, :func:`make_mesh`, :data:`PRESETS`,
  :func:`resolve_rules`, :func:`constrain`, :func:`activation_rules`, :func:`spec_for`
* a sequence split over devices (context parallelism): :func:`attend`, :func:`positions`,
  :func:`order`, :func:`restore`, :class:`ContextConfig`; documents packed into one
  sequence: ``attend(..., segments=)``, :func:`document_positions`
* models: :class:`Task`, :class:`StageSplit`, :class:`Layers`, :class:`Linen` (a Flax
  Linen module as the model), :class:`Family`,
  :class:`ModelConfig`, :func:`register_model`, :func:`task_for` (a built-in model's task),
  the built-in losses;
  the families themselves are the modules of :mod:`jaxpar.models`
* layout and steps: :func:`make_plan` / :class:`Plan` (every layout decision),
  :class:`Trainer` (the jitted steps), :class:`TrainState`, :func:`abstract_model`
* optimizers: :func:`make_optimizer`, :func:`make_schedule`, :func:`decay_mask`,
  :func:`clip_by_global_norm` (also across the stages of the sub-mesh executor)
* training: :func:`train` (the whole loop), :func:`build` / :class:`Run` (a run from a
  config), :func:`fit` (the loop of a built run), :class:`Hook` (extend it),
  :class:`Checkpointer`
* several processes: :func:`initialize_distributed` (JAX's distributed runtime from the
  config's ``distributed`` section, ``jaxpar launch`` or the cluster)
* measuring: :func:`program_cost` (collectives, FLOPs and bytes of a compiled program)
* errors: :class:`JaxparError` and its kinds
* modules for those who study one mechanism: :mod:`jaxpar.models`, :mod:`jaxpar.pipeline`
  (schedules as data), :mod:`jaxpar.lab` (the layout lab), :mod:`jaxpar.guard` (the
  non-finite guard), :mod:`jaxpar.integrity` (checkpoint integrity records)
"""

from jaxpar import signals  # first: a stop signal while the command starts is one line

signals.guard_imports()

from jaxpar import guard, integrity, lab, models, pipeline  # noqa: E402
from jaxpar.checkpoint import CheckpointConfig, Checkpointer
from jaxpar.config import Config, DistributedConfig, RunConfig, TrainConfig, load_config
from jaxpar.context import (
    ContextConfig,
    attend,
    document_positions,
    order,
    positions,
    restore,
)
from jaxpar.data.sources import DataConfig
from jaxpar.distributed import initialize as initialize_distributed
from jaxpar.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpoint,
    DataError,
    JaxparError,
    LayoutError,
    NonFiniteStop,
    PathError,
    Preempted,
    RestoreError,
    TaskError,
    Terminated,
    TooManySkipped,
)
from jaxpar.hlo import program_cost
from jaxpar.hooks import Hook
from jaxpar.linen import Linen
from jaxpar.logical import activation_rules, constrain, spec_for
from jaxpar.loop import fit, train
from jaxpar.mesh import MeshConfig, make_mesh, setup_devices
from jaxpar.models import Family, ModelConfig, classification_loss, lm_loss, mlm_loss
from jaxpar.models import register as register_model
from jaxpar.optim import (
    OptimConfig,
    clip_by_global_norm,
    decay_mask,
    make_optimizer,
    make_schedule,
)
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.plan import Plan, abstract_model, make_plan
from jaxpar.run import Run, build, logits, task_for
from jaxpar.sharding import PRESETS, RulesConfig, resolve_rules
from jaxpar.state import TrainState
from jaxpar.task import Layers, StageSplit, Task
from jaxpar.trainer import Trainer

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "ContextConfig",
    "attend",
    "document_positions",
    "order",
    "positions",
    "restore",
    "CorruptCheckpoint",
    "DataConfig",
    "DataError",
    "DistributedConfig",
    "Family",
    "Hook",
    "JaxparError",
    "Layers",
    "LayoutError",
    "Linen",
    "MeshConfig",
    "ModelConfig",
    "NonFiniteStop",
    "OptimConfig",
    "PRESETS",
    "PathError",
    "PipelineConfig",
    "Plan",
    "Preempted",
    "RestoreError",
    "RulesConfig",
    "Run",
    "RunConfig",
    "StageSplit",
    "Task",
    "TaskError",
    "Terminated",
    "TooManySkipped",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "abstract_model",
    "activation_rules",
    "build",
    "classification_loss",
    "clip_by_global_norm",
    "constrain",
    "decay_mask",
    "fit",
    "guard",
    "initialize_distributed",
    "integrity",
    "lab",
    "lm_loss",
    "load_config",
    "logits",
    "make_mesh",
    "make_optimizer",
    "make_plan",
    "make_schedule",
    "mlm_loss",
    "models",
    "pipeline",
    "program_cost",
    "register_model",
    "resolve_rules",
    "setup_devices",
    "spec_for",
    "task_for",
    "train",
]
