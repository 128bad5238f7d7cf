"""The installed package wins over a folder named ``jaxpar`` in the script's directory.

A script run from the folder that holds the clone (itself a folder named ``jaxpar``, with
no ``__init__.py``) sees that folder first on ``sys.path``. Python prefers a real package
found anywhere on the path to such a namespace folder, but setuptools' editable install for
flat layouts is an import hook that runs only after the path search, so the empty
namespace package used to win (``module 'jaxpar' has no attribute 'Task'``). The
project's ``package-dir`` makes the editable install a path entry instead (pyproject.toml).
"""

import os
import subprocess
import sys
from pathlib import Path

import jaxpar

REPO = Path(__file__).resolve().parents[1]


def test_a_script_beside_the_clone_imports_the_real_package(tmp_path):
    (tmp_path / "jaxpar").symlink_to(REPO, target_is_directory=True)  # the clone's folder
    script = tmp_path / "train_mine.py"
    script.write_text("import jaxpar\nprint(jaxpar.__file__, hasattr(jaxpar, 'Task'))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    where, has_task = out.stdout.split()
    assert has_task == "True"
    assert Path(where).resolve() == Path(jaxpar.__file__).resolve()
