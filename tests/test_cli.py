"""End to end: the `jaxpar` command and the run directory."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main
from tests.helpers import LIST_IMPORTS, child_env, imports_and_lines

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_default_train_writes_metrics_and_loss_falls(tmp_path):
    """`jaxpar train` alone, as from a fresh shell (the compiler's defaults: its 10 steps
    at level 0 would take longer than the faster compile saves): a loss that falls by more
    than 1 in 10 steps (the warm-up then ends at step 9), evaluation, TensorBoard, plain
    lines. (Its step-1 loss against the config's comment: tests/test_config.py, compiled
    as the comment's figure was.)"""
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli",
        "train",
        f"run.dir={tmp_path}",
        "train.steps=10",
        "train.log_every=5",
        "train.eval_every=5",
        "train.tensorboard=true",
    ]
    env = {**child_env(None, test_flags=False), **LIST_IMPORTS}
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=600
    )  # a fresh shell: no flags set (but Python's list of the modules it imports)
    assert out.returncode == 0, out.stderr
    # TensorBoard's writer loads without torch where torch is installed (4 s of start-up;
    # the blocked attempt is listed, but none of torch's own modules)
    imported, _ = imports_and_lines(out.stderr)
    assert "tensorboardX" in imported and not [m for m in imported if m.startswith("torch.")]
    assert "8 simulated CPU devices" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 5, 10]
    assert [r["step"] for r in evals] == [5, 10]
    assert all("loss" not in r and r["eval_time_s"] > 0 for r in evals)
    for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "examples_per_s", "time"):
        assert all(np.isfinite(r[key]) for r in train), key
    times = [r["time"] for r in rows]
    assert times == sorted(times) and times[0] > 0
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # from ~ln(256) = 5.57 (3.69 by step 10)
    assert (tmp_path / "config.yaml").read_text().startswith("run:")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "final loss" in out.stdout and "state per device" in out.stdout
    # stdout is not a terminal: one plain line per logged row and per evaluation, as written
    lines = out.stdout.splitlines()
    assert sum(line.startswith("step ") and "/10  loss " in line for line in lines) == 3
    assert sum(line.startswith("eval at step ") for line in lines) == 2


def test_the_tensorboard_writer_leaves_torch_importable():
    """Loading the writer without torch (above) leaves no block behind: a later `import
    torch` finds torch where it is installed."""
    from jaxpar.hooks.metrics import _summary_writer

    assert _summary_writer().__name__ == "SummaryWriter"
    assert sys.modules.get("torch", "not imported") is not None


def test_devices_flag_sets_simulated_device_count(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli",
        "train",
        "--devices",
        "4",
        f"run.dir={tmp_path}",
        "train.steps=1",
        "optim.warmup_steps=0",
        "model.n_layers=1",
        "model.d_model=32",
        "data.seq_len=16",
        "train.batch_size=4",
        "train.eval_every=0",
    ]
    out = subprocess.run(
        cmd, env=child_env(None), capture_output=True, text=True, timeout=600
    )  # a fresh shell: no device count forced
    assert out.returncode == 0, out.stderr
    assert "4 simulated CPU devices" in out.stdout and "data=4" in out.stdout


def test_bad_input_exits_2_with_message(capsys):
    assert main(["train", "mesh.data=3", "mesh.fsdp=2"]) == 2
    err = capsys.readouterr().err
    assert "multiply to 6 but there are 8 devices" in err


def test_inspect_prints_rows_and_totals(capsys):
    assert main(["inspect", str(ROOT / "configs/gpt_tiny.yaml"), "mesh.data=1", "mesh.fsdp=8"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("blocks/w_in"))
    assert "4×128×512" in row and "(layers, embed, mlp)" in row and "P(None, fsdp, None)" in row
    assert "128.00 KiB" in row  # 4·128·512·4 bytes / 8
    assert "params per device:" in out and "(total 3.33 MiB)" in out
    assert "temporaries" in out


@pytest.mark.slow
def test_train_on_a_corpus_made_by_prepare_data(tmp_path, capsys):
    """`jaxpar prepare-data` on local text, then `jaxpar train data.path=…`: the run reads the
    token file through the same loader as the default corpus, and its loss falls."""
    from jaxpar.data import builtin_text

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = builtin_text()
    (corpus / "a.txt").write_bytes(text[:60_000])
    (corpus / "b.txt").write_bytes(text[60_000:120_000])
    tokens = tmp_path / "corpus.tokens"
    assert main(["prepare-data", str(corpus), "--out", str(tokens)]) == 0
    assert "120,000 tokens from 2 documents" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "model.d_model=32",
                "model.n_layers=2",
                "model.n_heads=4",
                "model.d_ff=64",
                "model.max_seq_len=32",
                "data.seq_len=32",
                "train.batch_size=16",
                "train.steps=30",
                "train.log_every=10",
                "train.eval_every=30",
                "train.progress=false",
                "optim.warmup_steps=5",
                f"data.path={tokens}",
                f"run.dir={run_dir}",
            ]
        )
        == 0
    )
    assert f"data {tokens}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0 and rows[-1]["step"] == 30
    assert "eval_loss" in rows[-1]


@pytest.mark.parametrize(
    "command",
    [
        ["train", "mesh.fsdp=8", "--devices", "8", "--task", "t.py:TASK"],
        ["export", "configs/gpt_tiny.yaml", "mesh.fsdp=8", "--out", "p.npz", "--devices", "8"],
        ["sample", "runs/x", "mesh.data=1", "--prompt", "The ", "--devices", "1", "--top-k", "5"],
    ],
)
def test_options_may_come_anywhere(command):
    """Options after the overrides, between them, or before the command parse alike."""
    from jaxpar.cli.parser import parse

    name, rest = command[0], command[1:]
    positional = [a for a in rest if "=" in a or a.endswith((".yaml",)) or a == "runs/x"]
    options = [a for a in rest if a not in positional]
    expected = parse([name, *positional, *options])
    assert parse([name, *options, *positional]) == expected
    assert parse([*options, name, *positional]) == expected
    assert parse([name, positional[0], *options, *positional[1:]]) == expected
    assert expected.devices == int(options[options.index("--devices") + 1])


@pytest.mark.parametrize("debug", [False, True])
def test_a_bug_is_an_internal_error_not_bad_input(monkeypatch, tmp_path, capsys, debug):
    """A ValueError raised inside JAX (here: a monkeypatched JAX function) is not the user's
    mistake: one line says it is an internal error and where its traceback is, with its own
    exit status — never exit 2 and 'error: …' as for bad input."""
    import re

    import jax

    from jaxpar.errors import BAD_INPUT, INTERNAL
    from tests.helpers import GPT_SMALL

    def broken(*args, **kwargs):
        raise ValueError("boom inside JAX")

    monkeypatch.setattr(jax, "make_array_from_process_local_data", broken)
    monkeypatch.setenv("JAXPAR_DEBUG", "1" if debug else "0")
    code = main(["train", f"run.dir={tmp_path / 'run'}", "train.steps=1", *GPT_SMALL])
    err = capsys.readouterr().err
    assert code == INTERNAL != BAD_INPUT
    line = next(x for x in err.splitlines() if x.startswith("jaxpar:"))
    assert line.startswith(
        "jaxpar: internal error: ValueError: boom inside JAX — not a setting "
        "jaxpar checks, but a bug in jaxpar, JAX or the model's own code"
    )
    assert "jaxpar: error:" not in err
    if debug:  # the traceback is printed above the line
        assert "Traceback (most recent call last)" in err and "in broken" in err
    else:
        path = Path(re.search(r"the traceback is in (\S+) ", line).group(1))
        assert "in broken" in path.read_text() and "shard_batch" in path.read_text()
        assert "Traceback" not in err
        path.unlink()


# ---- bounds (issue 34, item 7) --------------------------------------------------------------
def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "args,text",
    [
        (
            ["train", "--devices", "99999999999999999999"],
            "argument --devices: expects an integer from 0 to 1_048_576, "
            "got '99999999999999999999'; "
            "see jaxpar train --help",
        ),
        (["train", "--devices", "2147483647"], "argument --devices: expects an integer from 0 to "),
        (
            ["inspect", "--devices", "abc"],
            "argument --devices: expects an integer from 0 to 1_048_576, got 'abc'",
        ),
        (["plan", "--devices", "0"], "argument --devices: expects an integer from 1 to 1_048_576"),
        (["plan", "--devices", "1" * 5000], "argument --devices: expects an integer from 1 to "),
        (
            ["sweep", "--all", "--steps", "10000000"],
            "argument --steps: expects an integer from 0 to 1_000_000, got '10000000'",
        ),
    ],
)
def test_bad_counts_on_the_command_line_are_one_line(args, text, capsys):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"jaxpar: error: {text}") and len(line) < 300, line


@pytest.mark.parametrize(
    "override,text",
    [
        (
            "run.devices=99999999999999999999",
            "config key 'run.devices' must be in [0, 1_048_576], got 99999999999999999999",
        ),
        (
            "train.steps=99999999999999999999999999999",
            "config key 'train.steps' must be in [1, 1_000_000_000_000]",
        ),
    ],
)
def test_huge_settings_are_one_line(override, text, tmp_path, capsys):
    assert main(["train", override, f"run.dir={tmp_path / 'run'}"]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"jaxpar: error: {text}")
    assert not (tmp_path / "run").exists()


def test_more_simulated_devices_than_the_cap_are_refused_before_any_is_made():
    """Without an accelerator (and no device count forced), --devices above 4,096 is one
    line and exit 2 within seconds: the devices are never created (2**31 of them ate
    23.7 GB before the process was killed)."""
    import time

    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "inspect", "--devices", "5000"],
        env=child_env(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert _one_line(out.stderr) == (
        "jaxpar: error: run.devices=5000 (--devices): without an accelerator jaxpar simulates "
        "at most 4,096 CPU devices (each costs host memory and start-up time); set --devices "
        "(or run.devices) to at most 4,096"
    )
    assert time.perf_counter() - start < 30


def test_a_run_dir_of_3990_characters_is_one_short_line_naming_the_cause(tmp_path, capsys):
    run_dir = tmp_path / ("a" * 3990)
    assert main(["train", f"run.dir={run_dir}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("jaxpar: error: File name too long: run.dir '"), line
    assert line.endswith(
        f"({len(str(run_dir)):,} characters; a path component may have at "
        "most 255): choose a shorter run.dir"
    )
    assert len(line) < 300 and "disk" not in line
    deep = tmp_path.joinpath(*["b" * 200] * 19)  # components fit, the checkpoints' paths not
    assert main(["train", f"run.dir={deep}", "train.steps=1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("jaxpar: error: File name too long: run.dir '"), line
    assert len(line) < 300 and "disk" not in line
    assert not deep.parent.parent.exists()


def test_every_report_is_capped_with_the_cause_first(tmp_path, capsys):
    """A report embedding something huge (a value's repr, a path, a library's text) stays
    under 2,000 characters, its start (the cause) kept; an alias bomb given as an override
    is refused at once in a short line."""
    import errno
    import time

    from jaxpar.cli.failures import MAX_MESSAGE, failure_of, internal
    from jaxpar.errors import ConfigError

    status, line = failure_of(
        ConfigError(
            "config key 'train.hooks' expects a list of strings, "
            f"got {['x'] * 200_000!r}\nand a second line"
        )
    )
    assert status == 2 and len(line) <= MAX_MESSAGE == 2000 and "\n" not in line
    assert (
        line.startswith(
            "jaxpar: error: config key 'train.hooks' expects a list of strings, got ['x', 'x'"
        )
        and "…" in line
        and line.endswith("second line")
    )
    long = str(tmp_path / ("c" * 3990))
    status, line = failure_of(OSError(errno.ENAMETOOLONG, "File name too long", long))
    assert status == 2 and line.startswith("jaxpar: error: File name too long: path '")
    assert len(line) < 300 and f"{len(long):,} characters" in line
    status, line = internal(RuntimeError("z" * 10**6), debug=False)
    assert len(line) <= MAX_MESSAGE and line.startswith("jaxpar: internal error: RuntimeError: zz")
    Path(line.split("the traceback is in ")[1].split(" ")[0]).unlink()

    anchors = ", ".join(
        f"&{n} [{', '.join([f'*{p}' if p else 'x'] * 9)}]"
        for p, n in zip(["", *"abcdefgh"], "abcdefghi")
    )
    start = time.perf_counter()
    assert main(["train", f"train.hooks=[{anchors}, *i]", f"run.dir={tmp_path / 'r'}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert time.perf_counter() - start < 1.0 and len(line) < MAX_MESSAGE
    assert "more than 100,000 values with its aliases expanded" in line


def test_the_synopsis_is_the_docs_and_names_every_option():
    """``jaxpar --help``'s synopsis is docs/commands.md's, and it names every option of
    every command (``sample --stop`` and ``plan --analytic`` were left out of it)."""
    import argparse
    import re

    from jaxpar.cli.parser import HELP, _parser

    docs = (Path(__file__).resolve().parent.parent / "docs" / "commands.md").read_text()
    block = docs.split("```\n", 2)[1]
    assert HELP.startswith("".join(f"    {line}\n" for line in block.rstrip("\n").split("\n")))
    synopsis = {}
    for line in block.splitlines():
        if line.startswith("jaxpar "):
            command = line.split()[1]
        synopsis[command] = synopsis.get(command, "") + line + " "
    commands = next(
        a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    assert set(commands) == set(synopsis)
    for command, parser in commands.items():
        unnamed = [
            action.option_strings
            for action in parser._actions
            if action.option_strings
            and action.help != argparse.SUPPRESS
            and "-h" not in action.option_strings
            and not any(
                re.search(rf"{o}(?![\w-])", synopsis[command]) for o in action.option_strings
            )
        ]
        assert not unnamed, (command, unnamed)
