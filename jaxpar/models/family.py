"""Model families: what ``model.name=<name>`` means.

A family lives in one module under ``jaxpar/models/`` and registers there
(:func:`register`) everything jaxpar needs to know about it:

* its typed config — a subclass of :class:`ModelConfig` declared with
  ``@section("model")`` (``jaxpar/schema.py``): the family's own ``model.*`` keys, each
  declared once with its type, default, choices (a ``Literal``), bound and doc
  (``pydantic.Field``);
* its Task builder — config and data → :class:`~jaxpar.task.Task` (the model, the loss, the
  batch axes, the pipeline split);
* what it takes from the config's ``data`` section (text or images);
* its parameter and FLOP counts (:class:`Counts`);
* the settings that trade compute for memory, which ``jaxpar plan`` tries.

What the layout lab knows of a family's activations is the lab's, registered there by
family name (:mod:`jaxpar.lab.families`): a model file holds only the model.

The rest of the package never compares a model name: it asks the family. A user's family
registers the same way (``jaxpar.models.register``), or is named in a config as
``model.name=path/to/file.py:FAMILY`` (or ``package.module:FAMILY``; ``jaxpar/config/``
loads it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar, Literal

from jaxpar.errors import TaskError
from jaxpar.schema import section
from jaxpar.task import DataNeeds, Task

#: The family ``model.name`` names when a config does not.
DEFAULT = "gpt"

#: The compute dtype of a family's matmuls and convolutions (parameters stay float32).
Dtype = Literal["float32", "bfloat16"]


@section("model")
class ModelConfig:
    """The ``model`` section: ``name`` picks the model family; every other key is the
    family's own, declared in its config class, which subclasses this one (with
    ``@section("model")``). Two model configs are equal when they are of the same family
    with the same keys, however ``name`` spelled the family."""

    name: str = dataclasses.field(
        default="",
        compare=False,
        metadata={
            "description": (
                "the model family: gpt, bert, llama, gemma, resnet, convnet, mlp (empty: "
                "gpt), or path/to/file.py:FAMILY / package.module:FAMILY naming a "
                "jaxpar.models.Family of your own; with --task the section has no effect"
            )
        },
    )

    #: The model keys the config files and overrides gave, as given (another family's
    #: included: they warn that they have no effect, and apply if a later ``model.name``
    #: has them). Set by ``jaxpar/config/families.py`` on the section it builds; not a field, so
    #: equality, ``asdict`` and the docs leave it out.
    given: ClassVar[tuple[tuple[str, Any], ...]] = ()


@dataclass(frozen=True)
class Counts:
    """A model's parameters, and its FLOPs for one training example (forward and
    backward): what the compiled program is compared with."""

    params: int
    train_flops_per_example: float


@dataclass(frozen=True)
class Family:
    """A registered model family (see the module docstring).

    Attributes:
      name: the ``model.name`` that selects it.
      config: its :class:`ModelConfig` subclass (the ``model.*`` keys it has).
      task: ``(config, data) -> Task``; ``data`` is the loaded :class:`jaxpar.data.Data`
        (``seq_len`` for text, ``image_shape`` for images).
      needs: ``config -> DataNeeds``: what it takes from the config's ``data`` section.
      counts: ``(config, data) -> Counts``, or None.
      memory_fixes: ``config -> ["model.key=value", …]``: settings that lower memory at
        some compute cost (recomputation), which ``jaxpar plan`` tries on layouts that do
        not fit.
      compute_dtype: ``config -> dtype name`` of its matmuls (the roofline's peak).
      unread: keys of other sections the family never reads (``context.balance`` for a
        bidirectional encoder, which has no causal work to balance): set, each is warned
        of as having no effect.
      doc: one line for ``model.name``'s help.
    """

    name: str
    config: type
    task: Callable[[Any, Any], Task]
    needs: Callable[[Any], DataNeeds]
    _: KW_ONLY  # the rest by keyword: an argument removed or added never shifts the others
    counts: Callable[[Any, Any], Counts] | None = None
    memory_fixes: Callable[[Any], list[str]] = lambda cfg: []
    compute_dtype: Callable[[Any], str] = lambda cfg: "float32"
    unread: tuple[str, ...] = ()
    doc: str = ""

    def keys(self) -> list[str]:
        """The family's own ``model.*`` keys (``name`` aside)."""
        return [f.name for f in dataclasses.fields(self.config) if f.name != "name"]


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Makes ``family`` what ``model.name=<family.name>`` means; returns it.

    Raises:
      TaskError: when another family already has that name, or its config is not a
        :class:`ModelConfig` section.
    """
    config = family.config
    if not (
        isinstance(config, type)
        and issubclass(config, ModelConfig)
        and "__pydantic_fields__" in vars(config)
    ):
        raise TaskError(
            f"model family '{family.name}': its config {config!r} must subclass "
            'jaxpar.models.ModelConfig, declared with @section("model") '
            "(from jaxpar.models import section)"
        )
    known = _FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise TaskError(
            f"model family '{family.name}' is registered already "
            f"({known.config.__module__}); give yours another name"
        )
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every registered family by name: the built-in ones (importing this module runs
    ``jaxpar/models/__init__.py`` first, which registers them) and the user's."""
    return dict(_FAMILIES)


def key_owners(key: str) -> list[str]:
    """The registered families that have ``model.<key>``."""
    return sorted(n for n, f in families().items() if key in f.keys())
