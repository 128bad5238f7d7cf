"""A run assembled from a config: devices, mesh, rules, data, task, optimizer, trainer.

:func:`build` is the one place a config becomes objects; :func:`evaluate` gives
the held-out metrics of a run's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxpar import config as config_lib
from jaxpar import sharding as shd
from jaxpar.builtin_tasks import task_from_config
from jaxpar.config import Config
from jaxpar.data import Data, load_data
from jaxpar.mesh import make_mesh, select_devices
from jaxpar.optim import decay_mask, make_optimizer
from jaxpar.trainer import Trainer, abstract_params_and_axes, global_batch_shapes


@dataclass
class Run:
    """Everything :func:`build` assembles from a config."""

    config: Config
    trainer: Trainer
    data: Data
    devices: list[jax.Device]


def build(config: Config) -> Run:
    """Devices, mesh, rules, data, task, optimizer and trainer from ``config``."""
    config_lib.warn_unused(config)
    devices = select_devices(config.run.devices)
    mesh = make_mesh(config.mesh, devices)
    rules = shd.resolve_rules(config.rules)
    data = load_data(config.data, config.model, config.run.seed)
    task = task_from_config(config.model, config.data.seq_len, data.image_shape)
    mask = decay_mask(*abstract_params_and_axes(task, config.run.seed))
    tx, schedule = make_optimizer(config.optim, config.train.steps, mask)
    trainer = Trainer(task, tx, mesh, rules, schedule=schedule,
                      grad_accum=config.train.grad_accum, seed=config.run.seed,
                      pipeline=config.pipeline)
    # the global batch must split over microbatches × batch devices: say so before training
    trainer.batch_shardings(global_batch_shapes(data.batch(0, config.train.batch_size)))
    return Run(config, trainer, data, devices)


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


def evaluate(run: Run, params: Any) -> dict[str, float]:
    """Mean metrics over ``train.eval_batches`` held-out batches."""
    totals: dict[str, float] = {}
    n = run.config.train.eval_batches
    for i in range(n):
        batch = run.trainer.shard_batch(run.data.batch(i, run.config.train.batch_size, "eval"))
        for k, v in to_host(run.trainer.evaluate(params, batch)).items():
            totals[k] = totals.get(k, 0.0) + v / n
    return totals


def eval_metric_names(run: Run) -> list[str]:
    """The ``eval_*`` keys an evaluation logs (from shapes only: nothing is computed)."""
    batch = run.data.batch(0, run.config.train.batch_size, "eval")
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    shapes = jax.eval_shape(run.trainer.evaluate, run.trainer.abstract_params, abstract)
    return sorted(f"eval_{k}" for k in shapes)


def is_eval_step(step: int, cfg: Any) -> bool:
    """Whether ``step`` evaluates (every ``train.eval_every`` and the last step)."""
    return bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)
