"""Config files read as strict YAML: a key given twice and YAML tags are errors, and every
way a file can be unreadable (missing, a folder, binary, not UTF-8, malformed) is a
one-line :class:`~jaxpar.errors.ConfigError` naming the file (and the line and column)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jaxpar.errors import ConfigError


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


def _text(path: Path) -> str:
    """A config file's text, with every way it can be unreadable a one-line error."""
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a directory; pass a YAML file from configs/")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass a YAML file from configs/")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read: {err.strerror}") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"config file '{path}' is a binary file, not YAML text (it holds NUL "
                          f"bytes, the first at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte "
                          f"0x{data[err.start]:02x} at line {line}); save it as UTF-8") from None


def read_yaml(path: Path) -> Any:
    """A YAML file's content.

    Raises:
      ConfigError: for a missing file or a folder, a binary or non-UTF-8 file, malformed
        YAML (naming the line and column), a key given twice in one mapping, or a YAML
        tag (``!foo``): configs are plain YAML.
    """
    text = _text(path)
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
        raise ConfigError(f"config file '{path}'{where}: {problem}") from None
    except yaml.YAMLError as err:  # e.g. a control character (ReaderError)
        raise ConfigError(f"config file '{path}': invalid YAML: "
                          f"{str(err).splitlines()[0]}") from None


