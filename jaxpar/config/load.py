"""A config from its files: defaults, then each YAML file in order, then the overrides;
the run directory named after a layout that differs from the first file's; and the plain
dict a run writes as its ``config.yaml``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxpar import rundir
from jaxpar.config.merge import apply_overrides, merge
from jaxpar.config.sections import Config, RunConfig
from jaxpar.errors import ConfigError
from jaxpar.yamlfile import read_yaml


def load_config(paths: list[str | Path] = (), overrides: list[str] = ()) -> Config:
    """Builds a config from defaults, YAML ``paths`` (in order: later files win) and
    ``section.key=value`` ``overrides`` (applied last).

    A layout other than the first config file's (from ``mesh.*``, ``rules.*`` or
    ``pipeline.*`` overrides, a later file, or a layout file such as
    ``configs/layouts/tp.yaml`` wherever it comes, also alone) gets a run directory of its
    own, named after it — ``runs/gpt_tiny-fsdp8``, ``runs/gpt_tiny-data4-tensor2``,
    ``runs/gpt_tiny-tp``, ``runs/gpt_tiny-stage4-zb_h1-m8`` — unless ``run.dir`` is given
    after the first file. So layouts tried one after another never resume each other's run.

    Raises:
      ConfigError: on a missing or unreadable file, an unknown key, a bad value.
    """
    config, named, names = _read_files(paths)
    final = apply_overrides(config, overrides)
    names += rundir.layout_override_names([o for o in overrides if _changes(o, named, final)])
    if (
        final.run.dir != named.run.dir
        or rundir.layout_of(final) == rundir.layout_of(named)
        or not names
    ):
        return final  # a run.dir of its own, or the config's own layout
    run = dataclasses.replace(final.run, dir=rundir.layout_dir(named.run.dir, names))
    return dataclasses.replace(final, run=run)


def _changes(override: str, named: Config, final: Config) -> bool:
    """Whether ``override`` leaves its key with another value than the config naming the run
    has (``mesh.fsdp=1`` where it is 1 names nothing); a key that is no field (a rule) does."""
    section, _, key = override.partition("=")[0].strip().partition(".")
    missing = object()
    before = getattr(getattr(named, section, None), key, missing)
    return before is missing or before != getattr(getattr(final, section, None), key, missing)


def _read_files(paths: list[str | Path]) -> tuple[Config, Config, list[str]]:
    """The config the YAML ``paths`` make; the one the first config file made (its
    ``run.dir`` and layout name the run; the defaults where there is none); and the names of
    the files that changed that layout without giving a ``run.dir``: later files, and a
    layout file (one holding layout sections only, ``configs/layouts/pipeline.yaml``)
    wherever it comes — given alone or first, it shared the default run's directory and
    resumed that run."""
    config = Config()
    named = None
    names = []
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
        layout_only = bool(raw) and set(raw) <= set(rundir.LAYOUT_SECTIONS)
        if named is None and not layout_only:
            named = config
        elif rundir.layout_of(config) != rundir.layout_of(named or Config()) and "dir" not in (
            raw.get("run") or {}
        ):
            names.append(path.stem)
    return config, named or Config(), names


def run_dir_for(config: Config, name: str) -> Config:
    """``config`` with ``run.dir`` = ``runs/<name>`` when it is still the default (a user's
    task gets its own run directory, named after it; ``runs/<name>-fsdp8`` when the
    default was given a layout's name, see :func:`load_config`)."""
    directory = rundir.task_dir(config.run.dir, RunConfig().dir, name)
    if directory == config.run.dir:
        return config
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=directory))


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
