"""Merging raw values into a :class:`~jaxpar.config.sections.Config`: a nested mapping (as
read from YAML) or ``section.key=value`` overrides, each section validated once with all
of its new keys."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar import schema
from jaxpar.config.families import merge_model
from jaxpar.config.sections import Config
from jaxpar.errors import ConfigError
from jaxpar.rules import RulesConfig

#: Other spellings of a key. ``async`` is the natural name but a Python keyword, so the
#: field is ``async_save``; YAML and overrides may use either.
ALIASES = {"checkpoint.async": "async_save", "distributed.timeout_s": "init_timeout"}


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


def _elsewhere(config: Config, name: str, body: Any) -> str:
    """The hint for an unknown section ``name``: the key of another section its key names
    (``eval.every`` → ``train.eval_every``), else the closest section."""
    sections = [f.name for f in dataclasses.fields(Config)]
    for key in body if isinstance(body, dict) else ():
        for section in sections:
            fields = {f.name for f in dataclasses.fields(getattr(config, section))}
            for field in (f"{name}_{key}", f"{key}_{name}"):
                if field in fields:
                    return (
                        f"did you mean '{section}.{field}'? sections: {', '.join(sorted(sections))}"
                    )
    return schema.closest(str(name), sections, label="sections:")


def merge(config: Config, raw: dict[str, Any]) -> Config:
    """``config`` updated by a nested mapping (as read from YAML), each section validated:
    a :class:`ConfigError` for an unknown section or key (naming the closest), a bad value."""
    sections = [f.name for f in dataclasses.fields(Config)]
    updates = {}
    for name, body in (raw or {}).items():
        if name not in sections:
            raise ConfigError(f"unknown config section '{name}': {_elsewhere(config, name, body)}")
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
