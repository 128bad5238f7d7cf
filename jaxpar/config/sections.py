"""The run configuration's own sections (``run``, ``train``, ``distributed``) and
:class:`Config`, which assembles them with the sections declared beside the modules that
take their settings (``MeshConfig`` in ``jaxpar/mesh.py``, ``OptimConfig`` in
``jaxpar/optim.py``, a model family's keys in its file…)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator

from jaxpar.checkpoint import CheckpointConfig
from jaxpar.config.families import family_of
from jaxpar.context import ContextConfig
from jaxpar.data.data_config import DataConfig
from jaxpar.errors import ConfigError
from jaxpar.files import name_too_long, system_folder_problem
from jaxpar.guard import Guard
from jaxpar.limits import MAX_BATCH, MAX_CPU_DEVICES, MAX_DEVICES, MAX_STEPS
from jaxpar.mesh import MeshConfig
from jaxpar.models.family import DEFAULT, Family, ModelConfig, families
from jaxpar.optim import OptimConfig
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.plan import FsdpGather
from jaxpar.rules import RulesConfig
from jaxpar.schema import Float, IntList, StrList, section
from jaxpar.tensor_parallel import TensorConfig

#: ``train.nonfinite`` values.
Nonfinite = Literal["stop", "skip"]
#: ``train.trackers`` names (their hooks: jaxpar/hooks/trackers.py).
TRACKERS = ("wandb", "mlflow")


@section("run")
class RunConfig:
    """Where a run writes, how it is seeded and how many devices it uses."""

    dir: str = Field(
        "runs/gpt_tiny",
        description="run directory for config.yaml, "
        "metrics.jsonl and events; a layout other than the first config file's "
        "gets one of its own unless given (runs/gpt_tiny-fsdp8)",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,
        description="seed for parameter init and data order (32 bits: JAX's keys hold no more)",
    )
    devices: int = Field(
        0,
        ge=0,
        le=MAX_DEVICES,
        description="device count; 0: all "
        "accelerators, or 8 simulated CPU devices when there is none; at most "
        f"{MAX_CPU_DEVICES:,} simulated CPU devices (each costs host memory and "
        "start-up time), and on an accelerator at most the devices there are",
    )

    @field_validator("dir")
    @classmethod
    def _fits_the_file_system(cls, value: str) -> str:
        too_long = name_too_long(value, "run.dir")
        if too_long:
            raise ConfigError(f"{too_long}: choose a shorter run.dir")
        problem = system_folder_problem(value, "run.dir")
        if problem:
            raise ConfigError(problem)
        return value


_PROFILE_STEPS = re.compile(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*")


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """The steps ``train.profile_steps`` asks to trace: ``(START, STOP)`` from
    ``"START:STOP"`` (steps numbered from 1, STOP excluded), None when ``text`` is empty;
    a :class:`ConfigError` on bad syntax, START < 1 or STOP ≤ START."""
    if not text.strip():
        return None
    fix = (
        "set train.profile_steps=START:STOP with 1 ≤ START < STOP — steps are numbered "
        "from 1 and STOP is excluded, so 5:8 traces steps 5, 6 and 7 — or leave it empty"
    )
    match = _PROFILE_STEPS.fullmatch(text)
    if match is None:
        raise ConfigError(
            f"config key 'train.profile_steps' must look like START:STOP, got {text!r}; {fix}"
        )
    start, stop = int(match[1]), int(match[2])
    if start < 1:
        raise ConfigError(
            f"config key 'train.profile_steps' starts at step {start}, but the "
            f"first step is 1; {fix}"
        )
    if stop <= start:
        raise ConfigError(
            f"config key 'train.profile_steps'={text!r} traces no step "
            f"(STOP {stop} ≤ START {start}); {fix}"
        )
    return start, stop


@section("train")
class TrainConfig:
    """Loop settings. A step is non-finite when its loss, its gradients, its update or the
    new parameters hold an inf or a NaN."""

    steps: int = Field(200, ge=1, le=MAX_STEPS, description="training steps")
    batch_size: int = Field(
        32, ge=1, le=MAX_BATCH, description="global batch: examples per step, all devices"
    )
    grad_accum: int = Field(
        1,
        ge=1,
        le=MAX_DEVICES,
        description="microbatches per step (gradients averaged inside the step)",
    )
    fsdp_gather: FsdpGather = Field(
        "per_microbatch",
        description="with grad_accum > 1, when "
        "parameters sharded over a batch axis (FSDP) are gathered: per_microbatch (in every "
        "microbatch's forward and backward: least memory) or once per step, kept through the "
        "accumulation loop (1/grad_accum of the gather traffic, or less)",
    )
    grad_bucket_mb: Float | Literal["auto"] = Field(
        "auto",
        json_schema_extra={"type": "float (MiB) or auto"},
        description="data parallelism sums gradients over data after the backward pass in "
        "buckets of this many MiB, one collective each (where the parameters are whole on "
        "every device and the model's state is RNG streams keyed by example at most: "
        "Task.draws_by_example); 0: XLA's reduction, one collective per "
        "layer inside the backward scan (per array on the CPU); auto: 25 (PyTorch DDP's) on "
        "the CPU, 0 on GPUs, TPUs and under context; docs/performance.md, Gradient buckets",
    )

    @field_validator("grad_bucket_mb", mode="before")
    @classmethod
    def _bucket_size(cls, value: object) -> object:
        try:
            size = value if value == "auto" else float(value)
        except (TypeError, ValueError):
            size = None
        # a size rounds to whole bytes: one below a byte would silently mean 0 (XLA's)
        if size is None or (size != "auto" and (size < 0 or 0 < size * 2**20 < 1)):
            raise ConfigError(
                f"train.grad_bucket_mb={value!r}: a bucket size in MiB (0: XLA's reduction; "
                "25: PyTorch DDP's; at least a byte) or auto"
            )
        return value

    optimizer_offload: bool = Field(
        False,
        description="hold the optimizer state in the host's pinned memory between steps "
        "(moved to the devices for the update and back inside the step): device memory "
        "freed of it, its transfer paid every step; docs/performance.md, Host offload",
    )
    log_every: int = Field(
        10, ge=1, le=MAX_STEPS, description="log a metrics row every this many steps"
    )
    eval_every: int = Field(
        50,
        ge=0,
        le=MAX_STEPS,
        description="evaluate every this many steps and after the last (0: never)",
    )
    eval_batches: int = Field(
        4, ge=1, le=MAX_DEVICES, description="held-out batches per evaluation"
    )
    nonfinite: Nonfinite = Field(
        "stop",
        description="stop raises naming the step (exit status "
        "3); skip leaves the state unchanged for that step and counts it",
    )
    nonfinite_guard: Guard = Field(
        "auto",
        description="how the step keeps the old state of a "
        "non-finite step: cond (the update computed again inside a lax.cond: the least memory "
        "traffic; agrees with where to float32 rounding), where (one jnp.where per state leaf: "
        "a finite step's numbers are the unguarded update's), auto (where on a GPU, cond "
        "elsewhere); see jaxpar/guard.py",
    )
    max_skipped: Float = Field(
        0.1,
        ge=0,
        description="with skip, how many steps may be skipped "
        "in all (counting the steps before a resume) before the run fails (exit status 6): a "
        "count, or below 1 a fraction of steps; 0: no limit",
    )
    max_consecutive_skipped: int = Field(
        10, ge=0, le=MAX_STEPS, description="how many steps in a row may be skipped (0: no limit)"
    )
    progress: bool = Field(True, description="a progress bar on a terminal (plain lines else)")
    tensorboard: bool = Field(
        False, description="also write TensorBoard event files to <run.dir>/tensorboard"
    )
    trackers: StrList = Field(
        (),
        description="log the config, rows, evals and run dir to "
        "experiment trackers: wandb, mlflow (pip install 'jaxpar[NAME]'); resumed runs continue",
    )
    profile_steps: str = Field(
        "",
        description="START:STOP captures a JAX profiler trace of "
        "steps START to STOP-1 into <run.dir>/profile (steps numbered from 1, as in "
        "metrics.jsonl: 5:8 traces steps 5, 6 and 7); empty: off. Quote it in YAML "
        '(profile_steps: "5:8"), which otherwise reads 5:8 as the base-60 number 308',
    )
    hooks: StrList = Field(
        (),
        description="a user's loop hooks, each path/to/file.py:NAME or "
        "package.module:NAME naming a jaxpar.Hook subclass (built with no arguments), an "
        "instance, or a function returning one; called after the built-in hooks, in order",
    )

    @field_validator("profile_steps")
    @classmethod
    def _a_span(cls, value: str) -> str:
        parse_profile_steps(value)
        return value

    @field_validator("trackers")
    def _known_trackers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in (n for n in value if n not in TRACKERS):
            raise ConfigError(
                f"config key 'train.trackers' takes {', '.join(TRACKERS)}, got {name!r}"
            )
        return value


@section("distributed")
class DistributedConfig:
    """JAX's multi-process runtime (see ``jaxpar/distributed.py``). Empty/0/-1 (the
    defaults) mean: take them from ``jaxpar launch``'s environment, or let JAX detect the
    cluster (SLURM, Open MPI, Kubernetes), or run one process."""

    coordinator: str = Field("", description="host:port of process 0")
    num_processes: int = Field(0, ge=0, le=MAX_DEVICES, description="how many processes")
    process_id: int = Field(-1, ge=-1, le=MAX_DEVICES, description="this process's index")
    local_device_ids: IntList = Field(
        (),
        description="ids of the devices this process uses, a list or comma-separated (empty: all)",
    )
    init_timeout: int = Field(
        120,
        ge=1,
        le=7 * 24 * 3600,
        description="seconds to wait for "
        "the coordinator and for every process to join (then the error "
        "names the missing ones); at most a week",
    )
    bind_address: str = Field(
        "",
        description="the host:port process 0's coordinator listens "
        "on (empty: every interface, as other hosts must reach it; jaxpar launch sets the "
        "loopback address)",
    )


@dataclass(frozen=True)
class Config:
    """The whole run configuration: one section per module that takes settings."""

    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    model: ModelConfig = field(default_factory=lambda: families()[DEFAULT].config())
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def family(self) -> Family:
        """The model family ``model.name`` selects (:func:`family_of`)."""
        return family_of(self.model.name)
