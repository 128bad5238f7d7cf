"""The config's declarations as data: the choices of every key (:func:`choices`) and the
Markdown reference of every section and key (:func:`reference`: ``jaxpar train
--help-config``, ``docs/config.md``), read from the sections' pydantic declarations."""

from __future__ import annotations

import typing
from typing import Any

from jaxpar import schema
from jaxpar.config import ALIASES, Config, family_of
from jaxpar.models.family import DEFAULT, families


def _sections() -> dict[str, type]:
    return typing.get_type_hints(Config)


def choices(family: str | None = None) -> dict[str, tuple[Any, ...]]:
    """Every key with a fixed set of values, read from its ``Literal`` type:
    ``{'optim.name': ('sgd', …), …}``; with ``family``, that model family's keys
    (``{'model.remat': ('none', 'full', 'save_dots'), …}``)."""
    if family is not None:
        return schema.section_choices(family_of(family).config, "model")
    out: dict[str, tuple[Any, ...]] = {}
    for name, cls in _sections().items():
        out.update(schema.section_choices(cls, name))
    return out


_HEAD = """# Configuration reference

Every key of a jaxpar config, generated from the declarations of the config sections by
`jaxpar train --help-config > docs/config.md` (a test checks that this file is current: do
not edit it by hand). A key is set in a YAML file (`section:` then `key: value`) or on the
command line (`section.key=value`, after the config files); see docs/configuration.md for
how files and overrides combine."""


def reference() -> str:
    """The Markdown reference of every section and key: type, default, choices or bounds
    and description, each built-in model family's keys included (``docs/config.md``)."""
    parts = [_HEAD]
    for name, cls in _sections().items():
        aliases = {v: k.split(".")[1] for k, v in ALIASES.items() if k.startswith(name + ".")}
        parts += [f"## `{name}`", schema.doc(cls), schema.reference(cls, name, aliases)]
        if name == "model":
            for family in sorted(families().values(), key=lambda f: (f.name != DEFAULT, f.name)):
                if family.config.__module__.startswith("jaxpar.models."):
                    parts += [
                        f"### `model.name={family.name}`",
                        f"{family.doc}.",
                        schema.reference(family.config, name, skip=("name",)),
                    ]
    return "\n\n".join(parts) + "\n"
