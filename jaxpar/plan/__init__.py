"""Every layout decision of a run, in one place (see :mod:`jaxpar.plan.plan`)."""

from jaxpar.plan.abstract import AbstractModel, abstract_model, global_batch_shapes
from jaxpar.plan.plan import Plan, StateBytes, make_plan
from jaxpar.plan.strategy import FsdpGather

__all__ = [
    "AbstractModel",
    "FsdpGather",
    "Plan",
    "StateBytes",
    "abstract_model",
    "global_batch_shapes",
    "make_plan",
]
