"""End to end: the `jaxpar` command, the run directory, the BYO-model example."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _clean_env():
    """Environment of a fresh shell: no device count forced by the test setup."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow
def test_default_train_writes_metrics_and_loss_falls(tmp_path):
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", f"run.dir={tmp_path}",
           "train.steps=40", "train.log_every=5", "train.eval_every=20", "train.tensorboard=true"]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "8 simulated CPU devices" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, *range(5, 41, 5)]
    for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "examples_per_s"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # from ~ln(256) = 5.5
    assert "eval_loss" in rows[4] and "eval_loss" in rows[8] and "eval_loss" not in rows[1]
    assert (tmp_path / "config.yaml").read_text().startswith("run:")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "final loss" in out.stdout and "state per device" in out.stdout


def test_devices_flag_sets_simulated_device_count(tmp_path):
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--devices", "4", f"run.dir={tmp_path}",
           "train.steps=1", "optim.warmup_steps=0", "model.n_layers=1", "model.d_model=32", "data.seq_len=16",
           "train.batch_size=4", "train.eval_every=0"]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=600)
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


def test_byo_example_trains_under_two_layouts():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import custom_model
    finally:
        sys.path.pop(0)
    from jaxpar.config import MeshConfig

    tp = custom_model.main(steps=30, mesh_cfg=MeshConfig(data=4, tensor=2))
    fsdp = custom_model.main(steps=30, mesh_cfg=MeshConfig(data=1, fsdp=8))
    one = custom_model.main(steps=30, mesh_cfg=MeshConfig(data=1), devices=1)
    assert tp[-1] < 0.5 * tp[0]
    np.testing.assert_allclose(tp, one, rtol=1e-5)
    np.testing.assert_allclose(fsdp, one, rtol=1e-5)


def test_unannotated_parameter_without_path_rule_is_an_error():
    from flax import nnx

    import jaxpar
    from jaxpar.task import Task

    task = Task(lambda rngs: nnx.Linear(4, 4, rngs=rngs), lambda m, b: (0.0, {}), {})
    with pytest.raises(ValueError, match="parameter '(kernel|bias)' .*has no logical axes"):
        jaxpar.abstract_params_and_axes(task)


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
    assert main(["train", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                 "model.d_ff=64", "model.max_seq_len=32", "data.seq_len=32",
                 "train.batch_size=16", "train.steps=30", "train.log_every=10",
                 "train.eval_every=30", "train.progress=false", "optim.warmup_steps=5",
                 f"data.path={tokens}", f"run.dir={run_dir}"]) == 0
    assert f"data {tokens}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0 and "eval_loss" in rows[-1]
