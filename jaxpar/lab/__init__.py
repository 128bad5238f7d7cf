"""The layout lab: measure (:mod:`~jaxpar.lab.sweep`), predict
(:mod:`~jaxpar.lab.predict`, :mod:`~jaxpar.lab.hardware`) and rank
(:mod:`~jaxpar.lab.planner`) the layouts of a model."""
