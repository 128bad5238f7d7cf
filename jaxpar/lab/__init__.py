"""The layout lab: measure (:mod:`~jaxpar.lab.sweep`), predict
(:mod:`~jaxpar.lab.predict`, :mod:`~jaxpar.lab.hardware`), estimate without compiling
(:mod:`~jaxpar.lab.analytic`) and rank (:mod:`~jaxpar.lab.planner`) the layouts of a model."""

from jaxpar.lab import analytic, hardware, planner, predict, sweep

__all__ = ["analytic", "hardware", "planner", "predict", "sweep"]
