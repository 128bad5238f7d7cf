"""The architecture as a test: the import-linter contracts in pyproject.toml hold (imports
flow down the layers of docs/architecture.md, no circles, models know models), they fail
when an upward import is added, and no jaxpar import hides inside a function. How code
looks and how long it grows is tests/test_style.py."""

from __future__ import annotations

import ast
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


def test_the_package_lists_exactly_its_public_api():
    import jaxpar

    public = {n for n in vars(jaxpar) if not n.startswith("_")}
    # submodules Python binds on the package as they are imported are not API unless listed
    modules = {n for n in public if type(getattr(jaxpar, n)).__name__ == "module"}
    assert set(jaxpar.__all__) <= public
    assert public - modules == set(jaxpar.__all__) - modules
    assert {"Plan", "make_plan", "StageSplit", "task_for", "Task", "train"} <= set(jaxpar.__all__)


def test_examples_and_benchmarks_use_only_the_public_api():
    """``from jaxpar import NAME`` (NAME in ``jaxpar.__all__``), a model family's module
    (``jaxpar.models``), or a public module's own list (``jaxpar.pipeline``)."""
    import importlib

    found = []
    for path in sorted([*ROOT.glob("examples/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpar"):
                module = node.module
                if module == "jaxpar.models" or module.startswith("jaxpar.models."):
                    continue
                listed = getattr(importlib.import_module(module), "__all__", ())
                found += [
                    f"{path.name}: from {module} import {a.name}"
                    for a in node.names
                    if module not in ("jaxpar", "jaxpar.pipeline") or a.name not in listed
                ]
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("jaxpar.")
                ]
    assert not found, found
