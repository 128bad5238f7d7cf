"""One run per directory, nothing overwritten: the run-dir lock, path checks, the name a
layout's run dir gets, and what a (re)started run does with the files a run dir already
holds.

* **Lock** (:mod:`jaxpar.lock`). A run holds ``.jaxpar.lock`` in its run dir and in its
  checkpoint dir from before it reads a checkpoint until it exits. A second run in
  either directory — or in a folder the run writes inside them — is refused, naming the
  holder; an unrelated run in another folder below a run dir is not. The kernel drops
  the lock when the holder dies, so a lock left by a crashed run is taken over.
* **Naming.** A config whose layout (``mesh``, ``rules``, ``pipeline``, ``context``)
  differs from its first file's gets a run dir of its own unless it names one:
  ``runs/gpt_tiny-fsdp8`` (:func:`layout_dir`); a user's task, ``runs/<task>``
  (:func:`task_dir`). ``jaxpar.config.load_config`` applies them.
* **metrics.jsonl.** A resumed run keeps the rows up to its checkpoint's step and
  appends; rows logged after that step (the run went on past its last checkpoint) are
  moved to ``metrics.discarded.jsonl``, not deleted. A truncated last line (a crash
  mid-write) is dropped with a warning. A fresh start where rows exist keeps them as
  ``metrics.old-N.jsonl`` (with the ``config.yaml`` beside them as
  ``config.old-N.yaml``).
* **config.yaml** is written only once the resume decision is accepted. A run resumed
  with settings that differ from its checkpoint's keeps ``config.yaml`` and writes the
  new settings to ``config.K.yaml`` (K: the step it resumed from), printing the
  differences.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxpar.errors import PathError
from jaxpar.files import ensure_dir  # noqa: F401 (jaxpar.loop's)
from jaxpar.lock import LOCK, RunDirBusy, RunDirLock  # noqa: F401 (re-exported)

METRICS = "metrics.jsonl"
DISCARDED = "metrics.discarded.jsonl"


# ---- the lock (jaxpar.lock) ----------------------------------------------------------------
@contextlib.contextmanager
def locked(directories: list[tuple[Path, str]]) -> Iterator[list[RunDirLock]]:
    """Holds the locks of several directories (the run dir and the checkpoint dir) — on
    process 0 only; the other processes of a run share its directories."""
    import jax

    locks: list[RunDirLock] = []
    try:
        error: Exception | None = None
        if jax.process_index() == 0:
            try:
                for directory, what in directories:
                    locks.append(RunDirLock(directory, what).acquire())
            except (ValueError, OSError) as err:
                error = err
        if jax.process_count() > 1:  # every process stops, not just the one that knows
            import numpy as np
            from jax.experimental import multihost_utils

            ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
            if not ok and error is None:
                raise PathError("process 0 could not take the run directory (its message says why)")
        if error is not None:
            raise error
        yield locks
    finally:
        for lock in reversed(locks):
            lock.release()


# ---- naming ----------------------------------------------------------------------------------
#: The config sections that make a layout. A layout other than the first config file's gets
#: a run dir of its own, named after what changed it (``runs/gpt_tiny-fsdp8``), so layouts
#: tried one after another never resume each other's run.
LAYOUT_SECTIONS = ("mesh", "rules", "pipeline", "context", "tensor")  # not a mesh axis: sections
#: short names of layout overrides in a run directory's name (others: key and value)
_SHORT = {
    "pipeline.schedule": "",
    "pipeline.microbatches": "m",
    "pipeline.virtual_stages": "v",
    "rules.preset": "",
    "tensor.sequence": "sp",
}


def layout_of(config: Any) -> tuple:
    """A config's layout sections (:data:`LAYOUT_SECTIONS`), to compare two layouts."""
    return tuple(getattr(config, section) for section in LAYOUT_SECTIONS)


def layout_override_names(overrides: list[str]) -> list[str]:
    """The run-dir name of each override among ``overrides`` that sets a layout key to a
    value (:func:`override_name`)."""
    return [
        override_name(text)
        for text in overrides
        if text.split("=")[0].split(".")[0] in LAYOUT_SECTIONS and text.partition("=")[2]
    ]


def override_name(text: str) -> str:
    """``mesh.fsdp=8`` → ``fsdp8``, ``pipeline.schedule=zb_h1`` → ``zb_h1``,
    ``pipeline.microbatches=8`` → ``m8``, ``rules.mlp=tensor`` → ``mlptensor``."""
    key, _, value = text.partition("=")
    short = _SHORT.get(key.strip(), key.strip().split(".", 1)[1])
    return re.sub(r"[^A-Za-z0-9_.]+", "", f"{short}{value.strip()}".replace("-1", "auto"))


def layout_dir(run_dir: str, names: list[str]) -> str:
    """The run dir of a layout: ``run_dir`` followed by the ``names`` of what changed it
    (``runs/gpt_tiny-data4-tensor2``)."""
    return "-".join([run_dir, *names])


def task_dir(run_dir: str, default: str, name: str) -> str:
    """The run dir of a user's task named ``name``: ``runs/<name>`` in place of the
    ``default`` run dir, keeping a layout's suffix (``runs/<name>-fsdp8``); ``run_dir``
    itself when it was chosen (or ``name`` is empty)."""
    if not name or not (run_dir == default or run_dir.startswith(default + "-")):
        return run_dir
    return f"runs/{name}" + run_dir[len(default) :]


# ---- metrics.jsonl ---------------------------------------------------------------------------
def read_rows(path: Path, repair: bool = True) -> list[tuple[int, str]]:
    """``(step, line)`` of each row of a metrics file. A last line that is not JSON (the
    writer died mid-line) is dropped with a warning.

    Raises:
      PathError: for a line before the last that is not a JSON row with a ``step``.
    """
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1 and repair:
                shown = line if len(line) <= 60 else line[:57] + "..."
                warnings.warn(
                    f"{path}: the last line is cut short ({shown!r}, the run that "
                    "wrote it stopped mid-line); it is dropped",
                    stacklevel=2,
                )
                break
            raise PathError(
                f"{path}, line {n}: not a metrics row ({line[:60]!r}); fix or "
                "delete that line, or move the file away"
            ) from None
        rows.append((step, line))
    return rows


def _set_aside_old_run(run_dir: Path) -> str | None:
    """Renames the metrics and config of a run that left no checkpoint to
    ``metrics.old-N.jsonl`` / ``config.old-N.yaml``; returns a note, or None."""
    metrics, config = run_dir / METRICS, run_dir / "config.yaml"
    has_metrics = metrics.exists() and metrics.stat().st_size > 0
    if not has_metrics and not config.exists():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a cut-short line is kept with the rest here
            rows = read_rows(metrics) if has_metrics else []
    except ValueError:  # a damaged file is kept as it is
        rows = []
    n = 1
    while (run_dir / f"metrics.old-{n}.jsonl").exists() or (
        run_dir / f"config.old-{n}.yaml"
    ).exists():
        n += 1
    kept = []
    for path, name in ((metrics, f"metrics.old-{n}.jsonl"), (config, f"config.old-{n}.yaml")):
        if path.exists() and (path is config or has_metrics):
            os.replace(path, run_dir / name)
            kept.append(name)
    steps = [s for s, _ in rows]
    what = (
        f"the metrics of an earlier run (steps {min(steps)}–{max(steps)})"
        if steps
        else "the files of an earlier run"
    )
    return (
        f"{run_dir} held {what} but no checkpoint to continue it: starting from step 1; "
        f"the earlier files are kept as {' and '.join(kept)}"
    )


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def keep_rows_until(run_dir: Path, start_step: int) -> str | None:
    """A resumed run's ``metrics.jsonl``: rows of steps ≤ ``start_step`` stay, later ones
    move to ``metrics.discarded.jsonl``. Returns a note when rows moved."""
    metrics = run_dir / METRICS
    if not metrics.exists():
        return None
    rows = read_rows(metrics)
    kept = [line for step, line in rows if step <= start_step]
    later = [(step, line) for step, line in rows if step > start_step]
    text = "".join(line + "\n" for line in kept)
    if later:
        with open(run_dir / DISCARDED, "a") as f:
            f.write("".join(line + "\n" for _, line in later))
    if later or metrics.read_bytes() != text.encode():
        _atomic_write(metrics, text)
    if not later:
        return None
    steps = [s for s, _ in later]
    return (
        f"metrics.jsonl held rows of steps {min(steps)}–{max(steps)}, logged after the "
        f"checkpoint of step {start_step} that this run continues from; they are "
        f"re-logged as the steps run again (the old rows are kept in {DISCARDED})"
    )


# ---- config.yaml -----------------------------------------------------------------------------
def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


#: where the run lives, not how it trains: a moved run dir is not a changed config
_NOT_COMPARED = {"run.dir"}


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old → new`` for every setting that differs (``run.dir`` aside)."""
    a, b = _flat(old), _flat(new)
    return [
        f"{k}: {_shown(a.get(k, '(unset)'))} → {_shown(b.get(k, '(unset)'))}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and k not in _NOT_COMPARED
    ]


def _shown(value: Any) -> Any:
    """A setting as written: a whole float as its integer (``optim.warmup_steps: 20 → 0``)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def write_config(
    run_dir: Path, config: dict[str, Any], start_step: int, saved: dict[str, Any] | None
) -> str | None:
    """Writes ``config.yaml`` (a fresh start, or a run dir that has none), or, for a
    resumed run whose settings differ from those its checkpoint was saved with,
    ``config.<start_step>.yaml``; returns a note listing the differences, or None."""
    import yaml

    text = yaml.safe_dump(config, sort_keys=False)
    main = run_dir / "config.yaml"
    if not start_step or not main.exists():
        _atomic_write(main, text)
        return None
    before = saved if saved is not None else (yaml.safe_load(main.read_text()) or {})
    changes = config_differences(before, config)
    if not changes:
        return None
    name = f"config.{start_step}.yaml"
    _atomic_write(run_dir / name, text)
    shown = "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else "")
    return (
        f"the settings differ from those the checkpoint of step {start_step} was saved "
        f"with: {shown} (kept as {name}; config.yaml is unchanged)"
    )


def prepare(
    run_dir: Path,
    config: dict[str, Any],
    start_step: int,
    saved_config: dict[str, Any] | None = None,
) -> list[str]:
    """Readies an (already locked) run dir once the resume decision stands; returns the
    notes to print. See the module docstring for what happens to existing files."""
    notes = []
    if start_step:
        notes.append(keep_rows_until(run_dir, start_step))
    else:
        notes.append(_set_aside_old_run(run_dir))
    notes.append(write_config(run_dir, config, start_step, saved_config))
    return [n for n in notes if n]
