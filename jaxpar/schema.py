"""Config sections declared once: frozen pydantic dataclasses whose errors are one line.

A module declares the settings it takes as a section (:func:`section`): each key's type,
default, bound (``Field(ge=…)``), choices (a ``Literal``) and doc
(``Field(description=…)``) in one place, and rules across keys as validators of the
section. Building a section — from YAML and overrides (``jaxpar/config/``), from
Python, or with ``dataclasses.replace`` — validates it, and a bad value is one
:class:`~jaxpar.errors.ConfigError` naming the key. The config reference
(``docs/config.md``) is rendered from the same declarations (:func:`reference`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, Self

import pydantic
from annotated_types import Ge, Gt, Le, Lt
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from jaxpar import yamlfile
from jaxpar.errors import ConfigError
from jaxpar.files import shorten

#: The largest finite float32: a setting above it is inf inside the step.
FLOAT32_MAX = 3.4028234663852886e38
#: Half the smallest float32 (1.4e-45): a nonzero setting below it rounds to 0.
_FLOAT32_ZERO = 7.006e-46

_STRICT = ConfigDict(strict=True, extra="forbid")


def section(name: str) -> Callable[[type], type]:
    """Makes a class the config section ``name``: a frozen pydantic dataclass (strict
    types, no unknown keys) whose validation errors are one-line :class:`ConfigError`\\ s
    naming ``name.<key>``. ``dataclasses.replace``, ``fields`` and ``asdict`` work as on
    any dataclass, and ``replace`` validates again. Keys are given by keyword only."""

    def declare(cls: type) -> type:
        cls = pydantic_dataclass(frozen=True, kw_only=True, config=_STRICT)(cls)
        validate = cls.__init__

        @functools.wraps(validate)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if args:  # by keyword: a key added or moved never shifts what a value means
                raise TypeError(f"{type(self).__name__} takes its keys by keyword only")
            try:
                validate(self, **kwargs)
            except pydantic.ValidationError as err:
                raise one_line(name, type(self), err) from None

        cls.__init__ = __init__
        return cls

    return declare


# ---------------------------------------------------------------- reusable types


def _to_float(value: Any) -> Any:
    """An int (not a bool) or a string float as a float: YAML 1.1 reads ``1e-3`` as text.
    Anything else is left for the float check to refuse."""
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError):  # not a number, or an int beyond any float
            pass
    return value


def _fits_float32(value: float) -> float:
    """Refuses a value the float32 step would turn into inf or 0."""
    if abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"={value:g} overflows float32 (largest {FLOAT32_MAX:.4g}): the step "
            "would compute inf; set {key} to a value in range"
        )
    if value and abs(value) < _FLOAT32_ZERO:
        raise ValueError(
            f"={value:g} is 0 in float32 (smallest 1.4e-45); set a larger value, or 0 to mean none"
        )
    return value


def _string_list(value: Any) -> Any:
    """A YAML list of strings, one string, or a comma-separated string, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        f" expects a list of strings, got {value!r}; write e.g. {{key}}=[first, second]"
    )


#: A finite float; an int or a string such as ``'1e-3'`` is read as one.
Float = Annotated[float, BeforeValidator(_to_float), Field(allow_inf_nan=False)]
#: A :data:`Float` that enters the train step as a float32 number: neither inf nor 0 there.
Float32 = Annotated[Float, AfterValidator(_fits_float32)]
#: A tuple of strings, given as a YAML list, one string or a comma-separated string.
StrList = Annotated[tuple[str, ...], BeforeValidator(_string_list)]


def _int_list(value: Any) -> Any:
    """A YAML list of ints, one int, or a comma-separated string of them, as a tuple."""
    if value is None or value == "":
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        parts = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        if all(v.lstrip("-").isdigit() for v in parts):
            return tuple(int(v) for v in parts)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ValueError(f" expects a list of integers, got {value!r}; write e.g. {{key}}=[3, 2]")


#: A tuple of ints, given as a YAML list, one int or a comma-separated string.
IntList = Annotated[tuple[int, ...], BeforeValidator(_int_list)]


# ---------------------------------------------------------------- one-line errors

_TYPE_NAMES = {
    "int_type": "int",
    "int_parsing": "int",
    "int_from_float": "int",
    "float_type": "float",
    "float_parsing": "float",
    "string_type": "str",
    "bool_type": "bool",
    "bool_parsing": "bool",
    "tuple_type": "a list",
    "dict_type": "a mapping",
}
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def closest(
    key: str,
    valid: Iterable[str],
    prefix: str = "",
    label: str = "valid keys:",
    cutoff: float = 0.4,
) -> str:
    """``did you mean 'PREFIX<closest>'? valid keys: …`` (difflib's closest match)."""
    valid = sorted(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=cutoff)
    hint = f"did you mean '{prefix}{match[0]}'? " if match else ""
    return f"{hint}{label} {', '.join(valid)}"


def one_line(name: str, cls: type, err: pydantic.ValidationError) -> ConfigError:
    """The first error of a section's validation as one line naming ``name.<key>``."""
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a section's own rule, worded in full
        return cause
    field = str(first["loc"][0]) if first["loc"] else ""
    key = f"{name}.{field}"
    kind = first["type"]
    value = first.get("input")
    if field not in cls.__pydantic_fields__ and kind != "unexpected_keyword_argument":
        return ConfigError(f"config key '{key}': {first['msg']}, got {value!r}")
    if kind == "unexpected_keyword_argument":
        return ConfigError(f"unknown config key '{key}': {closest(field, keys(cls), name + '.')}")
    if isinstance(cause, ValueError):  # a type's own check: the rest of a sentence
        return ConfigError(f"config key '{key}'{str(cause).replace('{key}', key)}")
    if kind in _BOUND_ERRORS:
        return ConfigError(f"config key '{key}' must be {bounds(cls, field)}, got {value!r}")
    if kind == "literal_error":
        allowed = ", ".join(map(str, choices_of(cls.__pydantic_fields__[field].annotation)))
        return ConfigError(f"config key '{key}' must be one of {allowed}, got {value!r}")
    if kind == "finite_number":
        return ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if kind in _TYPE_NAMES:
        # YAML 1.1 reads some text as numbers (5:8 is base-60 for 308): quoting keeps it text
        quote = (
            f' (quote it in YAML: {field}: "...")'
            if kind == "string_type" and isinstance(value, (int, float))
            else ""
        )
        return ConfigError(
            f"config key '{key}' expects {_TYPE_NAMES[kind]}, got {value!r} "
            f"({type(value).__name__}); fix the value in the YAML{quote} or "
            f"the override {key}=..."
        )
    return ConfigError(f"config key '{key}': {first['msg']}, got {value!r}")


# ---------------------------------------------------------------- raw values


class Override(str):
    """The text of a command-line value (``source``: the whole ``section.key=value``): a
    text key keeps it verbatim (``run.dir=2024``, ``data.path=on``); other keys read it as
    YAML (``optim.lr=1e-3``, ``rules.batch=[data, fsdp]``)."""

    def __new__(cls, text: str, source: str = "") -> Self:
        value = super().__new__(cls, text)
        value.source = source
        return value

    def parsed(self) -> Any:
        """The text read as YAML (empty: None), strictly and within a config file's bounds
        (:mod:`jaxpar.yamlfile`: no alias bomb, no deep nesting)."""
        if not self.strip():
            return None
        return yamlfile.load(
            self, f"override {shorten(self.source, 100)!r}", "quote the value or fix it"
        )


def typed(cls: type, key: str, value: Any) -> Any:
    """``value`` (from YAML, or an :class:`Override`) as key ``key`` of section ``cls``
    takes it; the section's validation does the rest."""
    if not isinstance(value, Override):
        return value
    return str(value) if takes_text(cls, key) else value.parsed()


# ---------------------------------------------------------------- reading declarations


def keys(cls: type) -> list[str]:
    """The keys of a section class, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def choices_of(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` annotation allows (``()`` for any other type)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def section_choices(cls: type, prefix: str) -> dict[str, tuple[Any, ...]]:
    """``{'PREFIX.<key>': choices}`` for every key of ``cls`` with a ``Literal`` type."""
    return {
        f"{prefix}.{k}": c
        for k, info in cls.__pydantic_fields__.items()
        if (c := choices_of(info.annotation))
    }


def takes_text(cls: type, key: str) -> bool:
    """Whether ``key`` of section ``cls`` holds text (a ``str`` or a ``Literal`` of
    strings), so that an override's text is its value, not YAML to read."""
    info = cls.__pydantic_fields__.get(key)
    if info is None:
        return False
    allowed = choices_of(info.annotation)
    return info.annotation is str or bool(allowed) and all(isinstance(c, str) for c in allowed)


def bounds(cls: type, key: str) -> str:
    """A key's declared bounds: ``≥ 1``, ``> 0``, ``in [0, 1)``…"""
    names = {Ge: "ge", Gt: "gt", Le: "le", Lt: "lt"}
    found = {
        type(m): getattr(m, names[type(m)])
        for m in cls.__pydantic_fields__[key].metadata
        if type(m) in names
    }
    low = next(((s, _number(found[t])) for t, s in ((Ge, "["), (Gt, "(")) if t in found), None)
    high = next(((s, _number(found[t])) for t, s in ((Le, "]"), (Lt, ")")) if t in found), None)
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    sign = {"[": "≥", "(": ">", "]": "≤", ")": "<"}[(low or high)[0]]
    return f"{sign} {(low or high)[1]}"


def _number(bound: float) -> str:
    """A bound as written in a message: an int exactly (``1_000_000_000_000``, as YAML and
    Python read it back), a float short (``0.5``, ``1e-08``)."""
    if isinstance(bound, int) and not isinstance(bound, bool):
        return f"{bound:_}" if abs(bound) >= 10_000 else str(bound)
    return f"{bound:g}"


# ---------------------------------------------------------------- the reference


def _type_name(info: Any) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "type" in extra:
        return str(extra["type"])
    allowed = choices_of(info.annotation)
    if allowed:
        return type(allowed[0]).__name__
    if typing.get_origin(info.annotation) is tuple:
        return "list of str"
    float32 = any(isinstance(m, AfterValidator) and m.func is _fits_float32 for m in info.metadata)
    return "float32" if float32 else getattr(info.annotation, "__name__", str(info.annotation))


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`[{', '.join(map(str, value))}]`"
    return f'`"{value}"`' if value == "" else f"`{value}`"


def _allowed(cls: type, key: str, info: Any) -> str:
    allowed = choices_of(info.annotation)
    if allowed:
        return ", ".join(f"`{c}`" for c in allowed)
    if any(isinstance(m, (Ge, Gt, Le, Lt)) for m in info.metadata):
        return bounds(cls, key)
    return ""


def reference(
    cls: type, prefix: str, aliases: dict[str, str] | None = None, skip: Iterable[str] = ()
) -> str:
    """A Markdown table of the keys of section ``cls`` (``PREFIX.<key>``): type, default,
    choices or bounds, and description; ``aliases`` maps a key to its other spelling."""
    rows = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for key, info in cls.__pydantic_fields__.items():
        if key in skip:
            continue
        alias = f" (alias `{prefix}.{aliases[key]}`)" if aliases and key in aliases else ""
        # a Markdown table cell: no line breaks, no raw | or < (read as an HTML tag)
        text = " ".join((info.description or "").split())
        text = text.replace("|", "\\|").replace("<", "\\<")
        rows.append(
            f"| `{prefix}.{key}` | {_type_name(info)} | {_shown(info.default)} | "
            f"{_allowed(cls, key, info)} | {text}{alias} |"
        )
    return "\n".join(rows)


def doc(cls: type) -> str:
    """A section class's docstring, cleaned (its first paragraphs say what it is for)."""
    return inspect.getdoc(cls) or ""
