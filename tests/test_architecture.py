"""The architecture as a test: the import-linter contracts in pyproject.toml hold (imports
flow down the layers of docs/architecture.md, no circles, models know models), they fail
when an upward import is added, and no jaxpar import hides inside a function; the public
API is small, documented (docs/api.md) and the only thing examples and benchmarks use;
``import jaxpar`` changes no process state; docs/architecture.md names every module. How
code looks and how long it grows is tests/test_style.py."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"
#: the command line (jaxpar/cli/) imports each command's modules when that command runs, so
#: that a command loads only what it needs
LAZY_IMPORTS_ALLOWED = "cli"


def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the contracts of ``root``'s pyproject.toml over ``root``'s
    package (a fresh analysis: no cache)."""
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, "
        "no_logo=True))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": ""},
        timeout=300,
    )


def test_import_contracts_hold():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout and "KEPT" in out.stdout


@pytest.mark.parametrize(
    "module,imports,broken",
    [
        ("mesh.py", "import jaxpar.loop", "jaxpar.mesh -> jaxpar.loop"),  # upward
        ("models/gpt.py", "import jaxpar.data.sources", "jaxpar.models.gpt -> jaxpar.data.sources"),
        ("plan/checks.py", "import jaxpar.plan.plan", "No cycles are allowed in jaxpar.plan"),
        (
            "optim.py",
            "def _later():\n    from jaxpar.run import build",
            "jaxpar.optim -> jaxpar.run",
        ),
    ],
)
def test_import_contracts_catch_a_bad_import(tmp_path, module, imports, broken):
    """The contracts can fail: the same tree with one bad import added is refused, naming it."""
    shutil.copytree(PACKAGE, tmp_path / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "jaxpar" / module
    target.write_text(target.read_text() + f"\n{imports}  # added by the test\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and broken in out.stdout, out.stdout


def test_every_module_has_a_layer():
    """A module the layers contract does not name is not checked: every one is named."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contracts["contracts"] if c["type"] == "layers")["layers"]
    listed = {m.strip().strip("()") for layer in layers for m in layer.replace("|", ":").split(":")}
    missing = []
    for path in _modules():
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        defines = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body)
        if parts[-1] == "__init__" and (len(parts) == 1 or not defines):
            continue  # the package itself, or a package's face (it only hands names on)
        name = ".".join(p for p in parts if p != "__init__")
        if not any(name == m or name.startswith(m + ".") for m in listed):
            missing.append(name)
    assert not missing, f"modules in no layer of pyproject.toml: {missing}"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_jaxpar_import_inside_a_function():
    """A function-level import hides a circle: only the command line imports lazily."""
    found = []
    for path in _modules():
        if path.relative_to(PACKAGE).parts[0] == LAZY_IMPORTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                names = (
                    [sub.module or ""]
                    if isinstance(sub, ast.ImportFrom)
                    else [a.name for a in sub.names]
                    if isinstance(sub, ast.Import)
                    else []
                )
                if any(n == "jaxpar" or n.startswith("jaxpar.") for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{sub.lineno}")
    assert not found, f"jaxpar imported inside a function: {', '.join(found)}"


# ---- the public API and the docs ---------------------------------------------------------
API_PAGE = ROOT / "docs" / "api.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _api_page() -> tuple[set[str], set[str]]:
    """The names the API page documents as the package's own (``::: jaxpar.NAME`` above
    its Modules section) and the public modules it lists (its table's first column)."""
    text = API_PAGE.read_text()
    package, modules = text.split("\n## Modules\n")
    names = set(re.findall(r"^::: jaxpar\.(\w+)$", package, flags=re.M))
    listed = set(re.findall(r"^\| `(jaxpar(?:\.\w+)+)` \|", modules, flags=re.M))
    return names, listed


def test_the_package_lists_exactly_its_public_api():
    import jaxpar

    for name in jaxpar.__all__:
        assert getattr(jaxpar, name) is not None, name
    public = {n for n in vars(jaxpar) if not n.startswith("_")}
    # submodules Python binds on the package as they are imported are not API unless listed
    modules = {n for n in public if type(getattr(jaxpar, n)).__name__ == "module"}
    assert public - modules == set(jaxpar.__all__)
    assert set(jaxpar.__all__) <= set(dir(jaxpar))
    assert {"Plan", "make_plan", "StageSplit", "task_for", "Task", "train"} <= set(jaxpar.__all__)
    assert len(jaxpar.__all__) <= 20, "a small API: the rest by submodule (docs/api.md)"


def test_all_is_the_list_the_api_page_documents():
    import jaxpar

    names, modules = _api_page()
    assert sorted(names) == sorted(jaxpar.__all__)
    assert len(set(jaxpar.__all__)) == len(jaxpar.__all__)
    for module in modules:  # each listed module imports, and is jaxpar's
        assert importlib.util.find_spec(module) is not None, module


def test_import_jaxpar_changes_no_process_state():
    """``import jaxpar`` in a fresh process: no signal handler, warnings filter, logging
    setting, environment variable, hook or thread changes, and JAX is not imported (each
    public name is, on first use; the command installs its own signal handlers)."""
    code = """
import json, logging, os, signal, sys, threading, warnings
def state():
    return {
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                    if isinstance(s, signal.Signals)},
        "warnings": [repr(f) for f in warnings.filters],
        "logging": [repr(logging.getLogger().handlers), logging.getLogger().level,
                    sorted(logging.Logger.manager.loggerDict)],
        "environ": dict(os.environ),
        "hooks": [repr(sys.excepthook), repr(sys.unraisablehook), repr(sys.displayhook)],
        "recursion": sys.getrecursionlimit(),
        "threads": threading.active_count(),
        "cwd": os.getcwd(),
    }
before = state()
import jaxpar
after = state()
changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
print(json.dumps({"changed": changed, "jax": "jax" in sys.modules}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"changed": {}, "jax": False}


def _public_import(module: str, name: str, api: set[str], modules: set[str]) -> bool:
    """Whether ``from module import name`` uses only the public API."""
    if module == "jaxpar":
        return name in api or f"jaxpar.{name}" in modules
    if module == "jaxpar.models" or module.startswith("jaxpar.models."):
        return not name.startswith("_")  # the families and their own modules
    if module not in modules or name.startswith("_"):
        return False
    listed = getattr(importlib.import_module(module), "__all__", None)
    return listed is None or name in listed


def test_examples_and_benchmarks_use_only_the_public_api():
    """``from jaxpar import NAME`` with NAME in ``jaxpar.__all__`` (or a public module),
    ``jaxpar.NAME`` likewise, or ``from jaxpar.MODULE import NAME`` where the API page lists
    MODULE as public (NAME in its ``__all__`` where it has one; a model family's module,
    ``jaxpar.models.*``, too) — never an internal module."""
    import jaxpar

    api = set(jaxpar.__all__)
    modules = _api_page()[1]
    found = []
    for path in sorted([*ROOT.glob("examples/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpar"):
                found += [
                    f"{path.name}: from {node.module} import {a.name}"
                    for a in node.names
                    if not _public_import(node.module, a.name, api, modules)
                ]
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("jaxpar.")
                    and a.name not in modules
                    and not a.name.startswith("jaxpar.models.")
                ]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "jaxpar"
                and not _public_import("jaxpar", node.attr, api, modules)
            ):
                found.append(f"{path.name}: jaxpar.{node.attr}")
    assert not found, found


def test_the_public_api_rule_refuses_internal_modules():
    api, modules = {"train"}, {"jaxpar.optim", "jaxpar.models"}
    assert _public_import("jaxpar", "train", api, modules)
    assert _public_import("jaxpar", "optim", api, modules)  # a public module
    assert not _public_import("jaxpar", "order", api, modules)
    assert _public_import("jaxpar.optim", "make_optimizer", api, modules)
    assert _public_import("jaxpar.models.gpt", "GPT", api, modules)
    assert not _public_import("jaxpar.plan.checks", "check_rules", api, modules)
    assert not _public_import("jaxpar.optim", "_private", api, modules)


def _architecture_entries() -> list[tuple[list[str], str]]:
    """The module table of docs/architecture.md (its first code block): each entry's names
    (``loop.py``, ``lab/``, ``figures.py, files.py``) and its description, continuation
    lines included."""
    block = ARCHITECTURE.read_text().split("```")[1]
    entries: list[tuple[list[str], str]] = []
    for line in block.splitlines()[1:]:
        head = line[:7]
        if len(line) > 7 and line[7] != " " and (head.strip().isdigit() or not head.strip()):
            names, _, description = line[7:].partition("  ")
            entries.append(([n.strip() for n in names.split(",")], description))
        elif entries and not line[:7].strip():
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    return entries


def _documented_modules() -> set[str]:
    """The modules docs/architecture.md names: ``a/b.py`` entries, and a package entry
    (``a/``) with every ``NAME.py`` its description names."""
    named = set()
    for names, description in _architecture_entries():
        for name in names:
            if name.endswith(".py"):
                named.add(name[: -len(".py")].replace("/", "."))
            elif name.endswith("/"):
                package = name.rstrip("/").replace("/", ".")
                named.add(f"{package}.__init__")
                found = re.findall(r"(?<![\w/.])(\w+)\.py\b", description)
                named.update(f"{package}.{module}" for module in found)
    return named


def test_architecture_md_names_every_module():
    """Every module of the package appears in docs/architecture.md's table (a package's
    ``__init__`` by the package's entry; the root package's by the page itself)."""
    named = _documented_modules()
    missing = []
    for path in _modules():
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if name != "__init__" and name not in named:
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"modules docs/architecture.md does not name: {missing}"
