"""Model families: what ``model.name=<name>`` means.

A family lives in one module under ``jaxpar/models/`` and registers there
(:func:`register`) everything jaxpar needs to know about it:

* its typed config — a frozen dataclass of the family's own ``model.*`` keys, each declared
  once with :func:`option` (type, default, choices, lower bound, doc);
* its Task builder — config and data → :class:`~jaxpar.task.Task` (the model, the loss, the
  batch axes, the pipeline split);
* what it takes from the config's ``data`` section (text or images);
* its parameter and FLOP counts, and the activation collectives of its layers, for the
  layout lab (:class:`LabModel`);
* the settings that trade compute for memory, which ``jaxpar plan`` tries.

The rest of the package never compares a model name: it asks the family. A user's family
registers the same way (``jaxpar.register_model``), or is named in a config as
``model.name=path/to/file.py:FAMILY`` (or ``package.module:FAMILY``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxpar.task import DataNeeds, Task

#: The family ``model.name`` names when a config does not.
DEFAULT = "gpt"


def option(default: Any, *, choices: tuple[Any, ...] = (), minimum: float | None = None,
           doc: str = "") -> Any:
    """A config field with its checks declared next to it: allowed ``choices``, a lower
    bound ``minimum`` and a one-line ``doc`` (shown when a value is refused)."""
    return field(default=default, metadata={"choices": choices, "minimum": minimum, "doc": doc})


@dataclass(frozen=True)
class Counts:
    """What the layout lab compares the compiled program with: parameters, and the
    model's FLOPs for one training example (forward and backward)."""

    params: int
    train_flops_per_example: float


@dataclass(frozen=True)
class Term:
    """One collective of a train step the layout lab predicts: what it moves, how often,
    over how many devices."""

    kind: str
    what: str
    payload_bytes: float
    group: int
    times: int = 1

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends for all ``times`` executions (ring algorithms)."""
        n, s = self.group, self.payload_bytes
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(
            self.kind, (n - 1) / n)
        return self.times * s * factor


@dataclass(frozen=True)
class LabLayout:
    """What the layout lab tells a family about one layout (plain values).

    Attributes:
      sizes: the mesh degrees by axis.
      rules: logical axis name → mesh axes.
      rows: examples per device per step (the global batch over the batch axes).
      grad_accum: microbatches accumulated per step.
      stages: ``(ticks, p, v, m)`` of the pipeline's tick table, or None.
      seq_len: tokens per example (text), image_shape: ``(H, W, C)`` (images).
      cpu: the program is XLA:CPU's (bfloat16 activations move as float32).
    """

    sizes: Mapping[str, int]
    rules: Mapping[str, tuple[str, ...]]
    rows: int
    grad_accum: int
    stages: tuple[int, int, int, int] | None
    seq_len: int = 0
    image_shape: tuple[int, ...] | None = None
    cpu: bool = False


class LabModel:
    """Model knowledge for the layout lab's textbook prediction (``jaxpar/lab/predict.py``).

    The lab predicts the gradient and weight collectives of any model from its shardings
    alone; what it cannot know is where a model's *activations* cross devices. A family
    that knows says so here, from its config and a :class:`LabLayout`.
    """

    #: top-level parameter keys that the model reads whole (gathered over every axis) even
    #: where the rules shard them, so their gradient is reduced before it is sliced
    whole_params: frozenset[str] = frozenset()
    #: how often FSDP gathers a weight outside a layer scan per step: XLA keeps one gathered
    #: copy for the backward pass (1, measured for the transformers and small CNNs) or gathers
    #: it again there (2, ZeRO-3's textbook count; measured for the ResNet's convolutions)
    gathers_outside_scans: int = 1

    def tensor_terms(self, cfg: Any, layout: LabLayout) -> list[Term]:
        """Activation collectives under tensor parallelism."""
        return []


@dataclass(frozen=True)
class Family:
    """A registered model family (see the module docstring).

    Attributes:
      name: the ``model.name`` that selects it.
      config: the frozen dataclass of its ``model.*`` keys (fields made with :func:`option`).
      task: ``(config, data) -> Task``; ``data`` is the loaded :class:`jaxpar.data.Data`
        (``seq_len`` for text, ``image_shape`` for images).
      needs: ``config -> DataNeeds``: what it takes from the config's ``data`` section.
      counts: ``(config, data) -> Counts``, or None.
      lab: its :class:`LabModel`.
      memory_fixes: ``config -> ["model.key=value", …]``: settings that lower memory at
        some compute cost (recomputation), which ``jaxpar plan`` tries on layouts that do
        not fit.
      compute_dtype: ``config -> dtype name`` of its matmuls (the roofline's peak).
      doc: one line for ``model.name``'s help.
    """

    name: str
    config: type
    task: Callable[[Any, Any], Task]
    needs: Callable[[Any], DataNeeds]
    counts: Callable[[Any, Any], Counts] | None = None
    lab: LabModel = field(default_factory=LabModel)
    memory_fixes: Callable[[Any], list[str]] = lambda cfg: []
    compute_dtype: Callable[[Any], str] = lambda cfg: "float32"
    doc: str = ""

    def keys(self) -> list[str]:
        """The family's ``model.*`` keys."""
        return [f.name for f in dataclasses.fields(self.config)]

    def make_config(self, values: dict[str, Any], check: Callable[[str, Any, Any], Any]
                    ) -> Any:
        """The typed config from ``values`` (key → raw value), each value converted by
        ``check(dotted_key, value, type)`` and held to its field's choices and bound.

        Raises:
          ValueError: naming the key, for a key the family does not have (with the closest
            one), a value of the wrong type, outside the choices or below the bound.
        """
        hints = typing.get_type_hints(self.config)
        fields = {f.name: f for f in dataclasses.fields(self.config)}
        typed = {}
        for key, value in values.items():
            if key not in fields:
                match = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.4)
                hint = f"did you mean 'model.{match[0]}'? " if match else ""
                raise ValueError(f"unknown config key 'model.{key}' for model.name={self.name}: "
                                 f"{hint}its keys: {', '.join(sorted(fields))}")
            typed[key] = check(f"model.{key}", value, hints[key])
            meta = fields[key].metadata
            if meta.get("choices") and typed[key] not in meta["choices"]:
                raise ValueError(f"config key 'model.{key}' must be one of "
                                 f"{', '.join(map(str, meta['choices']))}, got {typed[key]!r}")
            if meta.get("minimum") is not None and typed[key] < meta["minimum"]:
                raise ValueError(f"config key 'model.{key}' must be ≥ {meta['minimum']:g}, "
                                 f"got {typed[key]}")
        return self.config(**typed)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Makes ``family`` what ``model.name=<family.name>`` means; returns it.

    Raises:
      ValueError: when another family already has that name.
    """
    known = _FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise ValueError(f"model family '{family.name}' is registered already "
                         f"({known.config.__module__}); give yours another name")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every registered family by name (the built-in ones included)."""
    import jaxpar.models  # noqa: F401  (registers the built-in families)

    return dict(_FAMILIES)


def get(name: str) -> Family:
    """The family ``model.name`` names: a registered name, or ``path/to/file.py:FAMILY``
    / ``package.module:FAMILY`` naming a :class:`Family` object (registered on first use).

    Raises:
      ValueError: for a name that is neither, listing the registered families.
    """
    known = families()
    name = name or DEFAULT
    if name in known:
        return known[name]
    if ":" in name:
        from jaxpar.user_code import load_object

        obj = load_object(name, "model.name")
        if not isinstance(obj, Family):
            raise ValueError(f"model.name={name} is a {type(obj).__name__}, not a "
                             "jaxpar.models.Family; point it at a registered family object")
        return register(obj)
    match = difflib.get_close_matches(name, list(known), n=1)
    hint = f"did you mean '{match[0]}'? " if match else ""
    raise ValueError(f"config key 'model.name' names no model family: {name!r}; {hint}choose "
                     f"one of {', '.join(sorted(known))}, or FILE.py:FAMILY for your own")


def key_owners(key: str) -> list[str]:
    """The registered families that have ``model.<key>``."""
    return sorted(n for n, f in families().items() if key in f.keys())
