"""Experiment trackers as loop hooks: Weights & Biases (:class:`WandB`) and MLflow
(:class:`MLflow`), switched on by ``train.trackers=[wandb, mlflow]`` or named in
``train.hooks`` (``jaxpar.hooks:WandB``, ``jaxpar.hooks:MLflow``).

A tracker gets the config (flat ``section.key`` entries), every row ``metrics.jsonl``
logs (at its step), the eval metrics and the run dir; only the process that writes the
run dir (process 0) logs. The tracker's run id is kept in ``<run_dir>/trackers.json``,
so a resumed run (same run dir) continues the same tracker run. The libraries are
optional extras (``pip install 'jaxpar[wandb]'`` / ``'jaxpar[mlflow]'``), and where a
tracker sends data is the library's own setting: ``WANDB_PROJECT`` (default ``jaxpar``),
``WANDB_ENTITY``, ``WANDB_MODE=offline``, ``WANDB_DIR`` (default: the run dir);
``MLFLOW_TRACKING_URI`` (unset, without the full ``mlflow``: a local store in
``./mlruns``), ``MLFLOW_EXPERIMENT_NAME``.

A tracker fails fast and quietly: each call to its library (start, log, finish) gets
``JAXPAR_TRACKER_TIMEOUT`` seconds (default 30; a server that refuses connections fails
at once). One that cannot start in that time stops the run before it trains, in one
line; one that fails or stalls later warns once and training goes on (without it, once
it stalls). Errors of the library's own logging (a full disk under W&B's directory)
become that one warning, and a stop signal while a tracker starts stops the run at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax

from jaxpar import config as config_lib
from jaxpar import resume as resume_lib
from jaxpar.errors import ConfigError, Preempted, Terminated
from jaxpar.files import shorten
from jaxpar.hooks.base import Context, Hook
from jaxpar.hooks.tracker_calls import (
    TIMEOUT,
    Stalled,
    bounded,
    probe,
    stop_requested,
    timeout,
    watch_logging,
)

#: where a run dir keeps its trackers' run ids: ``{"wandb": {"id": …}, "mlflow": {…}}``
TRACKERS_FILE = "trackers.json"
#: run dir → why its trackers.json was unreadable, while its trackers start: each starts a
#: new run, also those that start after the first has rewritten the file
_UNREADABLE: dict[Path, str] = {}


def _need(module: str, extra: str) -> Any:
    """The tracker library ``module``, or a one-line error naming its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"train.trackers=[{extra}] needs {module}: pip install 'jaxpar[{extra}]'"
        ) from err


def _one_line(err: BaseException, limit: int = 300) -> str:
    return shorten(" ".join(f"{type(err).__name__}: {err}".split()), limit)


def flat_config(config: Any) -> dict[str, Any]:
    """``{'section.key': value}`` for every setting of a run config."""
    return {
        f"{section}.{key}": value
        for section, keys in config_lib.to_dict(config).items()
        for key, value in keys.items()
    }


def read_ids(run_dir: Path) -> tuple[dict[str, Any], str]:
    """The tracker run ids a run dir keeps (``{}`` when none), and why the file could not
    be read (``""`` when it could, or is absent)."""
    path = Path(run_dir) / TRACKERS_FILE
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, ""
    except (OSError, ValueError) as err:
        return {}, _one_line(err, 120)
    if not isinstance(ids, dict):
        return {}, "not a JSON object"
    return ids, ""


def _write_ids(run_dir: Path, ids: dict[str, Any]) -> None:
    path = Path(run_dir) / TRACKERS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    tmp.replace(path)  # a crash leaves the old file or the new, never half of one


def outcome(error: BaseException | None) -> str:
    """How the training run ended: ``finished``, ``killed`` (preempted, interrupted) or
    ``failed``."""
    if error is None:
        return "finished"
    return "killed" if isinstance(error, (Preempted, KeyboardInterrupt)) else "failed"


class Tracker(Hook):
    """A tracker's run that follows the training run: started (or, in a resumed run dir,
    continued) before the first step, given every logged row and evaluation, finished
    after the last step (marked failed or killed when the loop stopped early). Each call
    is bounded by :func:`timeout`. A failure to log warns once and training goes on (a
    stalled call: without the tracker); a failure to start stops the run before it
    trains. Subclasses implement :meth:`start`, :meth:`log` and :meth:`finish`."""

    name = label = fix = ""  # fix: what to do when the tracker cannot start
    #: the loggers the library logs to (their handlers' failures: one warning)
    loggers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.live = self._warned = False
        self.timeout = TIMEOUT

    def start(
        self, run_dir: Path, params: dict[str, Any], saved: dict[str, Any] | None, first_step: int
    ) -> dict[str, Any]:
        """Starts the tracker's run (continues ``saved``'s, when given, from ``first_step``)
        and logs ``params``; returns what continues it (kept in ``trackers.json``)."""
        raise NotImplementedError

    def log(self, step: int, values: dict[str, float]) -> None:
        """Logs ``values`` at ``step``."""
        raise NotImplementedError

    def finish(self, how: str) -> None:
        """Ends the tracker's run: ``how`` is :func:`outcome`'s."""
        raise NotImplementedError

    def on_start(self, ctx: Context) -> None:
        if ctx.run_dir is None:  # another process than 0, or fit() without a run dir
            if jax.process_index() == 0:
                warnings.warn(
                    f"train.trackers: {self.name} has no effect without a run dir: "
                    "pass run_dir to fit()",
                    stacklevel=2,
                )
            return
        run_dir = Path(ctx.run_dir).absolute()
        self.timeout = timeout()
        saved = self._saved(run_dir, ctx.first_step)
        watch_logging(self.loggers, self._log_failed, True)
        try:
            ids = self._start(run_dir, flat_config(ctx.config), saved, ctx.first_step)
        except BaseException:
            watch_logging(self.loggers, self._log_failed, False)
            raise
        _write_ids(run_dir, {**read_ids(run_dir)[0], self.name: ids})
        self.live = True

    def _start(
        self, run_dir: Path, params: dict[str, Any], saved: dict[str, Any] | None, first_step: int
    ) -> dict[str, Any]:
        """:meth:`start`, bounded; a stop signal meanwhile stops the run at once."""
        try:
            return bounded(
                lambda: self.start(run_dir, params, saved, first_step), self.timeout, stoppable=True
            )
        except Stalled as err:
            if stop_requested():
                raise (
                    KeyboardInterrupt() if resume_lib.stop_signal() == "SIGINT" else Terminated()
                ) from None
            raise ConfigError(
                f"train.trackers: {self.label} could not start a run ({err}); {self.fix}"
            ) from None
        except Exception as err:
            raise ConfigError(
                f"train.trackers: {self.label} could not start a run ({_one_line(err)}); {self.fix}"
            ) from err

    def _saved(self, run_dir: Path, first_step: int) -> dict[str, Any] | None:
        """What continues this tracker's run in a resumed run dir (None: a new run; a
        warning when ``trackers.json`` is unreadable)."""
        if first_step == 1:
            return None  # a new training run: a new tracker run
        ids, problem = read_ids(run_dir)
        if problem or run_dir in _UNREADABLE:  # (rewritten by a tracker that started first)
            ids = {}
            problem = _UNREADABLE.setdefault(run_dir, problem)
        saved = ids.get(self.name)
        if saved is not None and not isinstance(saved, dict):
            problem = f"its {self.name!r} entry is not a JSON object"
            saved = None
        if problem:
            warnings.warn(
                f"train.trackers: {run_dir / TRACKERS_FILE} is unreadable "
                f"({problem}); a new {self.label} run starts (the file is "
                "rewritten)",
                stacklevel=3,
            )
        return saved

    def on_step(self, ctx: Context, step: int, metrics: dict[str, Any]) -> None:
        row = ctx.rows[-1] if ctx.rows else {}
        if self.live and row.get("step") == step and "loss" in row:  # a logged train row
            self._send(step, row)

    def on_eval(self, ctx: Context, step: int, metrics: dict[str, float]) -> None:
        if self.live:
            self._send(step, metrics)

    def on_end(self, ctx: Context) -> None:
        try:
            if self.live:
                self.live = False
                bounded(lambda: self.finish(outcome(ctx.error)), self.timeout)
        except Exception as err:
            self._warn("finish its run", err)
        finally:
            watch_logging(self.loggers, self._log_failed, False)
            _UNREADABLE.pop(Path(ctx.run_dir or ".").absolute(), None)

    def _send(self, step: int, row: dict[str, Any]) -> None:
        values = {
            k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
        }
        try:
            bounded(lambda: self.log(step, values), self.timeout)
        except Stalled as err:  # the library is stuck: training goes on without it
            self.live = False
            self._warn(f"log step {step}", err, "training goes on without it")
        except Exception as err:  # a tracker's outage must not end a long run
            self._warn(f"log step {step}", err)

    def _log_failed(self, err: BaseException | None) -> None:
        self._warn("write its log", err)

    def _warn(self, what: str, err: BaseException | None, then: str = "training goes on") -> None:
        if not self._warned:
            self._warned = True
            why = _one_line(err) if err is not None else "no reason given"
            warnings.warn(
                f"train.trackers: {self.label} could not {what} ({why}); {then} "
                "(this warning is shown once)",
                stacklevel=3,
            )


class WandB(Tracker):
    """Weights & Biases: a W&B run named after the run dir, with the config (and
    ``run_dir``) as its config and each row logged at its step. A resumed run continues
    the W&B run (``resume="allow"``); steps it logged past the checkpoint before a crash
    are not logged again (W&B keeps steps increasing; a resumed run's metrics are the
    same numbers)."""

    name = "wandb"
    label = "Weights & Biases"
    fix = "run `wandb login`, or set WANDB_MODE=offline"
    loggers = ("wandb",)

    def __init__(self) -> None:
        super().__init__()
        self.wandb = _need("wandb", "wandb")
        self.run: Any = None

    def start(
        self, run_dir: Path, params: dict[str, Any], saved: dict[str, Any] | None, first_step: int
    ) -> dict[str, Any]:
        run_id = (saved or {}).get("id")
        # W&B's own wait for its server (90 s), unless set: the tracker's bound
        settings = (
            None
            if os.environ.get("WANDB_INIT_TIMEOUT")
            else self.wandb.Settings(init_timeout=self.timeout)
        )
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "jaxpar",
            name=run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            settings=settings,
        )
        self.run.config.update({**params, "run_dir": str(run_dir)}, allow_val_change=True)
        return {"id": self.run.id, "project": self.run.project}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, how: str) -> None:
        if how == "killed":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if how == "finished" else 1)


class MLflow(Tracker):
    """MLflow: a run named after the run dir in ``MLFLOW_EXPERIMENT_NAME`` (or
    ``MLFLOW_EXPERIMENT_ID``; default: MLflow's Default experiment), the config as params,
    the run dir as the tag ``jaxpar.run_dir``, each row's values as metrics at its step.
    A resumed run continues the MLflow run; as params cannot change, a setting the resumed
    run changed is set as the tag ``KEY/from_step_N``.

    Where no tracking URI is set (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``) and
    MLflow's default store (``sqlite:///mlflow.db``) needs what mlflow-skinny lacks
    (SQLAlchemy), the store is the folder ``mlruns`` in the working directory (a resumed
    run: the one it started in), and ``MLFLOW_ALLOW_FILE_STORE`` is set to ``true``."""

    name = "mlflow"
    label = "MLflow"
    loggers = ("mlflow",)
    #: MLflow's longest param value
    MAX_VALUE = 6000

    def __init__(self) -> None:
        super().__init__()
        self.mlflow = _need("mlflow", "mlflow")
        self.client: Any = None
        self.run_id = self.uri = ""

    @property
    def fix(self) -> str:  # type: ignore[override]
        if self.uri.startswith(("http:", "https:")):
            return (
                f"check that the tracking server at MLFLOW_TRACKING_URI={self.uri} is "
                "running, or unset it for a local store"
            )
        return (
            "set MLFLOW_TRACKING_URI to your tracking server (http://HOST:PORT) or to a "
            "store you can write (file:PATH, with MLFLOW_ALLOW_FILE_STORE=true)"
        )

    def tracking_uri(self, saved: dict[str, Any] | None) -> str:
        """MLflow's tracking URI, or the local ``mlruns`` store (see the class)."""
        uri = self.mlflow.get_tracking_uri()
        try:
            utils = importlib.import_module("mlflow.tracking._tracking_service.utils")
            chosen = bool(utils.is_tracking_uri_set())
        except (ImportError, AttributeError):  # another MLflow: its default stands
            chosen = True
        if chosen or not uri.startswith("sqlite:") or importlib.util.find_spec("sqlalchemy"):
            return uri
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        old = str((saved or {}).get("tracking_uri", ""))
        return old if old.startswith("file:") else Path("mlruns").absolute().as_uri()

    def start(
        self, run_dir: Path, params: dict[str, Any], saved: dict[str, Any] | None, first_step: int
    ) -> dict[str, Any]:
        self.uri = uri = self.tracking_uri(saved)
        probe(uri, self.timeout)
        self.client = self.mlflow.MlflowClient(tracking_uri=uri)
        old = self._params_of((saved or {}).get("run_id", ""), uri)
        if old is None:
            run = self.client.create_run(self._experiment_id(), run_name=run_dir.name)
            self.run_id = run.info.run_id
            old = {}
        else:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        text = {k: str(v)[: self.MAX_VALUE] for k, v in params.items()}
        tags = {
            f"{k}/from_step_{first_step}": v for k, v in text.items() if k in old and old[k] != v
        }  # tags, as a logged param cannot change
        tags["jaxpar.run_dir"] = str(run_dir)
        entities = self.mlflow.entities
        self.client.log_batch(
            self.run_id,
            params=[entities.Param(k, v) for k, v in text.items() if k not in old],
            tags=[entities.RunTag(k, v) for k, v in tags.items()],
        )
        return {"run_id": self.run_id, "tracking_uri": uri}

    def _params_of(self, run_id: str, uri: str) -> dict[str, str] | None:
        """The params of the saved run ``run_id``; None when there is none to continue."""
        if not run_id:
            return None
        try:
            return dict(self.client.get_run(run_id).data.params)
        except self.mlflow.exceptions.MlflowException as err:
            warnings.warn(
                f"train.trackers: the MLflow run {run_id} of trackers.json is not in "
                f"{uri} ({_one_line(err, 150)}); starting a new run",
                stacklevel=2,
            )
            return None

    def _experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        Metric = self.mlflow.entities.Metric
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()]
        )

    def finish(self, how: str) -> None:
        status = {"finished": "FINISHED", "killed": "KILLED", "failed": "FAILED"}[how]
        self.client.set_terminated(self.run_id, status=status)


#: ``train.trackers`` names and their hooks
TRACKER_HOOKS: dict[str, type[Tracker]] = {"wandb": WandB, "mlflow": MLflow}
