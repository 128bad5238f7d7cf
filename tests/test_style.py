"""Code style is the tools': ruff's formatter and linter (the rule set in pyproject.toml)
pass over the package, tests, benchmarks and examples, and code is split by concern rather
than left to grow — no module over ~500 lines, no function over ~80. A file that outgrows
them holds two concerns: split it, never compress it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["jaxpar", "tests", "benchmarks", "examples"]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _modules() -> list[Path]:
    return sorted((ROOT / "jaxpar").rglob("*.py"))


def test_code_is_formatted():
    out = _ruff("format", "--check")
    assert out.returncode == 0, f"run `ruff format`:\n{out.stdout}{out.stderr}"


def test_linter_passes():
    out = _ruff("check", "--output-format", "concise")
    assert out.returncode == 0, f"`ruff check` finds:\n{out.stdout}{out.stderr}"


def test_the_linter_can_fail(tmp_path):
    """The rule set is on: a late-bound loop variable (bugbear) and an unused import
    (pyflakes) are found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nfs = []\nfor i in range(3):\n    fs.append(lambda: i)\n")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise",
         "--config", str(ROOT / "pyproject.toml"), str(bad)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "F401" in out.stdout and "B023" in out.stdout, out.stdout


def test_no_module_over_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concern): {long}"


def _long_functions(source: str) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append((node.name, lines))
    return found


def test_no_function_over_the_limit():
    long = {
        f"{p.relative_to(ROOT)}:{name}": n
        for p in _modules()
        for name, n in _long_functions(p.read_text())
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split into steps): {long}"


@pytest.mark.parametrize(
    "lines,found", [(MAX_FUNCTION_LINES, False), (MAX_FUNCTION_LINES + 1, True)]
)
def test_the_function_limit_counts_lines(lines, found):
    body = "\n".join(f"    x{i} = {i}" for i in range(lines - 1))
    assert bool(_long_functions(f"def f():\n{body}\n")) is found
