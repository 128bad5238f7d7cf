"""``train.profile_steps``: a JAX profiler trace of a range of steps in ``<run.dir>/profile``."""

from __future__ import annotations

import gzip
import json
import warnings

import jax
import pytest

from jaxpar.config import load_config, parse_profile_steps
from jaxpar.loop import build, fit, train
from tests.helpers import GPT_SMALL

FAST = [
    *GPT_SMALL,
    "train.steps=4",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.resume=never",
    "checkpoint.async_save=false",
]


def _train(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    train(load_config([], [*FAST, f"run.dir={run_dir}", *overrides]), echo=False)
    return run_dir


def _step_events(perfetto_file):
    """The trace events of the loop's ``StepTraceAnnotation("train", step_num=…)``."""
    with gzip.open(perfetto_file) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("name") == "train" and "step_num" in e.get("args", {})]


def test_profile_steps_traces_exactly_those_steps(tmp_path):
    profile = _train(tmp_path, "train.profile_steps=2:4") / "profile"
    assert profile.is_dir()
    assert len(list(profile.rglob("*.xplane.pb"))) == 1
    (perfetto,) = profile.rglob("perfetto_trace.json.gz")
    events = _step_events(perfetto)
    # complete ("X") events with the step number as a string argument
    assert {e["ph"] for e in events} == {"X"}
    assert sorted(int(e["args"]["step_num"]) for e in events) == [2, 3]


def test_no_profile_dir_without_the_option(tmp_path):
    run_dir = _train(tmp_path)
    assert (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "profile").exists()


def test_stop_past_the_last_step_traces_to_the_end_and_warns(tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"train.profile_steps='3:9' reaches past the last "
        r"step \(train.steps=4\): steps 3 to 4 are traced",
    ):
        profile = _train(tmp_path, "train.profile_steps=3:9") / "profile"
    (perfetto,) = profile.rglob("perfetto_trace.json.gz")
    assert sorted(int(e["args"]["step_num"]) for e in _step_events(perfetto)) == [3, 4]


def test_profile_steps_parse():
    assert parse_profile_steps("") is None
    assert parse_profile_steps("5:8") == (5, 8)
    assert parse_profile_steps(" 1 : 2 ") == (1, 2)
    assert load_config([], ["train.profile_steps=5:8"]).train.profile_steps == "5:8"


@pytest.mark.parametrize(
    "value, message",
    [
        ("5", "must look like START:STOP"),
        ("5-8", "must look like START:STOP"),
        ("a:b", "must look like START:STOP"),
        ("1:2:3", "must look like START:STOP"),
        ("0:3", "starts at step 0, but the first step is 1"),
        ("-2:3", "starts at step -2, but the first step is 1"),
        ("4:4", r"traces no step \(STOP 4 ≤ START 4\)"),
        ("5:3", r"traces no step \(STOP 3 ≤ START 5\)"),
    ],
)
def test_bad_profile_steps_name_the_key_and_the_fix(value, message):
    with pytest.raises(
        ValueError, match=f"train.profile_steps.*{message}.*set train.profile_steps=START:STOP"
    ):
        load_config([], [f"train.profile_steps={value}"])


def test_unquoted_yaml_value_says_to_quote_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  profile_steps: 5:8\n")  # YAML 1.1: base-60 308
    with pytest.raises(
        ValueError,
        match=r"'train.profile_steps' expects str, got 308 .*"
        r"quote it in YAML: profile_steps: \"...\"",
    ):
        load_config([path])
    path.write_text('train:\n  profile_steps: "5:8"\n')
    assert load_config([path]).train.profile_steps == "5:8"


def test_start_after_the_last_step_warns_and_traces_nothing(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_dir = _train(tmp_path, "train.profile_steps=7:9")
    assert any("has no effect: it starts after the last step" in str(w.message) for w in caught)
    assert not (run_dir / "profile").exists()


def test_a_run_that_raises_while_tracing_still_writes_the_trace(tmp_path):
    run = build(load_config([], [*FAST, "train.profile_steps=2:4"]))
    step = run.trainer.step

    def failing_step(state, batch):
        if int(state.step) == 2:  # dispatching step 3
            raise RuntimeError("boom")
        return step(state, batch)

    run.trainer.step = failing_step
    with pytest.raises(RuntimeError, match="boom"):
        fit(run, tmp_path)
    (perfetto,) = (tmp_path / "profile").rglob("perfetto_trace.json.gz")
    assert sorted(int(e["args"]["step_num"]) for e in _step_events(perfetto)) == [2, 3]
    # the trace was stopped: a new one can start
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()
