"""Config files read as strict YAML: a key given twice and YAML tags are errors, and every
way a file can be unreadable (missing, a folder, binary, not UTF-8, malformed) is a
one-line :class:`~jaxpar.errors.ConfigError` naming the file (and the line and column).

A config is small, and so is what its YAML may ask for: at most :data:`MAX_BYTES` of text,
values nested at most :data:`MAX_DEPTH` deep, and at most :data:`MAX_NODES` values once
aliases (``*name``) are expanded — an alias bomb (anchors whose aliases multiply, 330
bytes for a billion strings) or a recursive anchor is refused while it is read, before
anything expands it. Anchors and ``<<:`` merges within those bounds work as usual.
Command-line override values are read by :func:`load` under the same bounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jaxpar.errors import ConfigError

#: The largest config file (and override value) read: 1 MiB; jaxpar's own are under 2 KiB.
MAX_BYTES = 2**20
#: The deepest nesting of lists and mappings in a config (jaxpar's own nest 3 deep).
MAX_DEPTH = 64
#: The most values (scalars, lists, mappings) a document may hold, each alias counting as
#: all the values it stands for (jaxpar's own configs hold under 200).
MAX_NODES = 100_000


class _DuplicateKey(yaml.MarkedYAMLError):
    """A key given twice in one YAML mapping."""


class _TooBig(yaml.MarkedYAMLError):
    """A document beyond :data:`MAX_DEPTH` or :data:`MAX_NODES`, or a recursive alias."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (PyYAML keeps the last silently), and that a document nested deeper than
    :data:`MAX_DEPTH`, holding more than :data:`MAX_NODES` values with its aliases
    expanded, or with an alias inside its own anchor is refused while it is composed."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._sizes: dict[int, int] = {}  # id(anchored node) → its values, aliases expanded
        self._open: set[str] = set()  # the anchors of the nodes being composed

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise _TooBig(
                    None,
                    None,
                    f"alias *{event.anchor} is inside its own anchor "
                    f"&{event.anchor} (a value that holds itself); configs hold "
                    "finite values",
                    event.start_mark,
                )
            node = super().compose_node(parent, index)
            self._count(self._sizes.get(id(node), 1), event)
            return node
        if self._depth >= MAX_DEPTH:
            raise _TooBig(
                None,
                None,
                f"values nested deeper than {MAX_DEPTH} levels; a config needs a few",
                event.start_mark,
            )
        anchor = getattr(event, "anchor", None)
        start = self._nodes
        self._depth += 1
        self._open.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.discard(anchor)
        self._count(1, event)
        if anchor is not None:
            self._sizes[id(node)] = self._nodes - start
        return node

    def _count(self, values: int, event: yaml.Event) -> None:
        self._nodes += values
        if self._nodes > MAX_NODES:
            raise _TooBig(
                None,
                None,
                f"more than {MAX_NODES:,} values with its aliases "
                "expanded (each *alias counts as all the values of its anchor); "
                "a config needs far fewer",
                event.start_mark,
            )

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # beyond Python's 4,300 digits for int('…')
            raise _TooBig(
                None,
                None,
                f"an integer of {len(node.value):,} digits; no setting takes one that large",
                node.start_mark,
            ) from None

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
                raise _DuplicateKey(
                    None,
                    None,
                    f"key '{key}' appears twice in one mapping "
                    f"(lines {first} and {key_node.start_mark.line + 1}); keep "
                    "one of them",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _text(path: Path) -> str:
    """A config file's text, with every way it can be unreadable a one-line error."""
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a directory; pass a YAML file from configs/")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass a YAML file from configs/")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read: {err.strerror}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(
            f"config file '{path}' is larger than {MAX_BYTES:,} bytes (1 MiB), "
            "too large for a config; pass a YAML file from configs/"
        )
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(
            f"config file '{path}' is a binary file, not YAML text (it holds NUL "
            f"bytes, the first at offset {nul})"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text (byte "
            f"0x{data[err.start]:02x} at line {line}); save it as UTF-8"
        ) from None


def read_yaml(path: Path) -> Any:
    """A YAML file's content.

    Raises:
      ConfigError: for a missing file or a folder, a binary or non-UTF-8 file, one over
        :data:`MAX_BYTES`, malformed YAML (naming the line and column), a key given twice
        in one mapping, a YAML tag (``!foo``: configs are plain YAML), or a document
        beyond the bounds (see the module docstring).
    """
    return load(_text(path), f"config file '{path}'")


def load(text: str, what: str, fix: str = "") -> Any:
    """YAML text's content, read as a config file is (strictly, within the bounds).

    Args:
      what: what the text is, to start the message: ``config file 'a.yaml'``,
        ``override 'train.hooks=…'``.
      fix: what to do, ending the message of malformed YAML (``quote it``).

    Raises:
      ConfigError: one line starting with ``what`` (and the line and column) and the
        problem.
    """
    if len(text) > MAX_BYTES:
        raise ConfigError(
            f"{what} is larger than {MAX_BYTES:,} characters (1 MiB), too large for a config"
        )
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or "malformed YAML"
        if "could not determine a constructor for the tag" in problem:
            tag = problem.split("tag", 1)[1].strip()
            problem = (
                f"unknown YAML tag {tag}: jaxpar configs are plain YAML (quote the "
                "value if it is text)"
            )
        elif not isinstance(err, (_DuplicateKey, _TooBig)):
            problem = f"invalid YAML: {problem}{'; ' + fix if fix else ''}"
        raise ConfigError(f"{what}{where}: {problem}") from None
    except yaml.YAMLError as err:  # e.g. a control character (ReaderError)
        raise ConfigError(
            f"{what}: invalid YAML: {str(err).splitlines()[0]}{'; ' + fix if fix else ''}"
        ) from None
    except RecursionError:  # the bounds above keep PyYAML's recursion shallow: never here
        raise ConfigError(f"{what}: values nested too deeply for a config") from None
