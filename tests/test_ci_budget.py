"""CI's time budget (tests/conftest.py, `.ci/run`): past `JAXPAR_TEST_DEADLINE` a test not
yet started is skipped, saying why; a value that is not a clock time is refused in one line;
`JAXPAR_TEST_ROTATE` starts the extended tier's files after the launching ones further on;
`pytest` leaves the heavy cases out, and `.ci/run` runs them right after the 3.11 suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEADLINE, LONGEST_FIRST, PAST_DEADLINE, ROTATE
from tests.helpers import grid

ROOT = Path(__file__).resolve().parents[1]
ONE_TEST = "tests/test_mesh.py::test_fill_and_axis_order"


def _pytest(deadline: str) -> subprocess.CompletedProcess:
    env = {**os.environ, DEADLINE: deadline}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs"]
    return subprocess.run(
        [*command, ONE_TEST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_test_past_the_deadline_is_skipped_saying_why():
    done = _pytest("1")  # 1970: long past
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout and "1 passed" not in done.stdout, done.stdout
    assert PAST_DEADLINE in done.stdout, done.stdout


def test_a_deadline_that_is_not_a_clock_time_is_refused_in_one_line():
    done = _pytest("soon")
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert f"{DEADLINE}='soon' is not a clock time" in done.stderr, done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def _collected(*args: str, env: dict | None = None) -> list[str]:
    """The node ids a child `pytest --collect-only` of ``args`` lists, in its order."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-n", "0", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_extended_tiers_files_after_the_launching_ones_start_where_the_rotation_says():
    files = ["tests/test_checkpoint.py", "tests/test_train.py", "tests/test_analytic.py"]
    assert [LONGEST_FIRST.index(Path(f).name) for f in files] == [0, 1, 2]  # unrotated order
    ids = _collected(
        "-m", "exhaustive or multiprocess", "tests/test_faults.py", *files, env={ROTATE: "1"}
    )
    order = list(dict.fromkeys(line.split("::")[0] for line in ids))
    # the launching file first, then the others one file on, the first of them last
    assert order == ["tests/test_faults.py", *files[1:], files[0]], order


def test_the_suite_leaves_the_heavy_cases_to_the_stage_right_after_it():
    """`pytest` collects none of a file's heavy cases; a grid marks its heavy cases so and
    no others; `.ci/run` runs `-m heavy` right after the 3.11 suite, before the 3.12 suite,
    and the extended tier does not run them again."""
    suite = _collected("tests/test_data.py")
    assert len(suite) > 10 and "tests/test_data.py::test_wait_warn_zero_never_warns" in suite
    assert "tests/test_data.py::test_unslowed_run_does_not_warn" not in suite  # heavy
    params = [pytest.param(x, id=x) for x in "abc"]
    marks = {p.id: [m.name for m in p.marks] for p in grid(params, {"a"}, heavy={"b"})}
    assert marks == {"a": [], "b": ["heavy"], "c": ["exhaustive"]}
    stages = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if "run_pytest .ci-venv" in line and not line.lstrip().startswith("#")
    ]
    assert stages[:2] == [
        "run_pytest .ci-venv",
        "JAXPAR_TEST_DEADLINE=$deadline run_pytest .ci-venv -m heavy",
    ], stages
    assert "run_pytest .ci-venv312" in stages[2], stages
    assert stages[3].endswith('-m "(exhaustive or multiprocess) and not heavy"'), stages
