"""The ``model`` section: which family ``model.name`` names, and its keys merged from the
config files and overrides — or decided by ``model.init_from``'s Hugging Face folder."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar import hf, schema
from jaxpar.errors import ConfigError
from jaxpar.models.family import DEFAULT, Family, ModelConfig, families, key_owners, register
from jaxpar.user_code import load_object

__all__ = ["family_of", "merge_model", "model_settings"]


def family_of(name: str) -> Family:
    """The family ``model.name`` names: a registered name (empty: the default), or
    ``path/to/file.py:FAMILY`` / ``package.module:FAMILY`` naming a
    :class:`~jaxpar.models.Family` object (registered when first loaded).

    Raises:
      ConfigError: for a name that is neither, listing the registered families.
    """
    known = families()
    name = name or DEFAULT
    if name in known:
        return known[name]
    if ":" in name:
        obj = load_object(name, "model.name")
        if not isinstance(obj, Family):
            raise ConfigError(
                f"model.name={name} is a {type(obj).__name__}, not a "
                "jaxpar.models.Family; point it at a registered family object"
            )
        return register(obj)
    raise ConfigError(
        f"config key 'model.name' names no model family: {name!r}; "
        f"{schema.closest(name, known, label='choose one of', cutoff=0.6)}, "
        "or FILE.py:FAMILY for your own"
    )


def model_settings(model: ModelConfig) -> dict[str, Any]:
    """The model keys a config sets (name aside): those its files and overrides gave
    (:attr:`ModelConfig.given`, another family's included) and its own away from default
    (see :mod:`jaxpar.unused`)."""
    default = type(model)()
    changed = {
        f.name: getattr(model, f.name)
        for f in dataclasses.fields(model)
        if f.name != "name" and getattr(model, f.name) != getattr(default, f.name)
    }
    return {**dict(model.given), **changed}


def merge_model(current: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """The section of the family ``model.name`` names, with the keys given so far that it
    has; another family's keys are kept aside (:mod:`jaxpar.unused` warns of them), a
    key no family has is an error naming the closest of this family's."""
    name = schema.typed(ModelConfig, "name", raw.get("name", current.name))
    if not isinstance(name, str):
        ModelConfig(name=name)  # raises, naming model.name
    given = {**model_settings(current), **{str(k): v for k, v in raw.items() if k != "name"}}
    if isinstance(given.get("init_from"), str) and given["init_from"]:
        name, given = _from_folder(name, given)
    family = family_of(name)
    own = family.keys()
    for key in given:
        if key not in own and not key_owners(key):
            raise ConfigError(
                f"unknown config key 'model.{key}' for model.name={family.name}: "
                f"{schema.closest(key, own, 'model.', 'its keys:')}"
            )
    model = family.config(
        name=name, **{k: schema.typed(family.config, k, v) for k, v in given.items() if k in own}
    )
    object.__setattr__(model, "given", tuple(given.items()))  # not a field: see ModelConfig
    return model


def _from_folder(name: str, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``model.name`` and the model keys of ``model.init_from``'s folder, which decides
    them (:func:`jaxpar.hf.folder_settings`)."""
    family, settings = hf.folder_settings(given["init_from"], family_of(name).name if name else "")
    config = family_of(family).config
    return family, hf.agreed(given, settings, family, lambda k, v: schema.typed(config, k, v))
