"""The run configuration: YAML files plus dotted ``section.key=value`` overrides.

Each section is declared once, in the module that takes its settings (``MeshConfig`` in
``jaxpar/mesh.py``, ``OptimConfig`` in ``jaxpar/optim.py``, a model family's keys in its
file…), as a frozen pydantic dataclass that checks itself (``jaxpar/schema.py``). This
package assembles them into :class:`Config` and reads YAML strictly and applies overrides,
in three layers, later ones winning: the defaults, each YAML file in order, then the
overrides (together). ``jaxpar train --help-config`` prints every key (``docs/config.md``).

* :mod:`~jaxpar.config.sections`: the ``run``, ``train`` and ``distributed`` sections and
  :class:`Config`;
* :mod:`~jaxpar.config.families`: the ``model`` section — the family ``model.name`` names
  and its keys;
* :mod:`~jaxpar.config.merge`: YAML mappings and overrides merged into a config;
* :mod:`~jaxpar.config.load`: :func:`load_config` (the run dir named by
  :mod:`jaxpar.rundir`) and :func:`to_dict`.
"""

from __future__ import annotations

from jaxpar.checkpoint import CheckpointConfig
from jaxpar.config.families import family_of, merge_model, model_settings
from jaxpar.config.load import load_config, run_dir_for, to_dict
from jaxpar.config.merge import ALIASES, apply_overrides, merge, parse_override
from jaxpar.config.sections import (
    MAX_BATCH,
    MAX_STEPS,
    TRACKERS,
    Config,
    DistributedConfig,
    Nonfinite,
    RunConfig,
    TrainConfig,
    parse_profile_steps,
)
from jaxpar.context import ContextConfig
from jaxpar.data.data_config import DataConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.family import ModelConfig
from jaxpar.optim import OptimConfig
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.rules import RulesConfig

__all__ = [
    "ALIASES",
    "MAX_BATCH",
    "MAX_STEPS",
    "TRACKERS",
    "CheckpointConfig",
    "Config",
    "ContextConfig",
    "DataConfig",
    "DistributedConfig",
    "MeshConfig",
    "ModelConfig",
    "Nonfinite",
    "OptimConfig",
    "PipelineConfig",
    "RulesConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "family_of",
    "load_config",
    "merge",
    "merge_model",
    "model_settings",
    "parse_override",
    "parse_profile_steps",
    "run_dir_for",
    "to_dict",
]
