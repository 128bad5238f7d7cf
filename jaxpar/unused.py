"""Settings that have no effect in a run: each one set is named, and warned of once
(STYLE: a setting is never silently ignored). What has no effect depends on the run:
another model family's keys, the ``model`` section for a user's task, the ``data`` keys
the model does not read, the ``optim`` keys when the run brings its own optimizer, and
the options of choices not taken."""

from __future__ import annotations

import warnings
from typing import Any

from jaxpar import schema
from jaxpar.config import Config, model_settings
from jaxpar.context import ContextConfig
from jaxpar.data.data_config import DataConfig
from jaxpar.optim import OptimConfig
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.tensor_parallel import TensorConfig

#: ``data`` keys that read a task's own data too
_LOADER_KEYS = ("threads", "prefetch", "workers", "wait_warn")
#: ``data`` keys :func:`jaxpar.task_for` sizes a family's model by (vocabulary, sequence
#: length, packing, image shape), also when the task then brings its own data
_SIZING_KEYS = (
    "path",
    "mixture",
    "text_key",
    "dataset",
    "seq_len",
    "pack",
    "image_size",
    "channels",
)


def _non_default(config: Config, dotted: str) -> bool:
    section_name, key = dotted.split(".")
    if section_name == "model":
        return key == "name" and bool(config.model.name)
    default = getattr(Config(), section_name)
    return getattr(getattr(config, section_name), key) != getattr(default, key)


def unused_settings(
    config: Config, *, user_task: bool = False, own_data: bool = False, own_optimizer: bool = False
) -> list[str]:
    """Keys set away from their default that the run ignores: another model family's keys,
    the ``model`` section for a user's task, ``data`` keys the model does not read (or all
    of them when the task brings its data, but for the loader's and, for a family's task
    from :func:`jaxpar.task_for` (``user_task=False``), those it was sized by), ``optim``
    keys when the run brings its own optimizer, and the options of other choices."""
    explicit = [f"model.{k}" for k in model_settings(config.model)]
    keys = (
        explicit + ["model.name"]
        if user_task
        else [k for k in explicit if k.split(".", 1)[1] not in config.family.keys()]
    )
    data = config.data
    if own_data:  # the loader's keys still apply; a family's task was sized by its data
        kept = _LOADER_KEYS + (() if user_task else _SIZING_KEYS)
        keys += [f"data.{k}" for k in schema.keys(DataConfig) if k not in kept]
    if not user_task:
        keys += list(config.family.unread)
        text = config.family.needs(config.model).kind == "text"
        synthetic = data.dataset == "synthetic" or (
            data.dataset == "auto" and not data.path and not text
        )
        keys += ["data.image_size", "data.channels"] if text else ["data.seq_len"]
        if not (text and data.path):
            keys.append("data.text_key")
        if not synthetic:
            keys += ["data.num_examples", "data.image_size", "data.channels"]
    if own_optimizer:
        keys += [f"optim.{k}" for k in schema.keys(OptimConfig)]
    optim = config.optim.name
    schedule = config.optim.schedule
    if optim != "sgd":
        keys += ["optim.momentum", "optim.nesterov"]
    if optim in ("sgd", "adafactor"):
        keys += ["optim.b1", "optim.b2", "optim.eps"]
    if schedule != "step":
        keys += ["optim.step_every", "optim.step_gamma"]
    if schedule not in ("cosine", "linear"):
        keys += ["optim.decay_steps", "optim.min_lr_ratio"]
    if config.mesh.stage == 1:
        keys += [f"pipeline.{k}" for k in schema.keys(PipelineConfig)]
    if config.mesh.context == 1:
        keys += [f"context.{k}" for k in schema.keys(ContextConfig)]
    if config.mesh.tensor == 1:
        keys += [f"tensor.{k}" for k in schema.keys(TensorConfig)]
    if not config.checkpoint.keep_best:
        keys += ["checkpoint.best_metric", "checkpoint.best_mode"]
    keys += _fp8_keys(config.model)
    return [k for k in dict.fromkeys(keys) if k in explicit or _non_default(config, k)]


def _fp8_keys(model: Any) -> list[str]:
    """The FP8 scaling keys set away from their defaults that the model's precision leaves
    unread (a saved config names every key: those at their default say nothing)."""
    precision = getattr(model, "precision", None)
    if precision is None:
        return []
    unread = ("fp8_scaling", "fp8_history") if precision != "fp8" else ("fp8_history",)
    if precision == "fp8" and model.fp8_scaling == "delayed":
        unread = ()
    fields = type(model).__pydantic_fields__
    return [f"model.{k}" for k in unread if getattr(model, k) != fields[k].default]


def warn_unused(config: Config, **run: bool) -> None:
    """Warns once per key that is set but has no effect (STYLE: never silently ignore),
    each with its own reason; ``run`` says what the run brings itself (see
    :func:`unused_settings`)."""
    for key in unused_settings(config, **run):
        warnings.warn(
            f"config key '{key}' has no effect with {_reason(key, config, run)}", stacklevel=2
        )


#: the setting whose choice leaves a section's (or a key's) other settings unread
_BECAUSE = {
    "pipeline": ("mesh.stage",),
    "context": ("mesh.context",),  # not a mesh axis: a section
    "tensor": ("mesh.tensor",),  # not a mesh axis: a section
    "checkpoint": ("checkpoint.keep_best",),
    "model": ("model.name",),
    "data": ("model.name", "data.dataset", "data.path"),  # not a mesh axis: a section
    "optim": ("optim.name", "optim.schedule"),
    "model.fp8": ("model.precision", "model.fp8_scaling"),
    "context.balance": ("model.name",),
}


def _reason(key: str, config: Config, run: dict[str, bool]) -> str:
    """Why ``key`` has no effect: what the run brings itself, else the settings whose
    choice leaves it unread (``pipeline.microbatches`` … with mesh.stage=1)."""
    section = key.split(".", 1)[0]
    if section == "model" and run.get("user_task"):
        return "a user's task, whose model is its own"
    if section == "data" and run.get("own_data"):  # not a mesh axis: a section
        return "a task that brings its own data"
    if section == "optim" and run.get("own_optimizer"):
        return "a run that brings its own Optax optimizer"
    family = () if run.get("user_task") else config.family.unread
    unsplit = section == "context" and config.mesh.context == 1  # not a mesh axis: a section
    if key in family and not unsplit:
        return ", ".join(f"{k}={_value(config, k)}" for k in _BECAUSE[key])
    because = _BECAUSE["model.fp8" if key.startswith("model.fp8_") else section]
    return ", ".join(f"{k}={_value(config, k)}" for k in because if k != key)


def _value(config: Config, dotted: str) -> Any:
    if dotted == "model.name":
        return config.family.name
    section, key = dotted.split(".")
    value = getattr(getattr(config, section), key, None)
    return value if value not in ("", None) else "none"
