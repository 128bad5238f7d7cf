"""A package's public names, each imported from its module on first use (PEP 562), so
that importing the package imports nothing else: ``import jaxpar`` stays free of JAX and
of the process state JAX's libraries set, and ``jaxpar prepare-data`` starts without
loading them."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, homes: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name in ``homes`` comes from
    the module it maps to, any other from the package's submodule of that name; each is
    kept in ``namespace`` (the package's globals) once imported."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):  # dunder probes (``__wrapped__``, ``__path__``): no import
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if name in homes:
            value = getattr(importlib.import_module(homes[name]), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise  # the submodule exists but imports something missing
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
