"""What the layout lab knows of each model family, by family name.

A family's activations cross devices where its layers put them, which the lab's shardings
alone cannot tell (:mod:`jaxpar.lab.predict`). The lab keeps that knowledge on its side,
declared beside the family in a lab module of its own (:mod:`jaxpar.lab.transformers`,
:mod:`jaxpar.lab.resnet`), so that a model file holds only the model. A family without
an entry — the classifiers, a user's family, a task with no family — gets the base
:class:`~jaxpar.lab.terms.LabModel`: no activation terms, its parameters gathered and
reduced as their shardings say. A user's family may say more with :func:`register`.
"""

from __future__ import annotations

from jaxpar.errors import TaskError
from jaxpar.lab import resnet, transformers
from jaxpar.lab.terms import LabModel
from jaxpar.models.family import Family

_LABS: dict[str, LabModel] = {**transformers.LABS, **resnet.LABS}


def register(name: str, lab: LabModel) -> LabModel:
    """Makes ``lab`` what the layout lab knows of the family ``model.name=<name>``;
    returns it.

    Raises:
      TaskError: when that family has another lab already.
    """
    known = _LABS.get(name)
    if known is not None and known is not lab:
        raise TaskError(
            f"the layout lab knows model family '{name}' already "
            f"({type(known).__module__}); register your family's lab under its own name"
        )
    _LABS[name] = lab
    return lab


def lab_named(name: str) -> LabModel:
    """What the lab knows of the family ``model.name=<name>`` (a task's ``Task.family``;
    the base :class:`LabModel` for a name it does not know, or an empty one)."""
    return _LABS.get(name, LabModel())


def lab_for(family: Family | None) -> LabModel:
    """What the lab knows of ``family`` (the base :class:`LabModel` for one it does not
    know, or None: a task without a family)."""
    if family is None:
        return LabModel()
    return _LABS.get(family.name, LabModel())
