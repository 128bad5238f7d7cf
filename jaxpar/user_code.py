"""A user's code named on the command line or in a config: ``path/to/file.py:NAME`` or
``package.module:NAME`` — a Task (``--task``) or a loop hook (``train.hooks``).

Code is imported only where the user names it: a run directory's saved ``config.yaml``
is not trusted to name code (:func:`refuse_run_dir_code`). A file is imported as a module
named after it (its folder goes at the end of ``sys.path``, so its own imports work
without shadowing installed packages), once per process. Import failures and wrong names
are one-line errors naming the file and what it defines; ``JAXPAR_DEBUG=1`` shows the
traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from jaxpar.errors import ConfigError, TaskError
from jaxpar.task import Task
from jaxpar.yamlfile import read_yaml


def _split(spec: str, what: str) -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TaskError(
            f"{what} '{spec}' must look like path/to/file.py:NAME or package.module:NAME"
        )
    return where, name


def _import_file(path: Path, what: str) -> ModuleType:
    name = path.stem if path.stem.isidentifier() else "jaxpar_user_module"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    if name in sys.modules:  # another module holds the name: keep it, load under a new one
        name = f"jaxpar_user_{name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise _ImportFailed(what, str(path), err) from err
    return module


class _ImportFailed(TaskError):
    """Importing a user's module failed inside the user's code."""

    def __init__(self, what: str, where: str, err: BaseException):
        frames = [f for f in _frames(err) if not f.filename.startswith(str(Path(__file__).parent))]
        line = f" (line {frames[-1].lineno} of {frames[-1].filename})" if frames else ""
        super().__init__(
            f"{what}: importing '{where}' failed: {type(err).__name__}: "
            f"{err}{line}; fix the file, or set JAXPAR_DEBUG=1 for the traceback"
        )


def _frames(err: BaseException) -> list[Any]:
    import traceback

    return list(traceback.extract_tb(err.__traceback__))


#: what a spec of each kind looks like (the hint of a missing file's error)
_EXAMPLES = {"train.hooks": "my_hooks.py:Upload (a jaxpar.Hook subclass)"}


def _module(where: str, what: str) -> ModuleType:
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise TaskError(
                f"{what} file '{where}' does not exist; give the path of a Python "
                f"file, e.g. {_EXAMPLES.get(what, 'examples/research_cnn.py:TASK')}"
            )
        return _import_file(path.resolve(), what)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        if err.name and where.startswith(err.name):
            raise TaskError(
                f"{what}: no module named '{where}'; give FILE.py:NAME, or make "
                "the package importable (pip install it, or set PYTHONPATH)"
            ) from err
        raise _ImportFailed(what, where, err) from err
    except Exception as err:
        raise _ImportFailed(what, where, err) from err


def load_object(spec: str, what: str) -> Any:
    """The object ``NAME`` of ``path/to/file.py:NAME`` or ``package.module:NAME``.

    Raises:
      TaskError: naming the spec, for a missing file or module, an import that failed,
        or a name the module does not define (listing what it does define).
    """
    where, name = _split(spec, what)
    module = _module(where, what)
    if not hasattr(module, name):
        public = [
            n
            for n in vars(module)
            if not n.startswith("_") and not inspect.ismodule(getattr(module, n))
        ]
        raise TaskError(
            f"{what} '{spec}': '{where}' defines no '{name}'; it defines "
            f"{', '.join(sorted(public)) or 'nothing public'}"
        )
    return getattr(module, name)


def _call(fn: Any, config: Any, spec: str) -> Any:
    """``fn()`` or, when it takes one argument, ``fn(config)``."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    if len(params) > 1:
        raise TaskError(
            f"--task '{spec}' is a function of {len(params)} arguments; point "
            "--task at a jaxpar.Task, or at a function of no arguments or of one "
            "(the config) that returns one"
        )
    return fn(config) if params else fn()


def source_file(spec: str) -> Path | None:
    """The file that defines what ``spec`` names (``path/to/file.py:NAME``, or a module's
    file for ``package.module:NAME``), or None where it has none (a built-in module)."""
    where, _ = _split(spec, "--task")
    if where.endswith(".py") or "/" in where or "\\" in where:
        return Path(where).resolve()
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and origin.endswith(".py") else None


def load_task(spec: str, config: Any = None) -> Task:
    """The :class:`~jaxpar.task.Task` that ``spec`` names: a Task, or a function returning
    one (called with the config when it takes an argument). A task without a name is
    named after ``NAME``'s file or module (``research_cnn``), which names its run dir.

    Raises:
      TaskError: see :func:`load_object`; also when ``NAME`` is not a Task and does not
        return one.
    """
    obj = load_object(spec, "--task")
    where, name = _split(spec, "--task")
    task = obj
    if not isinstance(obj, Task):
        if not callable(obj) or inspect.isclass(obj):
            raise TaskError(
                f"--task '{spec}' is a {type(obj).__name__}, not a jaxpar.Task or a "
                "function returning one; point --task at a Task"
            )
        task = _call(obj, config, spec)
        if not isinstance(task, Task):
            raise TaskError(
                f"--task '{spec}' returned a {type(task).__name__}, not a "
                "jaxpar.Task; make it return jaxpar.Task(model_fn, loss_fn, "
                "batch_axes, …)"
            )
    if not task.name:
        task = dataclasses.replace(task, name=Path(where).stem.split(".")[-1] or name)
    return task


def _given(key: str, overrides: Sequence[str], value: str | None = None) -> bool:
    """Whether an override sets ``key`` (to ``value``, when given)."""
    for text in overrides:
        name, _, given = text.partition("=")
        if name.strip() == key and (value is None or given.strip().strip("'\"") == value):
            return True
    return False


def refuse_run_dir_code(
    config_file: Path, overrides: Sequence[str], hooks: bool, trust: bool
) -> None:
    """Refuses a run directory's ``config.yaml`` that names code to import
    (``model.name=FILE:NAME``; ``train.hooks`` when ``hooks``, i.e. for training) which
    the command line does not name too: a run directory someone shares is data, not code.
    ``trust`` (``--trust-code``) lets it through.

    Raises:
      ConfigError: naming the file, the code and the two ways on.
    """
    raw = read_yaml(config_file)
    if trust or not isinstance(raw, dict):
        return
    model_section = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    train_section = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    named = []
    model = model_section.get("name")
    # the file's model.name is loaded before overrides apply: only the same name passes
    if isinstance(model, str) and ":" in model and not _given("model.name", overrides, model):
        named.append(f"model.name={model}")
    entries = train_section.get("hooks")
    if hooks and entries and not _given("train.hooks", overrides):
        shown = [str(e) for e in entries][:4] if isinstance(entries, list) else [str(entries)]
        named.append(f"train.hooks=[{','.join(shown)}]")
    if named:
        raise ConfigError(
            f"{config_file} names code to import ({'; '.join(named)}); code "
            "named by a run directory is not run: name it on the command line "
            f"({named[0]}), or pass --trust-code if you trust who wrote "
            f"{config_file.parent}"
        )
