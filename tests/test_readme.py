"""The README's commands do what they say when pasted in order on a fresh clone, and the
docs' commands are valid.

Every ``jaxpar train`` and ``jaxpar inspect`` line of the README's ```` ```bash ```` blocks
runs (``train.steps=1``, no eval: a short run, the rest of the command as written) from a fresh
directory holding the repository's ``configs/`` and ``examples/``; each train exits 0 and
logs its step in a run directory of its own, so no layout resumes another's run. Every
``jaxpar`` line of the docs' bash blocks (but those using shell variables) parses, and its
config files, keys, values and ``--task`` load. The ``plan`` and ``sweep`` numbers are
tested in ``test_families.py`` and ``test_lab.py``.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

from jaxpar.cli import main

REPO = Path(__file__).resolve().parent.parent
SHORT = ["train.steps=1", "train.eval_every=0", "train.progress=false"]  # a short run


def readme_commands(kinds=("train", "inspect"), path: Path = REPO / "README.md") -> list[list[str]]:
    """The argument lists of a page's ``jaxpar KIND …`` lines in ```bash blocks (a line
    continued with ``\\`` read whole)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            match = re.search(r"(?:^|&& )jaxpar (\w[\w-]*)(.*)", line.split(" #")[0])
            if match and match.group(1) in kinds:
                out.append([match.group(1), *shlex.split(match.group(2))])
    return out


DOC_KINDS = ("train", "inspect", "plan", "sweep", "pipeline", "export")


def docs_commands() -> list[tuple[str, list[str]]]:
    """(page, argument list) of every ``jaxpar`` command of the docs' bash blocks that
    takes a config, but those using shell variables."""
    return [
        (page.name, command)
        for page in sorted((REPO / "docs").glob("*.md"))
        for command in readme_commands(DOC_KINDS, page)
        if not any("$" in arg for arg in command)
    ]


def test_the_docs_commands_parse_and_their_configs_load(clone):
    """Docs rot: a renamed key, option, config file or task in a page's command fails."""
    from jaxpar.cli.parser import parse
    from jaxpar.config import load_config
    from jaxpar.user_code import load_task

    commands = docs_commands()
    assert len(commands) >= 15 and {c[0] for _, c in commands} >= {"train", "plan", "sweep"}
    for page, command in commands:
        args = parse(command)
        files = [a for a in args.args if "=" not in a]
        overrides = [a for a in args.args if "=" in a]
        config = load_config(files, overrides)
        if args.task:
            load_task(args.task, config)
        assert config.train.steps >= 1, (page, command)


def steps_logged(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


@pytest.fixture()
def clone(tmp_path, monkeypatch):
    """A directory that looks like a fresh clone to the commands (configs/, examples/)."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_lists_the_quickstart_and_layout_commands():
    commands = [" ".join(c) for c in readme_commands()]
    for expected in (
        "train",
        "train mesh.fsdp=8",
        "train mesh.data=4 mesh.tensor=2",
        "train mesh.stage=4 pipeline.schedule=zb_h1 pipeline.microbatches=8",
        "train --task examples/research_cnn.py:TASK mesh.data=8",
    ):
        assert expected in commands


def test_readme_names_every_config_section_and_no_other():
    """The README's list of sections is the config's (it named an ``eval`` section that
    does not exist, and left out ``tensor``)."""
    import dataclasses

    from jaxpar.config import Config

    text = (REPO / "README.md").read_text()
    listed = re.search(r"Sections: ((?:`\w+`,?\s*)+)", text).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == {f.name for f in dataclasses.fields(Config)}


# heavy (67 s, one compile per README layout): each layout trains against one device in the
# suite (tests/test_equivalence.py, test_pipeline.py, test_research.py) and `jaxpar train`
# alone runs as from a fresh shell in tests/test_cli.py; this runs them as pasted.
@pytest.mark.heavy
@pytest.mark.slow
def test_readme_commands_pasted_in_order_each_train(clone, capsys):
    dirs = []
    for command in readme_commands():
        before = {p for p in (clone / "runs").glob("*")} if (clone / "runs").exists() else set()
        assert main([*command, *(SHORT if command[0] == "train" else [])]) == 0, command
        out = capsys.readouterr().out
        if command[0] == "inspect":
            assert "params per device" in out, command
            continue
        new = {p for p in (clone / "runs").glob("*")} - before
        assert len(new) == 1, (command, new)  # a run directory of its own
        run_dir = new.pop()
        assert steps_logged(run_dir) == [1], command
        dirs.append(run_dir.name)
    assert "gpt_tiny" in dirs and "gpt_tiny-fsdp8" in dirs and "gpt_tiny-tp" in dirs

    # the Quickstart again: finished, and says how to go on; then it trains longer
    assert main(["train", *SHORT]) == 0
    out = capsys.readouterr().out
    assert (
        "the run in runs/gpt_tiny is finished (step 1 of train.steps=1); to train it "
        "longer, run again with train.steps=N (N > 1)"
    ) in out
    assert main(["train", *SHORT, "train.steps=2"]) == 0
    assert steps_logged(clone / "runs" / "gpt_tiny") == [1, 2]
