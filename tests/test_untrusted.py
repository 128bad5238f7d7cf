"""Code runs only where the user names it: ``train.hooks`` entries are checked to be hooks
before anything is called, and a run directory's saved ``config.yaml`` is not trusted to
name code (``model.name=FILE:NAME``, ``train.hooks``) unless the command line names it too
or ``--trust-code`` is given."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jaxpar.cli import main

ROOT = Path(__file__).resolve().parents[1]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def marker_file(tmp_path):
    """A Python file that, imported, writes a marker; it defines a zero-argument function
    that writes another, and a class that is no hook."""
    marker = tmp_path / "imported.txt"
    called = tmp_path / "called.txt"
    code = tmp_path / "evil.py"
    code.write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        f"def run():\n    open({str(called)!r}, 'w').write('called')\n"
        "class NotAHook:\n    def __init__(self):\n"
        f"        open({str(called)!r}, 'w').write('called')\n"
        "    def on_step(self, ctx, step, metrics):\n        pass\n"
    )
    return code, marker, called


@pytest.mark.parametrize(
    "name,kind",
    [
        ("os:abort", "a builtin_function_or_method"),
        ("subprocess:Popen", "the class Popen"),
        ("FILE:run", "a function"),
        ("FILE:NotAHook", "the class NotAHook"),
    ],
)
def test_a_hook_entry_that_is_no_hook_is_refused_before_it_is_called(
    tmp_path, capsys, marker_file, name, kind
):
    code, _, called = marker_file
    spec = name.replace("FILE", str(code))
    status = main(
        [
            "train",
            str(ROOT / "configs/gpt_tiny.yaml"),
            f"run.dir={tmp_path / 'r'}",
            f"train.hooks=[{spec}]",
            "train.steps=1",
        ]
    )
    assert status == 2
    assert one_line(capsys.readouterr().err) == (
        f"jaxpar: error: train.hooks entry '{spec}' is {kind}, not a jaxpar.Hook subclass or "
        "instance, so it is not called; name a class that subclasses jaxpar.Hook"
    )
    assert not called.exists()


def _run_dir(tmp_path: Path, **sections) -> Path:
    """A run directory whose config.yaml is gpt_tiny's with ``sections`` merged in."""
    config = yaml.safe_load((ROOT / "configs/gpt_tiny.yaml").read_text())
    for section, keys in sections.items():
        config.setdefault(section, {}).update(keys)
    run_dir = tmp_path / "shared_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


@pytest.mark.parametrize(
    "command",
    [["train"], ["inspect"], ["export", "--out", "x.npz"], ["plan", "--devices", "8"], ["sample"]],
)
def test_a_run_dirs_model_file_is_not_imported(tmp_path, capsys, marker_file, command):
    code, marker, _ = marker_file
    run_dir = _run_dir(tmp_path, model={"name": f"{code}:FAM"})
    argv = (
        [command[0], str(run_dir), *command[1:]]
        if command[0] != "sample"
        else ["sample", str(run_dir), "--prompt", "a"]
    )
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"jaxpar: error: {run_dir / 'config.yaml'} names code to import "
        f"(model.name={code}:FAM); code named by a run directory is not "
        "run: name it on the command line"
    ), line
    assert line.endswith(f"or pass --trust-code if you trust who wrote {run_dir}")
    assert not marker.exists()


def test_trust_code_or_the_same_name_on_the_command_line_imports_it(tmp_path, capsys, marker_file):
    code, marker, _ = marker_file
    run_dir = _run_dir(tmp_path, model={"name": f"{code}:FAM"})
    assert main(["inspect", str(run_dir), "model.name=gpt"]) == 2  # another name: refused
    assert not marker.exists()
    capsys.readouterr()
    for extra in (["--trust-code"], [f"model.name={code}:FAM"]):
        marker.unlink(missing_ok=True)
        assert main(["inspect", str(run_dir), *extra]) == 2  # FAM is not defined
        assert "defines no 'FAM'" in one_line(capsys.readouterr().err)
        assert marker.read_text() == "imported"


def test_a_run_dirs_hooks_are_not_imported_by_train(tmp_path, capsys, marker_file):
    code, marker, _ = marker_file
    run_dir = _run_dir(tmp_path, train={"hooks": [f"{code}:Hook"], "steps": 1})
    assert main(["train", str(run_dir)]) == 2
    assert one_line(capsys.readouterr().err).startswith(
        f"jaxpar: error: {run_dir / 'config.yaml'} names code to import (train.hooks=["
        f"{code}:Hook]); code named by a run directory is not run"
    )
    assert not marker.exists()
    assert main(["inspect", str(run_dir)]) == 0  # inspect imports no hooks: nothing to trust
    assert not marker.exists()
    assert main(["train", str(run_dir), "train.hooks=[]"]) == 0  # the command line decides
    assert not marker.exists()
