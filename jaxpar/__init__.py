"""jaxpar: SPMD training of Flax NNX models over one device mesh.

Models name logical axes; a rules table maps them onto the mesh axes
(data, stage, fsdp, tensor); ``jit`` does the rest. The public API:

* config: :func:`load_config`, :class:`Config`
* devices and mesh: :func:`setup_devices`, :func:`make_mesh`
* rules: :data:`PRESETS`, :func:`resolve_rules`, :func:`constrain`
* models: :class:`Family`, :func:`register_model` (``model.name``), the built-in losses
* training: :class:`Task`, :func:`train` (the whole loop), :class:`Hook` (extend it),
  :class:`Trainer` (the sharded state and steps alone), :func:`make_optimizer`
"""

from jaxpar.config import (
                           Config,
                           DataConfig,
                           MeshConfig,
                           ModelConfig,
                           OptimConfig,
                           RulesConfig,
                           RunConfig,
                           TrainConfig,
                           load_config,
)
from jaxpar.hooks import Hook
from jaxpar.logical import constrain, spec_for
from jaxpar.loop import train
from jaxpar.mesh import make_mesh, setup_devices
from jaxpar.models import Family, classification_loss, lm_loss, mlm_loss
from jaxpar.models import register as register_model
from jaxpar.optim import decay_mask, make_optimizer, make_schedule
from jaxpar.plan import Plan, abstract_model, make_plan
from jaxpar.sharding import PRESETS, resolve_rules
from jaxpar.state import TrainState
from jaxpar.task import Task
from jaxpar.trainer import Trainer

__all__ = [
                           "PRESETS",
                           "Plan",
                           "Config",
                           "DataConfig",
                           "Family",
                           "Hook",
                           "MeshConfig",
                           "ModelConfig",
                           "OptimConfig",
                           "RulesConfig",
                           "RunConfig",
                           "Task",
                           "TrainConfig",
                           "TrainState",
                           "Trainer",
                           "abstract_model",
                           "classification_loss",
                           "constrain",
                           "decay_mask",
                           "lm_loss",
                           "load_config",
                           "make_mesh",
                           "make_optimizer",
                           "make_plan",
                           "make_schedule",
                           "mlm_loss",
                           "register_model",
                           "resolve_rules",
                           "setup_devices",
                           "spec_for",
                           "train",
]
