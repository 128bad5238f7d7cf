"""The docs site (``mkdocs.yml``, ``docs/``) builds in strict mode: every page in the nav,
every link to a page that exists, the API reference generated from the docstrings; a
broken link fails the build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(root / "mkdocs.yml"),
            "-d",
            str(out),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_docs_build_in_strict_mode_and_a_broken_link_fails(tmp_path):
    done = _build(REPO, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "A trainable problem" in api and "Linen" in api  # from the docstrings
    config = (tmp_path / "site" / "config" / "index.html").read_text()
    assert "model.moe_dispatch" in config and "train.trackers" in config

    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy)
    shutil.copytree(REPO / "jaxpar", copy / "jaxpar")
    page = copy / "docs" / "data.md"
    page.write_text(page.read_text() + "\nSee [the old page](tokenizers.md).\n")
    broken = _build(copy, tmp_path / "broken")
    assert broken.returncode != 0
    assert "tokenizers.md" in broken.stderr and "Aborted" in broken.stdout + broken.stderr
