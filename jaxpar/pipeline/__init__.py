"""Pipeline parallelism: schedules as data (:mod:`~jaxpar.pipeline.schedule`), the
executor's tick table (:mod:`~jaxpar.pipeline.ticks`), the executor
(:mod:`~jaxpar.pipeline.executor`) and its charts (:mod:`~jaxpar.pipeline.chart`)."""

from jaxpar.pipeline.schedule import SCHEDULES, PipelineConfig, build, simulate
from jaxpar.pipeline.ticks import TickTable, tick_table, validate

__all__ = [
    "SCHEDULES",
    "PipelineConfig",
    "TickTable",
    "build",
    "simulate",
    "tick_table",
    "validate",
]
