"""What to train: a model constructor, a loss, and the logical axes of a batch.

A :class:`Task` is all jaxpar needs to train any Flax NNX module: each built-in model
family builds one (``jaxpar/models/``: e.g. ``jaxpar.models.gpt.task(GPTConfig(),
seq_len=128)``), and so is a user's own model (see ``examples/research_cnn.py``).
:class:`StageSplit` says how a model cuts into pipeline stages; :class:`DataNeeds`
what a model family takes from the config's ``data`` section.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.errors import TaskError, code_name

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
        (for per-layer randomness; may be traced). Layers that add a term of their own to
        the loss (a mixture of experts' load-balancing loss) return ``(x, (loss, {name:
        metric}))``: the chunk's share of that term and of its metrics (summed over the
        stages, as the head's are over nothing), added to the head's loss and metrics.
      head: ``(model, x, microbatch) -> (loss, metrics)`` — after the last
        layer; the same loss as the task's ``loss_fn`` (a mean over examples).
    """

    layers_key: str
    embed: Callable[[nnx.Module, Batch], jax.Array]
    stage: Callable[[nnx.Module, jax.Array, Batch, Any], jax.Array]
    head: Callable[[nnx.Module, jax.Array, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def _sequence_of(model: nnx.Module) -> Sequence[Any]:
    """``model.layers``: the layers of an ``nnx.Sequential`` (or of any module that keeps
    them in an attribute of that name)."""
    layers = getattr(model, "layers", None)  # not a logical axis: the attribute
    if layers is None:
        raise TaskError(
            f"Task.layers: the model ({type(model).__name__}) has no attribute "
            "'layers'; make it an nnx.Sequential, or give Layers(of=lambda model: "
            "[its layers in order])"
        )
    return list(layers)


@dataclass(frozen=True)
class Layers:
    """A model whose forward is a sequence of layers: what the sub-mesh pipeline executor
    (``pipeline.executor=mpmd``) cuts into stages of any shapes, by layer.

    The model's loss is ``loss(layer_n(… layer_1(layer_0(inputs(batch)))), batch)``: the
    batch enters the first layer, the last layer's output and the batch give the loss.
    A layer is a module (its parameters and state — BatchNorm statistics, dropout RNG
    streams — live in its stage) or a plain function such as ``nnx.relu``. Every
    variable of the model must belong to exactly one layer.

    Attributes:
      inputs: the batch entry the first layer reads (``"images"``), or a function
        ``batch -> x``.
      loss: ``(outputs, batch) -> loss`` or ``(loss, {name: metric})``: a mean over the
        examples, like :attr:`Task.loss_fn`.
      of: ``model -> [layers in order]`` (default: ``model.layers``, as an
        ``nnx.Sequential`` keeps them).

    Example — the 784→512→10 model of the texts, split over two devices::

        jaxpar.Task(lambda rngs: nnx.Sequential(nnx.Linear(784, 512, rngs=rngs), nnx.relu,
                                                nnx.Linear(512, 10, rngs=rngs)),
                    batch_axes={"x": ("batch", None), "y": ("batch",)},
                    layers=jaxpar.Layers(inputs="x", loss=lambda logits, batch: optax.
                        softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()))
    """

    inputs: str | Callable[[Batch], Any]
    loss: Callable[[Any, Batch], Any]
    of: Callable[[nnx.Module], Sequence[Any]] = _sequence_of

    def input_of(self, batch: Batch) -> Any:
        """The first layer's input."""
        return batch[self.inputs] if isinstance(self.inputs, str) else self.inputs(batch)

    def loss_of(self, outputs: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss and metrics of the last layer's outputs."""
        out = self.loss(outputs, batch)
        return out if isinstance(out, tuple) else (out, {})

    def loss_fn(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict]:
        """The whole model's loss: every layer in order (the task's ``loss_fn``)."""
        x = self.input_of(batch)
        for layer in self.of(model):
            x = layer(x)
        return self.loss_of(x, batch)


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
        NNX's training mode in the train step and evaluation mode in eval. May be left
        out when ``layers`` is given (it is then the layers' loss).
      batch_axes: logical axes of each batch entry, e.g. ``{"tokens": ("batch", None)}``
        (``None``: never sharded).
      path_rules: ``(regex, logical names)`` pairs for parameters without sharding
        metadata, matched against paths like ``'dense1/kernel'``.
      tokens_per_example: tokens one example carries (0 for non-sequence tasks), for the
        throughput metric.
      stages: how to cut a model whose layers are stacked into pipeline stages (both
        pipeline executors run it).
      layers: the model as a sequence of layers of any shapes, which the sub-mesh
        executor (``pipeline.executor=mpmd``) cuts into stages by layer. A task with
        neither cannot be pipelined (``mesh.stage`` must stay 1).
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
      context_parallel: the model runs with each sequence split over the ``context`` mesh
        axis (``mesh.context`` > 1): its per-token layers name the sequence dim ``seq``
        and its attention calls :func:`jaxpar.attend` with the tokens' positions (from
        :func:`jaxpar.context.positions`, reordered with :func:`jaxpar.context.order` when it
        is causal).
      init_params: parameters a fresh run starts from instead of the model's initializers
        (pretrained weights): a function ``() -> pure dict of host (numpy) arrays``
        shaped like the model's parameters (``nnx.to_pure_dict``). Each process calls it
        and places only its devices' slices; the optimizer state starts fresh. A run
        resumed from a checkpoint does not call it.
      eval_params: ``(opt_state, params) -> params`` evaluation uses instead of the
        trained ones, e.g. ``optax.contrib.schedule_free_eval_params`` for a schedule-free
        optimizer (None: the trained parameters).
      draws_by_example: the model's random draws (its dropout) are keyed by each
        example's id (as :mod:`jaxpar.models.dropout` keys jaxpar's GPT and BERT), not
        drawn over the batch's shape: a data shard then draws what one device would, so a
        model whose state is RNG streams only reduces its accumulated gradients over
        ``data`` once a step (:class:`~jaxpar.gradients.AccumulatedPerDataShard`), as a
        model without state does.
      family: the built-in model family whose config section built the model (set by
        :func:`jaxpar.task_for`; kept by ``dataclasses.replace``): the ``model`` keys of a
        config naming that family then take effect. Empty for a model of the user's own.
    """

    model_fn: Callable[[nnx.Rngs], nnx.Module]
    loss_fn: LossFn | None = None
    batch_axes: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict)
    path_rules: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    tokens_per_example: int = 0
    stages: StageSplit | None = None
    data: Any = None
    eval_data: Any = None
    optimizer: optax.GradientTransformation | None = None
    name: str = ""
    init_params: Callable[[], Any] | None = None
    layers: Layers | None = None
    context_parallel: bool = False
    eval_params: Callable[[Any, Any], Any] | None = None
    draws_by_example: bool = False
    family: str = ""

    def build_model(self, seed: int = 0) -> nnx.Module:
        """The model as a concrete module on the default device, built as a run builds it
        (its logical names kept as metadata, not applied as shardings: Flax's eager
        sharding off), with a run's initial parameters for ``run.seed=seed`` — to test it
        outside jaxpar: ``task.build_model()(batch["images"])``."""
        with nnx.use_eager_sharding(False):
            return self.model_fn(nnx.Rngs(seed))

    def __post_init__(self) -> None:
        if self.loss_fn is None:
            if self.layers is None:
                raise TaskError(
                    "a Task needs a loss: give loss_fn=(model, batch) -> (loss, "
                    "metrics), or layers=jaxpar.Layers(inputs=…, loss=…)"
                )
            object.__setattr__(self, "loss_fn", self.layers.loss_fn)
        if not self.batch_axes:
            raise TaskError(
                "a Task needs batch_axes: the logical axes of each batch entry, "
                "e.g. {'images': ('batch', None, None, None), 'labels': "
                "('batch',)}"
            )


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
    #: the model keeps attention within each packed document (``data.pack=documents``:
    #: text examples also carry ``segments``)
    documents: bool = False
    #: the model's loss weighs targets by the examples' ``loss_mask`` (fine-tuning
    #: records: :func:`loss_weights`)
    loss_mask: bool = False


def stage_output(out: Any) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(x, loss term, metrics)`` of what a :attr:`StageSplit.stage` returned (a stage
    without a loss of its own: a zero term and no metrics)."""
    if isinstance(out, tuple):
        x, (loss, metrics) = out
        return x, jnp.asarray(loss, jnp.float32), dict(metrics)
    return out, jnp.zeros((), jnp.float32), {}


def checked_loss(out: Any, name: str) -> tuple[jax.Array, dict]:
    """``out`` when it is ``(scalar loss, {name: metric})``, checked as the step is traced,
    before it first runs; ``name`` names the function that returned it.

    Raises:
      TaskError: naming it and what it returned instead.
    """
    must = (
        "; loss_fn must return (loss, metrics): a scalar loss (average the "
        "per-example losses, e.g. loss.mean()) and a dict of scalar metrics ({} for none)"
    )
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = (
            f"a {len(out)}-tuple"
            if isinstance(out, (tuple, list))
            else f"one array of shape {tuple(out.shape)}"
            if hasattr(out, "shape")
            else f"a {type(out).__name__}"
        )
        raise TaskError(f"{name} returned {got}{must}")
    loss, metrics = out
    if not hasattr(loss, "shape") or tuple(loss.shape) != ():
        got = (
            f"a loss of shape {tuple(loss.shape)}"
            if hasattr(loss, "shape")
            else f"a {type(loss).__name__} as its loss"
        )
        raise TaskError(f"{name} returned {got}{must}")
    if not isinstance(metrics, dict):
        raise TaskError(f"{name} returned a {type(metrics).__name__} as its metrics{must}")
    return loss, metrics


def checked_head(split: StageSplit, out: Any) -> tuple[jax.Array, dict]:
    """What a pipeline's last stage's ``head`` returned, checked as :func:`checked_loss`
    checks a loss (both executors, as the step is traced)."""
    return checked_loss(out, f"the stages' head ({code_name(split.head)})")


def split_microbatches(x: jax.Array, k: int, inner: int = 1) -> jax.Array:
    """[B, ...] → [k, B/k, ...] with microbatch i = rows i, i+k, … (``inner`` 1).

    Strided rows keep each device's rows on that device: the B/k dim keeps
    the batch sharding of B. With ``inner`` n, microbatch i holds the rows whose index
    modulo k·n lies in [i·n, (i+1)·n): split again by n, strided, its j-th part is the
    (i·n + j)-th of k·n strided microbatches — what a pipeline of n microbatches inside
    each of k accumulation steps must see to run them in one device's order.
    """
    rows = x.reshape(x.shape[0] // (k * inner), k, inner, *x.shape[1:])
    return jnp.moveaxis(rows, 1, 0).reshape(k, x.shape[0] // k, *x.shape[1:])


def loss_weights(batch: Batch) -> Batch:
    """``batch`` with its ``loss_mask`` [B, T+1] (target ``t`` counts where it is 1)
    turned into ``loss_weights`` [B, T+1] float32: the mask times (targets in the batch /
    targets that count; no scaling when none counts).

    Computed once on the global batch, before a strategy splits it, so that the mean of
    ``loss_weights × per-token loss`` over any equal share of the targets (a microbatch,
    a device's rows or sequence chunk, a stage's microbatch), averaged over the shares,
    is the mean over the whole batch's counted targets. Without ``loss_mask``: ``batch``
    itself (a batch already weighed passes through).
    """
    if "loss_mask" not in batch:
        return batch
    out = dict(batch)
    mask = out.pop("loss_mask")[:, 1:].astype(jnp.float32)
    scale = mask.size / jnp.maximum(mask.sum(), 1.0)
    return out | {"loss_weights": jnp.pad(mask * scale, ((0, 0), (1, 0)))}
