"""What to train: a model constructor, a loss, and the logical axes of a batch.

A :class:`Task` is all jaxpar needs to train any Flax NNX module: each built-in model
family builds one (``jaxpar/models/``: e.g. ``jaxpar.models.gpt.task(GPTConfig(),
seq_len=128)``), and so is a user's own model (see ``examples/research_cnn.py``).
:class:`StageSplit` says how a model cuts into pipeline stages; :class:`DataNeeds`
what a model family takes from the config's ``data`` section.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = Mapping[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@dataclass(frozen=True)
class StageSplit:
    """How a model cuts into pipeline stages (see ``jaxpar/pipeline/executor.py``).

    The model keeps its layers stacked on a leading ``layers`` dim under the
    parameter key ``layers_key``; each stage runs a contiguous chunk of them.
    The three functions receive the model rebuilt with only that chunk of
    layers stacked under ``layers_key``:

    Contract (gradients rely on it): ``stage`` reads only the chunk's layer
    parameters, ``embed`` and ``head`` only the parameters outside
    ``layers_key``. A parameter read elsewhere would get no gradient from
    that use. The model's state may hold RNG streams only (no BatchNorm
    statistics); microbatch ``j`` runs with the step's RNG counts advanced by
    ``j``, so a model whose forward advances each count by one (e.g. the loss
    calls it once) draws the same randomness pipelined or not.

    Attributes:
      layers_key: top-level parameter key of the stacked layers (``'blocks'``).
      embed: ``(model, microbatch) -> x`` — what runs before the first layer.
      stage: ``(model, x, microbatch, first_layer) -> x`` — the model's stacked layers,
        in order; the chunk's first layer is layer ``first_layer`` of the whole model
        (for per-layer randomness; may be traced).
      head: ``(model, x, microbatch) -> (loss, metrics)`` — after the last
        layer; the same loss as the task's ``loss_fn`` (a mean over examples).
    """

    layers_key: str
    embed: Callable[[nnx.Module, Batch], jax.Array]
    stage: Callable[[nnx.Module, jax.Array, Batch, Any], jax.Array]
    head: Callable[[nnx.Module, jax.Array, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@dataclass(frozen=True)
class Task:
    """A trainable problem: any Flax NNX model, its loss, and optionally its own data and
    optimizer.

    Attributes:
      model_fn: builds the module from ``nnx.Rngs`` (called under ``nnx.eval_shape`` and
        under ``jit`` — never eagerly on one device). Its parameters name their dims with
        Flax's sharding metadata (``kernel_init=nnx.with_partitioning(init, ("embed",
        "mlp"))`` or ``nnx.Param(value, out_sharding=(...))``), which jaxpar's rules map
        onto the mesh. Any other variable (``nnx.BatchStat``, the RNG streams of
        ``nnx.Dropout(rate, rngs=rngs)``) is carried and updated by the train step.
      loss_fn: ``(model, batch) -> (scalar loss, {name: scalar metric})``; the loss must
        be a mean over examples so gradient accumulation is exact. The model arrives in
        NNX's training mode in the train step and evaluation mode in eval.
      batch_axes: logical axes of each batch entry, e.g. ``{"tokens": ("batch", None)}``
        (``None``: never sharded).
      path_rules: ``(regex, logical names)`` pairs for parameters without sharding
        metadata, matched against paths like ``'dense1/kernel'``.
      tokens_per_example: tokens one example carries (0 for non-sequence tasks), for the
        throughput metric.
      stages: how to cut the model for pipeline parallelism (None: it cannot be
        pipelined, and ``mesh.stage`` must stay 1).
      data: the training data, if the task brings its own (else the config's ``data``
        section applies): a function ``(step, global_batch_size) -> {name: numpy
        array}`` giving the batch of the step that follows ``step`` steps (pure in
        ``step``, so a run resumes by step number; a function that also takes
        ``rows=`` gets the slice of rows this process loads, and returns only those),
        or a grain dataset of examples — a ``grain.MapDataset`` (shuffled per epoch by
        ``run.seed``, each process reading only its rows, resumed by position) or a
        ``grain.IterDataset`` (read in order, resumed from grain's iterator state;
        single-process runs).
      eval_data: held-out data in the same forms (a function is called for steps
        ``0 … train.eval_batches-1``); None: no evaluation unless the config's data
        is used.
      optimizer: the task's own Optax transformation (the config's ``optim`` section
        then has no effect).
      name: names the run (``runs/<name>``) and the task in messages.
      init_params: parameters a fresh run starts from instead of the model's initializers
        (pretrained weights): a function ``() -> pure dict of host (numpy) arrays``
        shaped like the model's parameters (``nnx.to_pure_dict``). Each process calls it
        and places only its devices' slices; the optimizer state starts fresh. A run
        resumed from a checkpoint does not call it.
    """

    model_fn: Callable[[nnx.Rngs], nnx.Module]
    loss_fn: LossFn
    batch_axes: Mapping[str, tuple[str | None, ...]]
    path_rules: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    tokens_per_example: int = 0
    stages: StageSplit | None = None
    data: Any = None
    eval_data: Any = None
    optimizer: optax.GradientTransformation | None = None
    name: str = ""
    init_params: Callable[[], Any] | None = None


@dataclass(frozen=True)
class DataNeeds:
    """What a model takes from the config's data: ``text`` (batches ``{"tokens": [B,
    T+1]}``) or ``images`` (``{"images": [B, H, W, C], "labels": [B]}``), and the sizes
    the data must fit (None: not checked)."""

    kind: str
    vocab_size: int | None = None
    num_classes: int | None = None
    #: text examples also carry ``index``, their window's position in the split (a stable
    #: id: per-example randomness keyed by it does not depend on how a batch is sharded)
    example_ids: bool = False


def split_microbatches(x: jax.Array, k: int) -> jax.Array:
    """[B, ...] → [k, B/k, ...] with microbatch i = rows i, i+k, …

    Strided rows keep each device's rows on that device: the B/k dim keeps
    the batch sharding of B.
    """
    return jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0)
