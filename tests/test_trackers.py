"""Experiment trackers (jaxpar/hooks/trackers.py): a tiny run with
``train.trackers=[mlflow, wandb]`` — MLflow on a file store in a temp dir, W&B offline —
reads back from each tracker equal to ``metrics.jsonl``; resuming it (a raised
``train.steps``) continues the same tracker runs; a failed run is marked failed; a
missing library or an unknown tracker name is refused in one line. Trackers fail fast
and quietly: a server refusing connections or one that never answers (a local socket)
stops the run in one line within ``JAXPAR_TRACKER_TIMEOUT``, a SIGTERM meanwhile at
once; a tracker library's logging failures (a full disk) are one warning; a corrupt
``trackers.json`` warns that a new run starts; MLflow without a tracking URI uses a
local store. Nothing reaches the network."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxpar.cli import main
from jaxpar.config import TRACKERS, load_config
from jaxpar.errors import ConfigError
from jaxpar.hooks import TRACKER_HOOKS, Hook, MLflow, WandB, load_hooks, tracker_calls
from jaxpar.loop import train
from tests.helpers import GPT_SMALL, ROOT, child_env, finished, grid, small_file_system

BASE = [
    *GPT_SMALL,
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.progress=false",
    "train.trackers=[mlflow, wandb]",
]


@contextlib.contextmanager
def offline(tmp: Path):
    """MLflow on a file store in ``tmp``; W&B offline, its files in the run dir (jaxpar's
    default) and its settings in ``tmp``; neither library's telemetry. At the end, the W&B
    service process a run started is stopped."""
    pytest.importorskip("mlflow", reason="pip install 'jaxpar[mlflow]'")
    wandb = pytest.importorskip("wandb", reason="pip install 'jaxpar[wandb]'")
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, tmp)
        yield
    wandb.teardown()


def offline_env(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    for name in (
        "WANDB_DIR",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_RUN_ID",
    ):
        mp.delenv(name, raising=False)
    mp.setenv("MLFLOW_TRACKING_URI", f"file:{tmp / 'mlruns'}")
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores otherwise
    mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        mp.setenv(name, str(tmp / "wandb-home"))


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_by_step(rows: list[dict]) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` as a tracker gets it: each row's numbers at its step (an eval
    row's values beside its step's train row; its ``time`` is the file's alone)."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        leave_out = {"step"} if "loss" in row else {"step", "time"}
        out.setdefault(row["step"], {}).update(
            {k: float(v) for k, v in row.items() if k not in leave_out}
        )
    return out


def wandb_records(path: Path) -> list:
    """The records of a W&B ``.wandb`` file: a 7-byte header, then a LevelDB log (32 KiB
    blocks of chunks with a 7-byte header: checksum, length, type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE…/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run of ``run_dir`` (in start order): its id, config, history by
    ``_step`` and exit code."""
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"id": None, "config": {}, "history": {}, "exit_code": None}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
            if kind in ("run", "config"):
                items = (record.run.config if kind == "run" else record.config).update
                run["config"].update({i.key: json.loads(i.value_json) for i in items})
            if kind == "history":
                values = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                run["history"][values["_step"]] = {
                    k: v for k, v in values.items() if not k.startswith("_")
                }
            if kind == "exit":
                run["exit_code"] = record.exit.exit_code
        runs.append(run)
    return runs


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """4 steps with both trackers, then resumed to 6; the trackers' ids after each."""
    tmp = tmp_path_factory.mktemp("trackers")
    run_dir = tmp / "run"
    with offline(tmp):
        train(load_config([], [*BASE, "train.steps=4", f"run.dir={run_dir}"]), echo=False)
        first = json.loads((run_dir / "trackers.json").read_text())
        train(load_config([], [*BASE, "train.steps=6", f"run.dir={run_dir}"]), echo=False)
        second = json.loads((run_dir / "trackers.json").read_text())
    return SimpleNamespace(
        tmp=tmp, run_dir=run_dir, first=first, second=second, rows=rows_of(run_dir)
    )


def mlflow_client(tmp: Path, monkeypatch: pytest.MonkeyPatch):
    """A client of the file store the runs in ``tmp`` logged to."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return mlflow.MlflowClient(f"file:{tmp / 'mlruns'}")


def test_mlflow_gets_every_row_the_config_and_the_run_dir(tracked, monkeypatch):
    client = mlflow_client(tracked.tmp, monkeypatch)
    run_id = tracked.first["mlflow"]["run_id"]
    assert tracked.second["mlflow"]["run_id"] == run_id  # resumed into the same run
    assert [r.info.run_id for r in client.search_runs(["0"])] == [run_id]
    expected = expected_by_step(tracked.rows)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert {s for s, values in expected.items() if "eval_loss" in values} == {2, 4, 6}
    keys = {k for values in expected.values() for k in values}
    assert {"loss", "grad_norm", "lr", "eval_loss", "eval_time_s", "tokens_per_s"} <= keys
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(s, v[key]) for s, v in sorted(expected.items()) if key in v], key
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params, tags = run.data.params, run.data.tags
    assert params["train.steps"] == "4" and params["model.d_model"] == "32"
    assert params["train.trackers"] == "['mlflow', 'wandb']"
    assert tags["train.steps/from_step_5"] == "6"  # what the resumed run changed
    assert tags["jaxpar.run_dir"] == str(tracked.run_dir.absolute())


def test_wandb_offline_gets_every_row_the_config_and_the_run_dir(tracked):
    run_id = tracked.first["wandb"]["id"]
    assert tracked.second["wandb"]["id"] == run_id
    first, resumed = wandb_runs(tracked.run_dir)  # one offline run per process, one id
    assert first["id"] == resumed["id"] == run_id
    assert first["exit_code"] == resumed["exit_code"] == 0
    assert {**first["history"], **resumed["history"]} == expected_by_step(tracked.rows)
    assert sorted(resumed["history"]) == [5, 6]
    assert first["config"]["train.steps"] == 4 and resumed["config"]["train.steps"] == 6
    assert first["config"]["model.d_model"] == 32
    assert first["config"]["run_dir"] == str(tracked.run_dir.absolute())


class Boom(Hook):
    def on_step(self, ctx, step, metrics):
        if step == 2:
            raise RuntimeError("boom")


def test_a_failed_run_is_marked_failed(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with offline(tmp_path), pytest.raises(Exception, match="boom"):
        train(
            load_config([], [*BASE, "train.steps=3", f"run.dir={run_dir}"]),
            hooks=[Boom()],
            echo=False,
        )
    ids = json.loads((run_dir / "trackers.json").read_text())
    client = mlflow_client(tmp_path, monkeypatch)
    assert client.get_run(ids["mlflow"]["run_id"]).info.status == "FAILED"
    [wandb_run] = wandb_runs(run_dir)
    assert wandb_run["id"] == ids["wandb"]["id"] and wandb_run["exit_code"] == 1
    assert sorted(wandb_run["history"]) == [1, 2]  # step 2's row was logged before Boom


# the suite: MLflow's; W&B's is extended (the same `_need` in each tracker's constructor,
# the same one line and exit 2)
@pytest.mark.parametrize(
    "name", grid([pytest.param(n, id=n) for n in ("wandb", "mlflow")], {"mlflow"})
)
def test_a_missing_tracker_library_fails_before_training_in_one_line(
    name, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    assert (
        main(
            [
                "train",
                *GPT_SMALL,
                "train.steps=2",
                f"train.trackers=[{name}]",
                f"run.dir={tmp_path}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"train.trackers=[{name}] needs {name}: pip install 'jaxpar[{name}]'")
    assert "\n" not in err
    assert not (tmp_path / "metrics.jsonl").exists() or not rows_of(tmp_path)


def test_an_unknown_tracker_is_refused_in_one_line():
    assert TRACKERS == tuple(TRACKER_HOOKS)  # the config's names are the hooks'
    with pytest.raises(ConfigError) as err:
        load_config([], ["train.trackers=[wandb, tensorbord]"])
    assert str(err.value) == ("config key 'train.trackers' takes wandb, mlflow, got 'tensorbord'")
    assert load_config([], ["train.trackers=mlflow"]).train.trackers == ("mlflow",)


def test_tracker_hooks_can_be_named_in_train_hooks():
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    hooks = load_hooks(["jaxpar.hooks:MLflow", "jaxpar.hooks.trackers:WandB"])
    assert [type(h) for h in hooks] == [MLflow, WandB]


def test_without_a_run_dir_a_tracker_logs_nothing_and_process_0_is_warned():
    pytest.importorskip("mlflow")
    hook = MLflow()
    ctx = SimpleNamespace(run_dir=None)  # fit() without a run dir, or process > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook.on_start(ctx)
    assert not hook.live and hook.client is None
    assert [str(w.message) for w in caught] == [
        "train.trackers: mlflow has no effect without a run dir: pass run_dir to fit()"
    ]


# ---- failing fast and quietly ------------------------------------------------------------
HANDLE_ERROR = logging.Handler.handleError  # logging's own (when no tracker is live)


def _child(tmp: Path, uri: str, *extra: str, **env: str) -> subprocess.Popen:
    """``jaxpar train`` with MLflow at ``uri`` in a child process."""
    env = {**child_env(1), "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", **env}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            *GPT_SMALL,
            "train.steps=2",
            "train.trackers=[mlflow]",
            f"run.dir={tmp / 'run'}",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _errors(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if not line.startswith("jaxpar: warning")]


@contextlib.contextmanager
def silent_server() -> socket.socket:
    """A local address that accepts connections and never answers (a stalled server)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(90)
    try:
        yield server
    finally:
        server.close()


def test_an_mlflow_server_refusing_connections_stops_the_run_at_once_in_one_line(tmp_path):
    """Port 1 refuses connections: one line and exit 2 at once — not minutes of urllib3
    retries — though the bound is a minute."""
    proc = _child(tmp_path, "http://127.0.0.1:1", JAXPAR_TRACKER_TIMEOUT="60")
    started = time.monotonic()
    _, err = finished(proc, "refused MLflow", timeout=50)
    assert proc.returncode == 2, err[-2000:]
    assert time.monotonic() - started < 45 and "Retrying" not in err and "Traceback" not in err
    assert _errors(err) == [
        "jaxpar: error: train.trackers: MLflow could not start a run (OSError: cannot "
        "connect to 127.0.0.1:1: Connection refused); check that the tracking server at "
        "MLFLOW_TRACKING_URI=http://127.0.0.1:1 is running, or unset it for a local store"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not rows_of(tmp_path / "run")


def test_a_sigterm_while_mlflow_starts_stops_the_run_at_once(tmp_path):
    """The server never answers and the bound is long: a SIGTERM still ends the start-up
    within seconds, in one line, exit 143."""
    with silent_server() as server:
        proc = _child(
            tmp_path, f"http://127.0.0.1:{server.getsockname()[1]}", JAXPAR_TRACKER_TIMEOUT="300"
        )
        try:
            held = [server.accept()[0], server.accept()[0]]  # jaxpar's probe, then MLflow's
        except TimeoutError:
            proc.kill()
            pytest.fail(f"MLflow never connected: {proc.communicate()[1][-2000:]}")
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = finished(proc, "SIGTERM during the tracker's start", timeout=20)
        for conn in held:
            conn.close()
    assert proc.returncode == 143, err[-2000:]
    assert time.monotonic() - signalled < 10
    [line] = _errors(err)
    assert line.startswith("jaxpar: stopped (SIGTERM) before training began"), line


def _ctx(run_dir: Path, first_step: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        run_dir=run_dir, first_step=first_step, config=load_config([], []), error=None
    )


def test_a_stalled_mlflow_server_stops_the_run_after_the_bound(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    with silent_server() as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("JAXPAR_TRACKER_TIMEOUT", "1")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "8")  # ends the test if the bound fails
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        started = time.monotonic()
        with pytest.raises(
            ConfigError,
            match=r"^train.trackers: MLflow could not start a run "
            r"\(no answer within 1 s; JAXPAR_TRACKER_TIMEOUT sets the wait\); "
            r"check that the tracking server at MLFLOW_TRACKING_URI=",
        ):
            MLflow().on_start(_ctx(tmp_path))
        assert 1 <= time.monotonic() - started < 4
    assert not (tmp_path / "trackers.json").exists()
    assert logging.Handler.handleError is HANDLE_ERROR  # logging's own, once it failed


@pytest.mark.parametrize("value", ["soon", "0"])
def test_a_bad_tracker_timeout_is_one_line(value, monkeypatch):
    monkeypatch.setenv("JAXPAR_TRACKER_TIMEOUT", value)
    with pytest.raises(ConfigError) as err:
        tracker_calls.timeout()
    assert str(err.value) == (
        f"JAXPAR_TRACKER_TIMEOUT='{value}': give the seconds a tracker "
        "may take to answer, a number > 0 (default 30)"
    )


class FullDisk:
    """A stream on a full disk."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass


def test_a_tracker_librarys_logging_failures_are_one_warning(tmp_path, monkeypatch, capsys):
    """Every record the library logs fails (a full disk): one warning of the tracker's,
    none of logging's tracebacks; after the run, logging's own handling is back."""
    pytest.importorskip("mlflow")
    offline_env(monkeypatch, tmp_path)
    (tmp_path / "run").mkdir()
    logger, handler = logging.getLogger("mlflow.jaxpar_test"), logging.StreamHandler(FullDisk())
    logger.addHandler(handler)
    try:
        hook = MLflow()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hook.on_start(_ctx(tmp_path / "run"))
            for _ in range(50):
                logger.warning("a record")
            hook.on_end(_ctx(tmp_path / "run"))
        assert [str(w.message) for w in caught] == [
            "train.trackers: MLflow could not write its log (OSError: [Errno 28] No space "
            "left on device); training goes on (this warning is shown once)"
        ]
        assert "Logging error" not in capsys.readouterr().err
        logger.warning("after the run")
        assert "--- Logging error ---" in capsys.readouterr().err
        assert logging.Handler.handleError is HANDLE_ERROR
    finally:
        logger.removeHandler(handler)


# extended: a second end-to-end scenario of a tracker library's logging failing on a full
# disk; the handling (its handler's failure sent to the tracker's one warning,
# jaxpar/hooks/tracker_calls.py's watch_logging) runs in every suite in
# test_a_tracker_librarys_logging_failures_are_one_warning
@pytest.mark.exhaustive
def test_a_full_wandb_directory_is_one_warning_and_training_goes_on(tmp_path, capsys):
    with small_file_system(tmp_path / "full", "64k") as full, offline(tmp_path):
        with contextlib.suppress(OSError):
            (full / "fill").write_bytes(b"0" * 200_000)
        os.environ["WANDB_DIR"] = str(full)  # offline() restores the environment
        run_dir = tmp_path / "run"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(
                load_config(
                    [], [*BASE, "train.trackers=[wandb]", "train.steps=3", f"run.dir={run_dir}"]
                ),
                echo=False,
            )
    assert [row["step"] for row in rows_of(run_dir) if "loss" in row] == [1, 2, 3]
    ours = [str(w.message) for w in caught if "train.trackers" in str(w.message)]
    assert ours == [
        "train.trackers: Weights & Biases could not write its log (OSError: "
        "[Errno 28] No space left on device); training goes on (this warning is "
        "shown once)"
    ]
    assert "Logging error" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            "{not json",
            "JSONDecodeError: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        ('{"mlflow": "abc"}', "its 'mlflow' entry is not a JSON object"),
    ],
)
def test_a_corrupt_trackers_json_warns_that_a_new_run_starts(
    content, problem, tmp_path, monkeypatch
):
    """A resumed run: each tracker warns and starts a new run (W&B, which starts first
    and rewrites the file, too for an entry of MLflow's), and training would go on."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "trackers.json").write_text(content)
    with offline(tmp_path):
        hooks = [WandB(), MLflow()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for hook in hooks:
                hook.on_start(_ctx(run_dir, first_step=5))
            for hook in hooks:
                hook.on_end(_ctx(run_dir))
    path = run_dir.absolute() / "trackers.json"
    expected = [
        f"train.trackers: {path} is unreadable ({problem}); a new {label} run starts "
        "(the file is rewritten)"
        for label in ("Weights & Biases", "MLflow")
    ]
    assert [str(w.message) for w in caught] == expected[content.startswith('{"') :]
    saved = json.loads(path.read_text())
    assert saved["mlflow"]["run_id"] == hooks[1].run_id
    assert saved["wandb"]["id"] == hooks[0].run.id
    assert mlflow_client(tmp_path, monkeypatch).get_run(hooks[1].run_id).info.status == "FINISHED"


def test_mlflow_without_a_tracking_uri_uses_a_local_store(tmp_path, monkeypatch, capsys):
    """mlflow-skinny cannot open MLflow's default store (SQLite, needs SQLAlchemy): the
    run logs to ./mlruns instead of failing."""
    pytest.importorskip("mlflow")
    if importlib.util.find_spec("sqlalchemy"):
        pytest.skip("the full mlflow is installed: MLflow's default store stands")
    offline_env(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "train",
                *GPT_SMALL,
                "train.steps=2",
                "train.progress=false",
                "train.trackers=[mlflow]",
                f"run.dir={tmp_path / 'run'}",
            ]
        )
        == 0
    ), capsys.readouterr().err
    saved = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]
    assert saved["tracking_uri"] == (tmp_path / "mlruns").as_uri()
    client = mlflow_client(tmp_path, monkeypatch)
    assert [m.step for m in client.get_metric_history(saved["run_id"], "loss")] == [1, 2]
