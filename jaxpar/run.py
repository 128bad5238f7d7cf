"""A run assembled from a config (and a user's task): devices, mesh, rules, data, task,
optimizer, trainer.

:func:`build` is the one place a config becomes objects; :func:`evaluate` gives
the held-out metrics of a run's parameters; :func:`logits` a model's outputs on any
layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from jaxpar import hf, tensor_parallel
from jaxpar.axes import Axis
from jaxpar.config import Config, model_settings
from jaxpar.data import Data, load_data
from jaxpar.data.sources import needs_of_batch
from jaxpar.data.task_data import task_data
from jaxpar.errors import ConfigError, TaskError
from jaxpar.logical import activation_rules
from jaxpar.mesh import abstract_mesh, make_mesh, select_devices
from jaxpar.models.family import Family, ModelConfig
from jaxpar.optim import decay_mask, make_optimizer
from jaxpar.plan import Plan, abstract_model, global_batch_shapes, make_plan, sizes
from jaxpar.plan.abstract import AbstractModel
from jaxpar.rules import resolve_rules
from jaxpar.state import TrainState
from jaxpar.task import DataNeeds, Task
from jaxpar.trainer import Trainer
from jaxpar.unused import warn_unused


@dataclass
class Run:
    """Everything :func:`build` assembles from a config (and a user's task)."""

    config: Config
    trainer: Trainer
    data: Any
    devices: list[jax.Device]
    #: the model family (``config.family``), or None for a user's task
    family: Family | None = None

    @property
    def plan(self) -> Plan:
        """Every layout decision of the run (the trainer's plan)."""
        return self.trainer.plan

    @property
    def name(self) -> str:
        """The task's name, for messages (``gpt``, or a user task's name)."""
        return self.plan.task.name or "task"


#: the platforms a run may be planned for (``build(target=…)``)
PLATFORMS = ("cpu", "gpu", "tpu")


def _devices_and_mesh(
    config: Config, target: tuple[int, str] | None, fit_memory: bool = False
) -> tuple[list[jax.Device], Mesh | AbstractMesh, str]:
    """The devices, mesh and platform a run is planned for: these (``run.devices``), or
    ``target``'s count of devices that are not here (an abstract mesh, no devices); the
    global batch checked against the mesh's stages."""
    if target is None:
        devices = select_devices(config.run.devices)
        found = devices, make_mesh(config.mesh, devices), devices[0].platform
    else:
        count, platform = target
        if fit_memory:
            raise ConfigError("build(target=…) plans for devices not here: nothing to fit_memory")
        if platform not in PLATFORMS or count < 1:
            raise ConfigError(
                f"target=({count}, {platform!r}): plan for one or more devices of a platform "
                f"JAX names: {', '.join(PLATFORMS)}"
            )
        found = [], abstract_mesh(config.mesh, count), platform
    train = config.train
    stages = found[1].shape[Axis.STAGE]
    sizes.check_microbatches(
        train.batch_size, train.grad_accum, config.pipeline.microbatches, stages
    )
    return found


def _bucket_bytes(mb: float | str) -> int | None:
    """``train.grad_bucket_mb`` in bytes (None for auto: the platform's choice)."""
    return None if mb == "auto" else round(mb * 2**20)


def unused_flags(
    config: Config, task: Task | None, optimizer: optax.GradientTransformation | None = None
) -> dict[str, bool]:
    """What a run of ``task`` (None: the config's family) and ``optimizer`` brings itself,
    as :func:`jaxpar.unused.unused_settings` reads it."""
    from_config = task is not None and bool(task.family) and task.family == config.family.name
    return {
        "user_task": task is not None and not from_config,
        "own_data": task is not None and task.data is not None,
        "own_optimizer": optimizer is not None or (task is not None and task.optimizer is not None),
    }


def build(
    config: Config,
    task: Task | None = None,
    optimizer: optax.GradientTransformation | None = None,
    *,
    fit_memory: bool = False,
    target: tuple[int, str] | None = None,
    platform: str | None = None,
    data: Data | None = None,
) -> Run:
    """Devices, mesh, rules, data, task, optimizer and trainer from ``config``.

    Args:
      config: the run configuration.
      task: a user's task; None builds the model family ``config.model.name``.
      optimizer: any Optax transformation; None takes ``task.optimizer``, else the one
        the config's ``optim`` section describes.
      fit_memory: also refuse a run whose state, or an array a step computes, does not fit
        the devices' memory (:mod:`jaxpar.plan.sizes`), as training does. Without it a run
        for other machines builds here; only sizes no device holds are refused.
      target: ``(count, platform)``: plan for that many devices of that platform instead
        of these (:func:`jaxpar.mesh.abstract_mesh`): nothing can compile or run.
      platform: what ``auto`` settings resolve for (default: the devices'; ``plan``'s profile's).
      data: the config's data, loaded already (read once for a plan's many layouts).

    Raises:
      ConfigError, LayoutError, DataError, TaskError: for a setting, layout, data or task
        that cannot run, in one line (and ``fit_memory`` with a ``target``).
    """
    warn_unused(config, **unused_flags(config, task, optimizer))
    user_task = task
    sizes.check_settings(_sizes(config, user_task))
    devices, mesh, here = _devices_and_mesh(config, target, fit_memory)
    rules = resolve_rules(config.rules, config.tensor)
    precision = getattr(config.model, "precision", "default") if task is None else "default"
    tensor_parallel.check(config.tensor, mesh.shape, here, precision)
    family = None
    if task is None:
        family = config.family
        data, model = _data_and_model(config, data)
        config = dataclasses.replace(config, model=model)  # run dir and checkpoints hold it
        task = _family_task(config, data)
    else:
        data = task_data(task, config.run.seed)
        if data is None:
            data = _config_data(config, task)
            if not task.tokens_per_example and data.seq_len:  # the config's text: its tokens
                task = dataclasses.replace(task, tokens_per_example=data.seq_len)
    tx = optimizer or task.optimizer
    model = _family_model(config, data, task) if family and target else abstract_model(task)
    if tx is None:
        tx = _optimizer(config, model, planned=bool(family and target))
    plan = make_plan(
        task,
        tx,
        mesh,
        rules,
        grad_accum=config.train.grad_accum,
        pipeline=config.pipeline,
        fsdp_gather=config.train.fsdp_gather,
        model=model,
        context=config.context,
        tensor=config.tensor,
        optimizer_offload=config.train.optimizer_offload,
        grad_bucket_bytes=_bucket_bytes(config.train.grad_bucket_mb),
        platform=platform or here,
    )
    memory = sizes.device_memory(devices) if fit_memory else None
    settings = _sizes(config, user_task)
    sizes.check_state(plan, memory, settings)  # before a batch is drawn or a byte allocated
    # the global batch must split over microbatches × batch devices: say so before training
    data = data.with_share(plan.row_share)  # the rows this process's devices hold
    batch = global_batch_shapes(data.batch(0, config.train.batch_size), plan.row_share[1])
    plan.batch_shardings(batch)
    sizes.check_activations(plan, batch, memory, settings)
    trainer = Trainer(plan, seed=config.run.seed, nonfinite_guard=config.train.nonfinite_guard)
    return Run(config, trainer, data, devices, family)


#: the abstract models of the last model sections planned for devices that are not here
#: (a plan builds one model under many layouts: its shapes do not depend on them)
_FAMILY_MODELS: dict[str, AbstractModel] = {}


def _family_model(config: Config, data: Data, task: Task) -> AbstractModel:
    """A built-in family's model as shapes and names, traced once per model section and
    what the model takes from its data (only for plans: a run that trains traces its own)."""
    key = repr(
        (
            config.model,
            getattr(data, "seq_len", None),
            getattr(data, "vocab_size", None),
            getattr(data, "image_shape", None),
        )
    )
    if key not in _FAMILY_MODELS:
        if len(_FAMILY_MODELS) >= 4:
            _FAMILY_MODELS.pop(next(iter(_FAMILY_MODELS)))
        _FAMILY_MODELS[key] = abstract_model(task)
    return _FAMILY_MODELS[key]


#: the optimizers of the last optim sections planned with a family's cached model (the
#: same transformation lets :func:`jaxpar.plan.decide.abstract_state` trace its state once)
_FAMILY_OPTIMIZERS: dict[str, tuple[AbstractModel, optax.GradientTransformation]] = {}


def _optimizer(config: Config, model: AbstractModel, planned: bool) -> optax.GradientTransformation:
    """The optimizer the config's ``optim`` section describes, made once per section and
    cached model when ``planned`` (a plan's many layouts share it)."""
    key = repr((id(model), config.optim, config.train.steps))
    cached = _FAMILY_OPTIMIZERS.get(key) if planned else None
    if cached is not None and cached[0] is model:
        return cached[1]
    mask = decay_mask(model.params, model.param_axes)
    tx, _ = make_optimizer(config.optim, config.train.steps, mask)
    if planned:
        if len(_FAMILY_OPTIMIZERS) >= 4:
            _FAMILY_OPTIMIZERS.pop(next(iter(_FAMILY_OPTIMIZERS)))
        _FAMILY_OPTIMIZERS[key] = (model, tx)
    return tx


def _sizes(config: Config, user_task: Task | None) -> dict[str, int]:
    """The integer settings an array's dims may follow from, for the size checks: the
    batch's, and the model section's when the config's family builds the model."""
    found = {"train.batch_size": config.train.batch_size}
    if user_task is None or user_task.data is None:
        found["data.seq_len"] = config.data.seq_len
    if user_task is None:
        model = config.model
        found |= {
            f"model.{f.name}": getattr(model, f.name)
            for f in dataclasses.fields(model)
            if type(getattr(model, f.name)) is int
        }
    return found


def task_for(config: Config) -> Task:
    """The task of the built-in (or registered) model family ``config`` names — its model,
    loss, batch axes and pipeline split for the config's data (``model.init_from``'s
    weights included) — e.g. to train it with your own loop or hooks.

    Raises:
      ConfigError, DataError: for a model or data setting that does not fit.
    """
    data, model = _data_and_model(config)
    task = _family_task(dataclasses.replace(config, model=model), data)
    return dataclasses.replace(task, family=config.family.name)


def _data_and_model(config: Config, data: Data | None = None) -> tuple[Data, ModelConfig]:
    """The config's data, and the model section sized for it: without a given
    ``model.vocab_size``, a language model whose data (``data.path``, ``data.mixture``)
    holds more ids than the family's default takes the data's vocabulary (plus the ids
    the family keeps beyond the data's, e.g. BERT's mask token)."""
    model = config.model
    needs = config.family.needs(model)
    free = needs.kind == "text" and needs.vocab_size is not None and _vocab_from_data(config)
    data = data if data is not None else load_data(config.data, data_needs(config), config.run.seed)
    if not free or data.vocab_size <= needs.vocab_size:
        return data, model
    sized = dataclasses.replace(
        model, vocab_size=model.vocab_size - needs.vocab_size + data.vocab_size
    )
    object.__setattr__(sized, "given", model.given)  # as merge_model keeps it
    return data, sized


def data_needs(config: Config) -> DataNeeds:
    """What the config's family reads from its data, as :func:`build` loads it: without
    the family's default vocabulary where the data decides it."""
    needs = config.family.needs(config.model)
    free = needs.kind == "text" and needs.vocab_size is not None and _vocab_from_data(config)
    return dataclasses.replace(needs, vocab_size=None) if free else needs


def _vocab_from_data(config: Config) -> bool:
    """Whether the data decides the vocabulary: a family with ``model.vocab_size`` the
    config did not give, reading a path or a mixture (the built-in and synthetic data are
    what the family's default is sized for)."""
    model = config.model
    data = config.data
    return (
        "vocab_size" in {f.name for f in dataclasses.fields(model)}
        and "vocab_size" not in model_settings(model)
        and data.dataset == "auto"
        and bool(data.path or data.mixture)
    )


def _family_task(config: Config, data: Data) -> Task:
    """The family's task for the config's data."""
    task = config.family.task(config.model, data)
    init_params = hf.init_params_for(config.model)  # model.init_from: Hugging Face weights
    if init_params is not None:
        task = dataclasses.replace(task, init_params=init_params)
    return task


def _config_data(config: Config, task: Task) -> Data:
    """The config's data for a user's task that brings none: its batch entries say which."""
    needs = needs_of_batch(task.batch_axes)
    if needs is None:
        raise TaskError(
            f"the task {task.name or ''} brings no data and its batch entries "
            f"({', '.join(sorted(task.batch_axes))}) are neither jaxpar's text batches "
            "('tokens', with 'segments' and 'index' if asked) nor its image batches ('images', "
            "'labels'); give the Task a data "
            "function (step, global_batch_size) -> dict of arrays, or a grain dataset"
        )
    data = load_data(config.data, needs, config.run.seed)
    if needs.loss_mask and not data.loss_mask:
        raise TaskError(
            f"the task {task.name or ''} names 'loss_mask' among its batch entries, but "
            f"'{data.name}' holds no fine-tuning records; prepare them with jaxpar "
            "prepare-data RECORDS --records prompt_completion (or chat) --out FILE.tokens, "
            "or drop 'loss_mask' from the task's batch_axes"
        )
    return data


def host_value(x: Any) -> np.ndarray:
    """A (global) array as numpy on this host — also one that spans other processes'
    devices: a replicated one is read from a local copy, a sharded one all-gathered."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def to_host(metrics: dict[str, jax.Array]) -> dict[str, float]:
    """Device scalars → Python floats (a host sync)."""
    return {k: float(host_value(v)) for k, v in metrics.items()}


def host_metrics(metrics: dict[str, jax.Array]) -> dict[str, Any]:
    """A step's metrics as Python numbers (one transfer): floats, ``finite`` a bool and
    ``skipped`` an int."""
    values = jax.device_get(
        {k: v if v.is_fully_addressable else host_value(v) for k, v in metrics.items()}
    )
    out = {k: float(v) for k, v in values.items()}
    out["finite"] = bool(out["finite"])
    if "skipped" in out:
        out["skipped"] = int(out["skipped"])
    return out


def evaluate(run: Run, state: TrainState) -> dict[str, float]:
    """Mean metrics over ``train.eval_batches`` held-out batches, in evaluation mode."""
    totals: dict[str, float] = {}
    n = run.config.train.eval_batches
    run.data.batch(n - 1, run.config.train.batch_size, "eval")  # all n made at once, kept
    for i in range(n):
        batch = run.trainer.shard_batch(run.data.batch(i, run.config.train.batch_size, "eval"))
        for k, v in to_host(run.trainer.evaluate(state, batch)).items():
            totals[k] = totals.get(k, 0.0) + v / n
    return totals


def eval_metric_names(run: Run) -> list[str]:
    """The ``eval_*`` keys an evaluation logs (from shapes only: nothing is computed)."""
    batch = run.data.batch(0, run.config.train.batch_size, "eval")
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    trainer = run.trainer
    shapes = jax.eval_shape(trainer.evaluate, run.plan.abstract_state, abstract)
    return sorted(f"eval_{k}" for k in shapes)


def logits(run: Run, tokens: Any, state: TrainState | None = None) -> np.ndarray:
    """A language model's logits [B, T, V] (float32, on the host) for a token batch [B, T],
    computed on the run's layout: its mesh and rules shard the weights and activations as
    training does, so any layout gives the same numbers.

    Args:
      run: from :func:`build` (a built-in family, ``model.init_from=FOLDER``, or a task).
      tokens: integer token ids [B, T]; B divisible by the devices that split the batch.
      state: the parameters (and other model state) to use; default the run's initial
        state — fresh, or the weights of ``model.init_from``.

    Example::

        run = jaxpar.build(jaxpar.load_config([], ["model.init_from=./Qwen3-0.6B",
                                                   "mesh.fsdp=4", "mesh.tensor=2"]))
        out = jaxpar.logits(run, np.array([[1, 2, 3, 4]] * 8))
    """
    state = state if state is not None else run.trainer.init()
    forward = _LOGITS.get(id(run.plan))
    if forward is None or forward[0] is not run.plan:  # compiled once, for the last plan
        _LOGITS.clear()
        forward = _LOGITS[id(run.plan)] = (run.plan, _forward(run.plan))
    return np.asarray(forward[1](state.params, state.model_state, np.asarray(tokens)))


_LOGITS: dict[int, tuple[Plan, Any]] = {}


def _forward(plan: Plan) -> Any:
    """The jitted forward pass of a plan's model under its layout."""

    @jax.jit
    def forward(params: Any, model_state: Any, tokens: jax.Array) -> jax.Array:
        with activation_rules(plan.mesh, plan.rules):
            model = nnx.merge(plan.model.graphdef, params, model_state)
            model.eval()
            return model(tokens)

    return forward
