"""The run configuration: YAML files plus dotted ``section.key=value`` overrides.

Each section is declared once, in the module that takes its settings (``MeshConfig`` in
``jaxpar/mesh.py``, ``OptimConfig`` in ``jaxpar/optim.py``, a model family's keys in its
file…), as a frozen pydantic dataclass that checks itself (``jaxpar/schema.py``). This
module assembles them into :class:`Config`, reads YAML strictly and applies overrides, in
three layers, later ones winning: the defaults, each YAML file in order, then the
overrides (together). ``jaxpar train --help-config`` prints every key (``docs/config.md``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from jaxpar import schema
from jaxpar.checkpoint import CheckpointConfig
from jaxpar.context import ContextConfig
from jaxpar.data.sources import DataConfig
from jaxpar.errors import ConfigError
from jaxpar.files import name_too_long, system_folder_problem
from jaxpar.guard import Guard
from jaxpar.mesh import MAX_CPU_DEVICES, MAX_DEVICES, MeshConfig
from jaxpar.model_section import family_of, merge_model
from jaxpar.models.family import DEFAULT, Family, ModelConfig, families
from jaxpar.optim import OptimConfig
from jaxpar.pipeline.schedule import PipelineConfig
from jaxpar.plan import FsdpGather
from jaxpar.schema import Float, IntList, StrList, section
from jaxpar.sharding import RulesConfig
from jaxpar.yamlfile import read_yaml

#: Bounds beyond any run (a larger number is a typo, refused in one line): steps (and step
#: intervals), a trillion; a global batch, 2**31 examples.
MAX_STEPS, MAX_BATCH = 10**12, 2**31

#: ``train.nonfinite`` values; ``train.trackers`` names (their hooks: jaxpar/hooks/trackers.py).
Nonfinite, TRACKERS = Literal["stop", "skip"], ("wandb", "mlflow")
#: Other spellings of a key. ``async`` is the natural name but a Python keyword, so the
#: field is ``async_save``; YAML and overrides may use either.
ALIASES = {"checkpoint.async": "async_save", "distributed.timeout_s": "init_timeout"}


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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def family(self) -> Family:
        """The model family ``model.name`` selects (:func:`family_of`)."""
        return family_of(self.model.name)


# ---------------------------------------------------------------- merging raw values


def _merge_rules(current: RulesConfig, raw: dict[str, Any]) -> RulesConfig:
    """``preset``, and one key per logical axis name to override (or an ``overrides``
    mapping of them), on top of ``current``."""
    raw = dict(raw)
    nested = raw.pop("overrides") if isinstance(raw.get("overrides"), dict) else {}
    preset = schema.typed(RulesConfig, "preset", raw.pop("preset", current.preset))
    table = {str(k): schema.typed(RulesConfig, str(k), v) for k, v in {**nested, **raw}.items()}
    return RulesConfig(preset=preset, overrides={**dict(current.overrides), **table})


def _merge_section(section: str, current: Any, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"config section '{section}' must be a mapping, got {raw!r}")
    if section == "rules":
        return _merge_rules(current, raw)
    if section == "model":
        return merge_model(current, raw)
    updates = {}
    for key, value in raw.items():
        key = ALIASES.get(f"{section}.{key}", str(key))
        updates[key] = schema.typed(type(current), key, value)
    return dataclasses.replace(current, **updates)  # validates: one line naming the key


def merge(config: Config, raw: dict[str, Any]) -> Config:
    """``config`` updated by a nested mapping (as read from YAML), each section validated:
    a :class:`ConfigError` for an unknown section or key (naming the closest), a bad value."""
    sections = [f.name for f in dataclasses.fields(Config)]
    updates = {}
    for name, body in (raw or {}).items():
        if name not in sections:
            raise ConfigError(
                f"unknown config section '{name}': "
                f"{schema.closest(str(name), sections, label='sections:')}"
            )
        updates[name] = _merge_section(name, updates.get(name, getattr(config, name)), body)
    return dataclasses.replace(config, **updates)


def parse_override(text: str) -> dict[str, Any]:
    """``'mesh.fsdp=8'`` → ``{'mesh': {'fsdp': '8'}}``; the value is typed by its key."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. mesh.fsdp=8")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.key, e.g. train.steps=100")
    return {parts[0]: {ALIASES.get(".".join(parts), parts[1]): schema.Override(value, text)}}


def apply_overrides(config: Config, overrides: list[str] = ()) -> Config:
    """``config`` with ``section.key=value`` overrides applied together (the last one of a
    key wins), each section validated once with all of its overrides."""
    raw: dict[str, dict[str, Any]] = {}
    for text in overrides:
        for section_name, body in parse_override(text).items():
            raw.setdefault(section_name, {}).update(body)
    return merge(config, raw)


# ---------------------------------------------------------------- loading


def load_config(paths: list[str | Path] = (), overrides: list[str] = ()) -> Config:
    """Builds a config from defaults, YAML ``paths`` (in order: later files win) and
    ``section.key=value`` ``overrides`` (applied last).

    A layout other than the first file's (from ``mesh.*``, ``rules.*`` or ``pipeline.*``
    overrides, or a later file such as ``configs/layouts/tp.yaml``) gets a run directory of
    its own, named after it — ``runs/gpt_tiny-fsdp8``, ``runs/gpt_tiny-data4-tensor2``,
    ``runs/gpt_tiny-tp``, ``runs/gpt_tiny-stage4-zb_h1-m8`` — unless ``run.dir`` is given
    after the first file. So layouts tried one after another never resume each other's run.

    Raises:
      ConfigError: on a missing or unreadable file, an unknown key, a bad value.
    """
    config, named, names = Config(), None, []
    for path in map(Path, paths):
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file '{path}' must hold a mapping of sections, got {type(raw).__name__}"
            )
        try:
            config = merge(config, raw)
        except ConfigError as err:
            raise ConfigError(f"config file '{path}': {err}") from err
        if named is None:
            named = config
        elif _layout(config) != _layout(named) and "dir" not in (raw.get("run") or {}):
            names.append(path.stem)
    named = named or config
    final = apply_overrides(config, overrides)
    names += [
        _override_name(text)
        for text in overrides
        if text.split("=")[0].split(".")[0] in _LAYOUT_SECTIONS and text.partition("=")[2]
    ]
    if final.run.dir != named.run.dir or _layout(final) == _layout(named) or not names:
        return final  # a run.dir of its own, or the config's own layout
    return dataclasses.replace(
        final, run=dataclasses.replace(final.run, dir="-".join([named.run.dir, *names]))
    )


_LAYOUT_SECTIONS = ("mesh", "rules", "pipeline", "context")
# short names of layout overrides in a run directory's name (others: key and value)
_SHORT = {
    "pipeline.schedule": "",
    "pipeline.microbatches": "m",
    "pipeline.virtual_stages": "v",
    "rules.preset": "",
}


def _layout(config: Config) -> tuple:
    return tuple(getattr(config, section) for section in _LAYOUT_SECTIONS)


def _override_name(text: str) -> str:
    """``mesh.fsdp=8`` → ``fsdp8``, ``pipeline.schedule=zb_h1`` → ``zb_h1``,
    ``pipeline.microbatches=8`` → ``m8``, ``rules.mlp=tensor`` → ``mlptensor``."""
    key, _, value = text.partition("=")
    short = _SHORT.get(key.strip(), key.strip().split(".", 1)[1])
    return re.sub(r"[^A-Za-z0-9_.]+", "", f"{short}{value.strip()}".replace("-1", "auto"))


def run_dir_for(config: Config, name: str) -> Config:
    """``config`` with ``run.dir`` = ``runs/<name>`` when it is still the default (a user's
    task gets its own run directory, named after it; ``runs/<name>-fsdp8`` when the
    default was given a layout's name, see :func:`load_config`)."""
    default = RunConfig().dir
    if not name or not (config.run.dir == default or config.run.dir.startswith(default + "-")):
        return config
    return dataclasses.replace(
        config,
        run=dataclasses.replace(config.run, dir=f"runs/{name}" + config.run.dir[len(default) :]),
    )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict of a config, as written to a run's ``config.yaml`` (and read back
    by :func:`load_config` as the same config)."""
    out = _plain(dataclasses.asdict(config))
    out["model"] = {
        "name": config.model.name or config.family.name,
        **{k: v for k, v in out["model"].items() if k != "name"},
    }
    out["rules"] = {
        "preset": config.rules.preset,
        **{k: list(v) if v else None for k, v in config.rules.overrides},
    }
    return out
