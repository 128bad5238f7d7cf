"""The layout lab: measure (:mod:`~jaxpar.lab.sweep`), predict
(:mod:`~jaxpar.lab.predict`, :mod:`~jaxpar.lab.hardware`) and rank
(:mod:`~jaxpar.lab.planner`) the layouts of a model."""

from jaxpar.lab import hardware, planner, predict, sweep

__all__ = ["hardware", "planner", "predict", "sweep"]
