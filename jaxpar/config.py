"""Typed, frozen run configuration: YAML files plus dotted ``key=value`` overrides.

A config is built in three layers, later ones winning: the dataclass defaults,
then each YAML file in order, then command-line overrides such as
``mesh.fsdp=8`` or ``rules.mlp=tensor``. Every key is checked: an unknown key
is an error that names the closest valid key, a value of the wrong type is an
error that names the key and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# A rule maps a logical axis name to mesh axes: () means "not sharded".
RuleValue = tuple[str, ...]


@dataclass(frozen=True)
class RunConfig:
    """Where a run writes, how it is seeded and how many devices it uses.

    Attributes:
      dir: run directory for ``config.yaml``, ``metrics.jsonl`` and events.
      seed: seed for parameter init and data order.
      devices: device count; 0 means all accelerators, or 8 simulated CPU
        devices when no accelerator is present.
    """

    dir: str = "runs/gpt_tiny"
    seed: int = 0
    devices: int = 0


@dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees per mesh axis. One of them may be -1: it fills the rest.

    ``hosts_<axis>``: with several processes (hosts), how many of an axis's
    degree run across hosts — the slow network — while the rest stays within
    a host. 0 for every axis (default) lets the outermost axes cross hosts
    (``data`` first: data parallelism needs the least bandwidth). Otherwise
    they must multiply to the process count and each divide its axis.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    hosts_data: int = 0
    hosts_stage: int = 0
    hosts_fsdp: int = 0
    hosts_tensor: int = 0


@dataclass(frozen=True)
class RulesConfig:
    """Logical-axis rules: a named preset plus per-name overrides.

    ``overrides`` maps a logical axis name to a tuple of mesh axes (empty tuple:
    not sharded). In YAML and on the command line they are written next to
    ``preset``: ``rules.mlp=tensor``, ``rules.batch=data,fsdp``, ``rules.kv=null``.
    """

    preset: str = "auto"
    overrides: tuple[tuple[str, RuleValue], ...] = ()


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """The model section: ``name`` picks a model family (``jaxpar/models/``: ``gpt``,
    ``bert``, ``resnet``, ``convnet``, ``mlp``; empty: ``gpt``; or ``FILE.py:FAMILY``
    for your own); every other key is that family's own, declared once in its config
    class and checked when the config is complete (:meth:`typed`).

    ``settings`` holds the keys set by the config files and overrides, as given;
    ``config.model.<key>`` reads a key of the family's typed config (defaults included).
    Two sections are equal when they select the same family with the same typed config.
    """

    name: str = ""
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def family(self) -> Any:
        """The :class:`jaxpar.models.family.Family` that ``name`` selects."""
        from jaxpar.models import family

        return family.get(self.name)

    @property
    def typed(self) -> Any:
        """The family's typed config: its defaults with this section's keys applied.

        Raises:
          ValueError: for a key no family has (naming the closest of this one's), or a
            value of the wrong type, outside its choices or below its bound.
        """
        return _typed_model(self.name, self.settings)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelConfig):
            return NotImplemented
        return (self.family.name, self.typed) == (other.family.name, other.typed)

    def __hash__(self) -> int:
        return hash((self.family.name, self.typed))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        typed = self.typed
        if not hasattr(typed, key):
            raise AttributeError(f"model.{key}: model family {self.family.name} has no such "
                                 f"key (its keys: {', '.join(self.family.keys())})")
        return getattr(typed, key)


@functools.lru_cache(maxsize=64)
def _typed_model(name: str, settings: tuple[tuple[str, Any], ...]) -> Any:
    from jaxpar.models import family as family_lib

    family = family_lib.get(name)
    own = set(family.keys())
    values = {}
    for key, value in settings:
        if key in own:
            values[key] = value
        elif not family_lib.key_owners(key):  # no family has it: a typo
            family.make_config({key: value}, _check_type)  # raises, naming the closest key
    return family.make_config(values, _check_type)


@dataclass(frozen=True)
class DataConfig:
    """Training data and its loader (see ``jaxpar/data/``).

    ``path``: a token file made by ``jaxpar prepare-data`` (or any other file,
    read as byte tokens) for language models, an ``.npz`` with ``images``
    (N,H,W[,C]) and ``labels`` (N,) for classifiers; empty means the built-in
    data (Python's ``pydoc_data.topics`` text; synthetic images).
    ``dataset``: ``auto`` (``path`` or the built-in data), ``digits``
    (scikit-learn's handwritten digits) or ``synthetic`` (random tokens /
    template images of ``num_examples`` examples, for benchmarks).
    ``eval_fraction``: the held-out share. ``threads`` / ``prefetch`` /
    ``workers``: grain reader threads, batches read ahead, worker processes.
    ``wait_warn``: warn once when the loop spends more than this fraction of
    its time waiting for data (0: never).
    """

    path: str = ""
    dataset: str = "auto"
    seq_len: int = 128
    eval_fraction: float = 0.1
    image_size: int = 8
    channels: int = 1
    num_examples: int = 4096
    threads: int = 2
    prefetch: int = 4
    workers: int = 0
    wait_warn: float = 0.1


@dataclass(frozen=True)
class OptimConfig:
    """Optax chain: optimizer, learning-rate schedule, clipping, weight decay.

    ``name``: sgd|adam|adamw|lamb|adafactor. ``schedule``: constant|cosine|
    linear|step|rsqrt, always after ``warmup_steps`` of linear warmup from 0
    (below 1: that fraction of the run; longer than the run: clamped, with a warning).
    ``decay_steps`` 0 means "until the last training step". ``step_every`` and
    ``step_gamma`` define StepLR-style decay. ``clip_norm`` 0 disables
    global-norm clipping. Weight decay never applies to 1-D parameters.
    """

    name: str = "adamw"
    lr: float = 3e-3
    warmup_steps: float = 20
    schedule: str = "cosine"
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    step_every: int = 1000
    step_gamma: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    """Loop settings.

    ``nonfinite``: ``stop`` raises naming the step (exit status 3); ``skip`` leaves the
    state unchanged for that step and counts it. A step is non-finite when its loss, its
    gradients, its update or the new parameters hold an inf or a NaN.
    ``nonfinite_guard``: how the step keeps the old state of a non-finite step: ``cond``
    (the update computed again inside a ``lax.cond``: the least memory traffic; agrees
    with ``where`` to float32 rounding), ``where`` (one ``jnp.where`` per state leaf: a
    finite step's numbers are the unguarded update's), ``auto`` (``where`` on a GPU,
    ``cond`` elsewhere); see ``jaxpar/guard.py``.
    ``max_skipped``: with ``skip``, how many steps may be skipped in all (counting the
    steps of the run before it resumed) before the run fails (exit status 6): a count,
    or below 1 a fraction of ``steps``; 0: no limit. ``max_consecutive_skipped``: how
    many steps in a row may be skipped (0: no limit). ``profile_steps``: ``"START:STOP"``
    captures a JAX profiler trace of steps START to STOP-1 into
    ``<run.dir>/profile`` (steps are numbered from 1, as in ``metrics.jsonl``:
    ``"5:8"`` traces steps 5, 6 and 7); empty: off. Quote it in YAML
    (``profile_steps: "5:8"``), which otherwise reads ``5:8`` as the base-60
    number 308. ``hooks``: a user's loop hooks, each ``path/to/file.py:NAME`` or
    ``package.module:NAME`` naming a :class:`jaxpar.Hook` subclass (built with no
    arguments), an instance, or a function returning one; called after the built-in
    hooks, in order. ``fsdp_gather``: with ``grad_accum`` > 1, when parameters sharded
    over a batch axis (FSDP) are gathered: ``per_microbatch`` (in every microbatch's
    forward and backward: least memory) or ``once`` per step and kept through the
    accumulation loop (every device holds the parameters whole over data and fsdp;
    1/``grad_accum`` of the gather traffic, or less).
    """

    steps: int = 200
    batch_size: int = 32
    grad_accum: int = 1
    fsdp_gather: str = "per_microbatch"
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    nonfinite: str = "stop"
    nonfinite_guard: str = "auto"
    max_skipped: float = 0.1
    max_consecutive_skipped: int = 10
    progress: bool = True
    tensorboard: bool = False
    profile_steps: str = ""
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over mesh axis ``stage`` (used when ``mesh.stage > 1``).

    ``schedule``: gpipe, 1f1b, interleaved or zb_h1 (see ``jaxpar/pipeline``);
    ``microbatches``: how many microbatches one step's batch is cut into (0:
    twice ``mesh.stage``); ``virtual_stages``: layer chunks per device, for
    ``interleaved`` (≥ 2) only.
    """

    schedule: str = "1f1b"
    microbatches: int = 0
    virtual_stages: int = 1


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of the train state (see ``jaxpar/checkpoint.py``).

    ``dir``: where checkpoints go (empty: ``<run.dir>/checkpoints``);
    ``every_steps``: save every this many steps (0: only after the last step);
    ``keep``: how many of the latest to keep; ``keep_best``: also keep this
    many best by ``best_metric`` (an ``eval_*`` metric, evaluated at every
    save; 0: off), ``best_mode`` ``min`` or ``max``; ``async_save`` (alias
    ``async``): write in the background; ``resume``: ``auto`` (continue from
    the latest complete checkpoint in ``dir`` if there is one), ``never``, a
    step number in ``dir``, or the path of a checkpoint directory. ``verify``:
    check each file of a checkpoint against the digests recorded when it was
    written before restoring it (``auto`` falls back to the newest checkpoint
    that verifies); restored values are checked finite either way.
    """

    dir: str = ""
    every_steps: int = 0
    keep: int = 3
    keep_best: int = 0
    best_metric: str = "eval_loss"
    best_mode: str = "min"
    async_save: bool = True
    resume: str = "auto"
    verify: bool = True


@dataclass(frozen=True)
class DistributedConfig:
    """JAX's multi-process runtime (see ``jaxpar/distributed.py``).

    Empty/0/-1 (the defaults) mean: take them from ``jaxpar launch``'s
    environment, or let JAX detect the cluster (SLURM, Open MPI, Kubernetes),
    or run one process. ``coordinator``: ``host:port`` of process 0;
    ``num_processes``; ``process_id``; ``local_device_ids``: comma-separated
    ids of the devices this process uses (empty: all); ``init_timeout`` (alias
    ``timeout_s``): seconds to wait for the coordinator and for every process to
    join (then the error names the missing ones); ``bind_address``: the
    ``host:port`` process 0's coordinator listens on (empty: every interface, as
    other hosts must reach it; ``jaxpar launch`` sets the loopback address).
    """

    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    local_device_ids: str = ""
    init_timeout: int = 120
    bind_address: str = ""


@dataclass(frozen=True)
class Config:
    """The whole run configuration."""

    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "optim.name": ("sgd", "adam", "adamw", "lamb", "adafactor"),
    "optim.schedule": ("constant", "cosine", "linear", "step", "rsqrt"),
    "train.nonfinite": ("stop", "skip"),
    "train.nonfinite_guard": ("auto", "cond", "where"),
    "train.fsdp_gather": ("per_microbatch", "once"),
    "pipeline.schedule": ("gpipe", "1f1b", "interleaved", "zb_h1"),
    "checkpoint.best_mode": ("min", "max"),
    "data.dataset": ("auto", "digits", "synthetic"),
}

#: Other spellings of a key. ``async`` is the natural name but a Python keyword, so the
#: field is ``async_save``; YAML and overrides may use either.
ALIASES = {"checkpoint.async": "async_save", "distributed.timeout_s": "init_timeout"}


def _closest(key: str, valid: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.4)
    hint = f"did you mean '{prefix}{match[0]}'? " if match else ""
    return f"{hint}valid keys: {', '.join(sorted(valid))}"


class _Override(str):
    """The text of a command-line value: a string field keeps it verbatim
    (``run.dir=2024``, ``data.path=on``); other fields parse it as YAML."""


def _check_type(key: str, value: Any, typ: Any) -> Any:
    """Returns ``value`` converted to ``typ`` or raises naming ``key``."""
    if isinstance(value, _Override):
        if typ is str:
            return str(value)
        value = yaml.safe_load(value) if value.strip() else None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):  # YAML reads '1e-3' as a string
        try:
            return float(value)
        except ValueError:
            pass
    if typ == tuple[str, ...]:
        return _string_list(key, value)
    if typ in (int, float, str, bool):
        if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
            return value
        # YAML 1.1 reads some text as numbers (5:8 is base-60 for 308): quoting keeps it text.
        quote = (f" (quote it in YAML: {key.split('.')[-1]}: \"...\")"
                 if typ is str and isinstance(value, (int, float)) else "")
        raise ValueError(
            f"config key '{key}' expects {typ.__name__}, got {value!r} "
            f"({type(value).__name__}); fix the value in the YAML{quote} or the override {key}=..."
        )
    raise AssertionError(f"unsupported config field type {typ} for {key}")


def _string_list(key: str, value: Any) -> tuple[str, ...]:
    """A list of strings: a YAML list, one string, or a comma-separated string."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"config key '{key}' expects a list of strings, got {value!r}; write "
                     f"e.g. {key}=[my_hooks.py:Tracker]")


def _parse_rule(key: str, value: Any) -> RuleValue:
    """A rule value: None/'none'/'' → (), 'data,fsdp' or [data, fsdp] → tuple."""
    if isinstance(value, _Override):
        value = yaml.safe_load(value) if value.strip() else None
    if value is None:
        return ()
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        parts = [p for p in parts if p and p.lower() not in ("none", "null")]
        return tuple(parts)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        f"rule 'rules.{key}' must be a mesh axis, a list of mesh axes or null, got {value!r}"
    )


def _merge_rules(current: RulesConfig, raw: dict[str, Any]) -> RulesConfig:
    overrides = dict(current.overrides)
    preset = current.preset
    for name, value in raw.items():
        if name == "preset":
            preset = _check_type("rules.preset", value, str)
        elif name == "overrides" and isinstance(value, dict):
            overrides.update({k: _parse_rule(k, v) for k, v in value.items()})
        else:
            overrides[name] = _parse_rule(name, value)
    return RulesConfig(preset=preset, overrides=tuple(sorted(overrides.items())))


def _freeze(value: Any) -> Any:
    """A YAML value made hashable (lists → tuples) so a section stays a frozen value."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _merge_model(current: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """The model section's keys are typed by the family named at the end (a file may set
    ``model.name`` after other keys): here they are only collected."""
    name, settings = current.name, dict(current.settings)
    for key, value in raw.items():
        if key == "name":
            name = _check_type("model.name", value, str)
        else:
            settings[key] = _freeze(value)
    return ModelConfig(name, tuple(sorted(settings.items())))


def _merge_section(section: str, current: Any, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"config section '{section}' must be a mapping, got {raw!r}")
    if section == "rules":
        return _merge_rules(current, raw)
    if section == "model":
        return _merge_model(current, raw)
    hints = typing.get_type_hints(type(current))
    names = [f.name for f in dataclasses.fields(current)]
    updates = {}
    for key, value in raw.items():
        key = ALIASES.get(f"{section}.{key}", key)
        dotted = f"{section}.{key}"
        if key not in names:
            raise ValueError(f"unknown config key '{dotted}': {_closest(key, names, section + '.')}")
        value = _check_type(dotted, value, hints[key])
        if dotted in CHOICES and value not in CHOICES[dotted]:
            raise ValueError(
                f"config key '{dotted}' must be one of {', '.join(CHOICES[dotted])}, got {value!r}"
            )
        updates[key] = value
    return dataclasses.replace(current, **updates)


def merge(config: Config, raw: dict[str, Any]) -> Config:
    """Returns ``config`` updated by a nested mapping (as read from YAML)."""
    sections = [f.name for f in dataclasses.fields(Config)]
    updates = {}
    for section, body in (raw or {}).items():
        if section not in sections:
            raise ValueError(f"unknown config section '{section}': {_closest(section, sections)}")
        base = updates.get(section, getattr(config, section))
        updates[section] = _merge_section(section, base, body)
    return dataclasses.replace(config, **updates)


def parse_override(text: str) -> dict[str, Any]:
    """``'mesh.fsdp=8'`` → ``{'mesh': {'fsdp': '8'}}``; the value is typed by its field."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value, e.g. mesh.fsdp=8")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"override key {key!r} must be section.key, e.g. train.steps=100")
    return {parts[0]: {parts[1]: _Override(value)}}


_PROFILE_STEPS = re.compile(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*")


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """The steps ``train.profile_steps`` asks to trace.

    Args:
      text: ``"START:STOP"`` (steps numbered from 1, STOP excluded), or empty.

    Returns:
      ``(START, STOP)``, or None when ``text`` is empty (profiling off).

    Raises:
      ValueError: on bad syntax, START < 1 or STOP ≤ START.
    """
    if not text.strip():
        return None
    fix = ("set train.profile_steps=START:STOP with 1 ≤ START < STOP — steps are numbered "
           "from 1 and STOP is excluded, so 5:8 traces steps 5, 6 and 7 — or leave it empty")
    match = _PROFILE_STEPS.fullmatch(text)
    if match is None:
        raise ValueError(f"config key 'train.profile_steps' must look like START:STOP, "
                         f"got {text!r}; {fix}")
    start, stop = int(match[1]), int(match[2])
    if start < 1:
        raise ValueError(f"config key 'train.profile_steps' starts at step {start}, but the "
                         f"first step is 1; {fix}")
    if stop <= start:
        raise ValueError(f"config key 'train.profile_steps'={text!r} traces no step "
                         f"(STOP {stop} ≤ START {start}); {fix}")
    return start, stop


# Keys that must be at least a bound (int fields) — checked once the config is complete.
MINIMUM = {
    "run.seed": 0, "run.devices": 0, "train.steps": 1, "train.batch_size": 1,
    "train.grad_accum": 1, "train.log_every": 1, "train.eval_every": 0, "train.eval_batches": 1,
    "data.seq_len": 1, "data.channels": 1, "data.image_size": 1, "data.num_examples": 2,
    "data.threads": 0, "data.prefetch": 0, "data.workers": 0,
    "pipeline.microbatches": 0, "pipeline.virtual_stages": 1,
    "checkpoint.every_steps": 0, "checkpoint.keep": 1, "checkpoint.keep_best": 0,
    "mesh.hosts_data": 0, "mesh.hosts_stage": 0, "mesh.hosts_fsdp": 0, "mesh.hosts_tensor": 0,
    "distributed.num_processes": 0, "distributed.process_id": -1,
    "distributed.init_timeout": 1, "train.max_skipped": 0, "train.max_consecutive_skipped": 0,
}
#: The largest finite float32: a setting above it is inf inside the step.
FLOAT32_MAX = 3.4028234663852886e38
#: optim keys that enter the step as float32 numbers
FLOAT32_KEYS = ("lr", "b1", "b2", "eps", "weight_decay", "clip_norm", "min_lr_ratio",
                "step_gamma", "momentum")


def validate(config: Config) -> Config:
    """Checks value ranges that single keys cannot (called by :func:`load_config`).

    Raises:
      ValueError: naming the key, its value and the bound.
    """
    for dotted, low in MINIMUM.items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value < low:
            raise ValueError(f"config key '{dotted}' must be ≥ {low}, got {value}")
    for key in FLOAT32_KEYS:
        value = getattr(config.optim, key)
        if not math.isfinite(value):
            raise ValueError(f"config key 'optim.{key}' must be a finite number, got {value}")
        if abs(value) > FLOAT32_MAX:
            raise ValueError(f"config key 'optim.{key}'={value:g} overflows float32 (largest "
                             f"{FLOAT32_MAX:.4g}): the step would compute inf; set "
                             f"optim.{key} to a value in range")
        if value and abs(value) < 7.006e-46:  # half the smallest float32: rounds to 0
            raise ValueError(f"config key 'optim.{key}'={value:g} is 0 in float32 (smallest "
                             "1.4e-45); set a larger value, or 0 to mean none")
    if config.optim.lr * config.optim.weight_decay > FLOAT32_MAX:
        raise ValueError(
            f"config keys 'optim.lr'={config.optim.lr:g} × 'optim.weight_decay'="
            f"{config.optim.weight_decay:g} overflow float32 (the decay step lr × "
            "weight_decay × parameter would be inf); lower one of them")
    if not 0.0 <= config.data.wait_warn <= 1.0:
        raise ValueError(f"config key 'data.wait_warn' must be a fraction in [0, 1], got "
                         f"{config.data.wait_warn}")
    parse_profile_steps(config.train.profile_steps)
    config.model.typed  # the family's keys, types, choices and bounds  # noqa: B018
    return config


def _non_default(config: Config, dotted: str) -> bool:
    section, key = dotted.split(".")
    if section == "model":
        return key == "name" and bool(config.model.name)
    return getattr(getattr(config, section), key) != getattr(getattr(Config(), section), key)


def unused_settings(config: Config, *, user_task: bool = False, own_data: bool = False,
                    own_optimizer: bool = False) -> list[str]:
    """Keys set away from their default that the run ignores: another model family's keys,
    the ``model`` section for a user's task, ``data`` keys the model does not read (or all
    of them when the task brings its data), ``optim`` keys when the run brings its own
    optimizer, and the options of other choices."""
    keys: list[str] = []
    model = config.model
    explicit = [f"model.{k}" for k, _ in model.settings]
    if user_task:
        keys += explicit + ["model.name"]
    else:
        own = set(model.family.keys())
        keys += [k for k in explicit if k.split(".", 1)[1] not in own]
    data = config.data
    if own_data:
        keys += [f"data.{f.name}" for f in dataclasses.fields(DataConfig)
                 if f.name not in ("threads", "prefetch", "workers", "wait_warn")]
    elif not user_task:
        text = model.family.needs(model.typed).kind == "text"
        synthetic = data.dataset == "synthetic" or (data.dataset == "auto" and not data.path
                                                    and not text)
        keys += ["data.image_size", "data.channels"] if text else ["data.seq_len"]
        if not synthetic:
            keys += ["data.num_examples", "data.image_size", "data.channels"]
    optim = config.optim.name
    if own_optimizer:
        keys += [f"optim.{f.name}" for f in dataclasses.fields(OptimConfig)]
    if optim != "sgd":
        keys += ["optim.momentum", "optim.nesterov"]
    if optim in ("sgd", "adafactor"):
        keys += ["optim.b1", "optim.b2", "optim.eps"]
    schedule = config.optim.schedule
    if schedule != "step":
        keys += ["optim.step_every", "optim.step_gamma"]
    if schedule not in ("cosine", "linear"):
        keys += ["optim.decay_steps", "optim.min_lr_ratio"]
    if config.mesh.stage == 1:
        keys += [f"pipeline.{f.name}" for f in dataclasses.fields(PipelineConfig)]
    if not config.checkpoint.keep_best:
        keys += ["checkpoint.best_metric", "checkpoint.best_mode"]
    return [k for k in dict.fromkeys(keys) if k in explicit or _non_default(config, k)]


def warn_unused(config: Config, **run: bool) -> None:
    """Warns once per key that is set but has no effect (STYLE: never silently ignore);
    ``run`` says what the run brings itself (see :func:`unused_settings`)."""
    why = {"user_task": "the task is a user's (its model is its own)",
           "own_data": "the task brings its own data",
           "own_optimizer": "the run brings its own Optax optimizer"}
    context = [why[k] for k, on in run.items() if on] + [
        f"model.name={config.model.family.name}, optim.name={config.optim.name}, "
        f"optim.schedule={config.optim.schedule}, mesh.stage={config.mesh.stage}, "
        f"checkpoint.keep_best={config.checkpoint.keep_best}"]
    if run.get("user_task"):
        context.pop()
    for key in unused_settings(config, **run):
        warnings.warn(f"config key '{key}' has no effect with {'; '.join(context)}",
                      stacklevel=2)


def load_config(paths: list[str | Path] = (), overrides: list[str] = ()) -> Config:
    """Builds a config from defaults, YAML files (in order) and overrides.

    Args:
      paths: YAML files; later files override earlier ones.
      overrides: ``section.key=value`` strings applied last.

    A layout other than the first file's (from ``mesh.*``, ``rules.*`` or ``pipeline.*``
    overrides, or a later file such as ``configs/layouts/tp.yaml``) gets a run directory of
    its own, named after it — ``runs/gpt_tiny-fsdp8``, ``runs/gpt_tiny-data4-tensor2``,
    ``runs/gpt_tiny-tp``, ``runs/gpt_tiny-stage4-zb_h1-m8`` — unless ``run.dir`` is given
    after the first file. So layouts tried one after another never resume each other's run.

    Returns:
      The validated, frozen ``Config``.

    Raises:
      ValueError: on a missing file, unknown key, wrong type or bad choice.
    """
    config, named, names = Config(), None, []
    for path in paths:
        path = Path(path)
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"config file '{path}' must hold a mapping of sections, got "
                             f"{type(raw).__name__}")
        try:
            config = merge(config, raw)
        except ValueError as err:
            raise ValueError(f"config file '{path}': {err}") from err
        if named is None:
            named = config
        elif _layout(config) != _layout(named) and "dir" not in (raw.get("run") or {}):
            names.append(path.stem)
    named = named or config
    final = apply_overrides(config, overrides)
    names += [_override_name(text) for text in overrides if text.split("=")[0].split(".")[0]
              in _LAYOUT_SECTIONS and text.partition("=")[2]]
    if final.run.dir != named.run.dir or _layout(final) == _layout(named) or not names:
        return final  # a run.dir of its own, or the config's own layout
    return dataclasses.replace(final, run=dataclasses.replace(
        final.run, dir="-".join([named.run.dir, *names])))


_LAYOUT_SECTIONS = ("mesh", "rules", "pipeline")
# short names of layout overrides in a run directory's name (others: key and value)
_SHORT = {"pipeline.schedule": "", "pipeline.microbatches": "m", "pipeline.virtual_stages": "v",
          "rules.preset": ""}


def _layout(config: Config) -> tuple:
    return tuple(getattr(config, section) for section in _LAYOUT_SECTIONS)


def _override_name(text: str) -> str:
    """``mesh.fsdp=8`` → ``fsdp8``, ``pipeline.schedule=zb_h1`` → ``zb_h1``,
    ``pipeline.microbatches=8`` → ``m8``, ``rules.mlp=tensor`` → ``mlptensor``."""
    key, _, value = text.partition("=")
    short = _SHORT.get(key.strip(), key.strip().split(".", 1)[1])
    return re.sub(r"[^A-Za-z0-9_.]+", "", f"{short}{value.strip()}".replace("-1", "auto"))


class _DuplicateKey(yaml.MarkedYAMLError):
    """A key given twice in one YAML mapping."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise _DuplicateKey(None, None, f"key '{key}' appears twice in one mapping "
                                    f"(lines {first} and {key_node.start_mark.line + 1}); keep "
                                    "one of them", key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> Any:
    """A YAML file's content, with every way it can be unreadable a one-line error.

    Raises:
      ValueError: for a missing file or a folder, a binary or non-UTF-8 file, malformed
        YAML (naming the line and column), a key given twice in one mapping, or a YAML
        tag (``!foo``): configs are plain YAML.
    """
    if path.is_dir():
        raise ValueError(f"config file '{path}' is a directory; pass a YAML file from configs/")
    if not path.is_file():
        raise ValueError(f"config file '{path}' does not exist; pass a YAML file from configs/")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"config file '{path}' cannot be read: {err.strerror}") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"config file '{path}' is a binary file, not YAML text (it holds NUL "
                         f"bytes, the first at offset {nul})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"config file '{path}' is not UTF-8 text (byte 0x{data[err.start]:02x} "
                         f"at line {line}); save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or "malformed YAML"
        if "could not determine a constructor for the tag" in problem:
            tag = problem.split("tag", 1)[1].strip()
            problem = (f"unknown YAML tag {tag}: jaxpar configs are plain YAML (quote the "
                       "value if it is text)")
        elif not isinstance(err, _DuplicateKey):
            problem = f"invalid YAML: {problem}"
        raise ValueError(f"config file '{path}'{where}: {problem}") from None
    except yaml.YAMLError as err:  # e.g. a control character (ReaderError)
        raise ValueError(f"config file '{path}': invalid YAML: "
                         f"{str(err).splitlines()[0]}") from None


def apply_overrides(config: Config, overrides: list[str] = ()) -> Config:
    """``config`` with ``section.key=value`` overrides applied, validated."""
    for text in overrides:
        try:
            config = merge(config, parse_override(text))
        except yaml.YAMLError as err:  # the value is read as YAML for non-text keys
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"override {text!r}: the value is not valid YAML ({problem}); "
                             "quote it or fix it") from None
    return validate(config)


def run_dir_for(config: Config, name: str) -> Config:
    """``config`` with ``run.dir`` = ``runs/<name>`` when it is still the default (a user's
    task gets its own run directory, named after it; ``runs/<name>-fsdp8`` when the
    default was given a layout's name, see :func:`load_config`)."""
    default = RunConfig().dir
    if not name or not (config.run.dir == default or config.run.dir.startswith(default + "-")):
        return config
    return dataclasses.replace(config, run=dataclasses.replace(
        config.run, dir=f"runs/{name}" + config.run.dir[len(default):]))


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict of a config, as written to a run's ``config.yaml``."""
    out = dataclasses.asdict(config)
    out["model"] = {"name": config.model.name or config.model.family.name,
                    **dataclasses.asdict(config.model.typed)}
    rules = {"preset": config.rules.preset}
    rules.update({k: list(v) if v else None for k, v in config.rules.overrides})
    out["rules"] = rules
    out["train"]["hooks"] = list(config.train.hooks)
    return out

