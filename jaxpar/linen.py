"""A Flax Linen module as an NNX module that jaxpar trains, train/eval mode included.

Flax's bridge (``nnx.bridge.ToNNX`` + ``lazy_init``) turns a Linen module into an NNX one:
its variables become NNX variables (``params`` → ``nnx.Param`` with the names of
``nn.with_partitioning``, ``batch_stats`` → ``nnx.BatchStat``) and its RNG streams an
``nnx.Rngs``. The bridge leaves the mode to the caller, so NNX's ``model.train()`` /
``model.eval()`` — which jaxpar calls before each train and eval step — would never reach a
Linen BatchNorm or Dropout. :class:`Linen` is that glue: it holds NNX's ``deterministic``
and ``use_running_average`` attributes and turns them into the Linen call's mode arguments,
``mutable`` collections and dropout RNGs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from flax.nnx import variablelib

from jaxpar.errors import TaskError

#: the ``__call__`` arguments that carry a Linen module's mode, by default, and whether
#: each is True in training
MODE_ARGUMENTS = {
    "train": True,
    "training": True,
    "is_training": True,
    "deterministic": False,
    "use_running_average": False,
}
#: the Linen layers whose mode NNX's train()/eval() switch, and the attribute that does it
_MODAL_LAYERS = ((nn.BatchNorm, "use_running_average"), (nn.Dropout, "deterministic"))

Mode = Callable[[bool], dict[str, Any]]


def mode_arguments(module: nn.Module) -> tuple[tuple[str, bool], ...]:
    """The arguments of ``module.__call__`` named in :data:`MODE_ARGUMENTS`, each with
    whether it is True in training (none: the module has no mode)."""
    params = inspect.signature(module.__call__).parameters
    return tuple((n, in_training) for n, in_training in MODE_ARGUMENTS.items() if n in params)


class Linen(nnx.Module):
    """A Linen module as an NNX module: the model a :class:`jaxpar.Task` builds.

    ``model.train()`` / ``model.eval()`` reach the Linen module: in training its call gets
    the mode arguments of training (``train=True``, or ``deterministic=False`` /
    ``use_running_average=False`` — whichever its ``__call__`` takes), its non-parameter
    collections (``batch_stats``) as ``mutable`` and dropout keys from the RNG streams
    (each call advances them); in evaluation the mode arguments of evaluation, nothing
    mutable and no RNG. Parameters keep the names of ``nn.with_partitioning``, which
    jaxpar's rules map onto the mesh. Example::

        TASK = jaxpar.Task(lambda rngs: jaxpar.Linen(CNN(), jnp.zeros((1, 8, 8, 1)),
                                                     rngs=rngs), loss_fn=loss, ...)

    Args:
      module: the Linen module (unbound).
      *example_inputs: inputs of the right shapes and dtypes (one example is enough): the
        module's variables are created by calling it on them (Flax's ``lazy_init``).
      rngs: the streams for initialization and dropout (a Linen ``make_rng('dropout')``
        draws from ``params``, the one stream ``nnx.Rngs(seed)`` holds, unless given).
      mode: ``train -> {argument: value}``, the keyword arguments that put the module in
        training (``train=True``) or evaluation mode, for a ``__call__`` whose mode argument
        has another name (``mode=lambda train: {"inference": not train}``); default: its
        arguments named in :data:`MODE_ARGUMENTS`.
      **example_kwargs: keyword arguments of the example call.

    Raises:
      TaskError: no example inputs; or a BatchNorm or Dropout of the module that stays in
        training mode in evaluation mode (its mode does not come from the call's mode
        argument).
    """

    def __init__(
        self,
        module: nn.Module,
        *example_inputs: Any,
        rngs: nnx.Rngs,
        mode: Mode | None = None,
        **example_kwargs: Any,
    ) -> None:
        name = type(module).__name__
        if not example_inputs:
            raise TaskError(
                f"jaxpar.Linen({name}) needs example inputs to create the "
                f"module's variables: jaxpar.Linen({name}(), jnp.zeros((1, …)), "
                "rngs=rngs)"
            )
        self.mode = mode  # plain data by default, so two builds' graphs compare equal
        self.mode_arguments = mode_arguments(module)
        self.deterministic = False  # NNX's train()/eval() set these two
        self.use_running_average = False
        self.linen = nnx.bridge.ToNNX(module, rngs=rngs)
        with nn.intercept_methods(_refuse_training_layers(name)):
            nnx.bridge.lazy_init(
                self.linen, *example_inputs, **example_kwargs, **self.mode_kwargs(False)
            )
        stateful = nnx.state(self.linen, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
        variables = jax.tree.leaves(stateful, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.collections = tuple(
            sorted({variablelib.variable_name_from_type(type(v)) for v in variables})
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The Linen module's output in the mode NNX's ``train()``/``eval()`` set."""
        training = not self.deterministic
        mode = self.mode_kwargs(training)
        if given := sorted(set(mode) & set(kwargs)):
            raise TaskError(
                f"jaxpar.Linen sets {', '.join(given)} itself from "
                "model.train()/model.eval(); call the model without it"
            )
        # mutable unless both flags say evaluation: a train=True BatchNorm updates its averages
        updating = (training or not self.use_running_average) and self.collections
        return self.linen(
            *args,
            **kwargs,
            **mode,
            mutable=list(self.collections) if updating else False,
            rngs=None if training else nnx.Rngs(),
        )

    def mode_kwargs(self, train: bool) -> dict[str, Any]:
        """The keyword arguments of the Linen call in training (``train``) or evaluation."""
        if self.mode is not None:
            return self.mode(train)
        return {name: train == in_training for name, in_training in self.mode_arguments}


def _training_attribute(layer: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """``use_running_average`` / ``deterministic`` when this call runs a BatchNorm / Dropout
    in training mode; None for any other call."""
    for kind, attribute in _MODAL_LAYERS:
        if isinstance(layer, kind):
            call = inspect.signature(type(layer).__call__).bind(layer, *args, **kwargs)
            value = call.arguments.get(attribute)
            return None if (getattr(layer, attribute) if value is None else value) else attribute
    return None


def _refuse_training_layers(name: str) -> Callable:
    """A Linen method interceptor that raises when a BatchNorm or Dropout is called in
    training mode (the module is initialized in evaluation mode)."""

    def intercept(
        next_fun: Callable, args: tuple, kwargs: dict, context: nn.module.InterceptorContext
    ) -> Any:
        layer = context.module
        if context.method_name == "__call__" and (
            attribute := _training_attribute(layer, args, kwargs)
        ):
            raise TaskError(
                f"jaxpar.Linen({name}): {type(layer).__name__} '{'/'.join(layer.path)}' stays "
                f"in training mode under model.eval(); give {name}.__call__ a `train: bool` "
                f"argument and build the layer with {attribute}=not train (or say how: "
                "jaxpar.Linen(…, mode=lambda train: {'my_flag': train}))"
            )
        return next_fun(*args, **kwargs)

    return intercept
