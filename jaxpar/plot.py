"""``jaxpar plot``: the loss curves of runs side by side.

``jaxpar plot RUN_DIR [RUN_DIR …] [--out PATH]`` reads each run's ``metrics.jsonl`` and
draws the train loss and the eval loss against the step — and, when the rows carry
``tokens``, in a second panel against the tokens seen — one colour per run, each labelled
by its directory name: the way to compare layouts or settings of one model.
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpar.errors import PathError
from jaxpar.figures import DPI, image_format, new_figure, save_figure  # noqa: F401 (DPI)
from jaxpar.outputs import check_new_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS_FILE = "metrics.jsonl"


# ---- reading metrics.jsonl -----------------------------------------------------------------


def _metrics_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/metrics.jsonl`` (a path to the file itself is taken as is)."""
    path = Path(run_dir)
    if path.is_file():
        return path
    if not path.is_dir():
        raise PathError(
            f"{path}: no such run directory; give the run.dir of a training run "
            f"(the folder holding {METRICS_FILE})"
        )
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise PathError(
            f"{metrics} not found: {path} is not a run directory; give the run.dir "
            "of a run that `jaxpar train` has logged into"
        )
    return metrics


def read_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/metrics.jsonl``, one JSON object per line.

    A last line that is not a complete JSON object (a run killed while writing it, or
    one still running) is skipped with a warning.

    Raises:
      PathError: if there is no such file, it holds no row, or a line before the last
        is not a JSON object with a ``step``; the message names the path.
    """
    path = _metrics_path(run_dir)
    lines = [(i + 1, line) for i, line in enumerate(path.read_text().splitlines()) if line.strip()]
    rows = []
    for n, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
            problem = "" if isinstance(row, dict) and "step" in row else "no 'step' key"
        except json.JSONDecodeError as err:
            row = None
            problem = f"not JSON ({err.msg})"
        if not problem:
            rows.append(row)
        elif n == len(lines) - 1:
            warnings.warn(
                f"{path}:{number}: skipped the last line, {problem} (a truncated write?)",
                stacklevel=2,
            )
        else:
            raise PathError(
                f"{path}:{number}: {problem}; each line must be a JSON object "
                "with a 'step' (fix or delete that line)"
            )
    if not rows:
        raise PathError(
            f"{path} holds no rows: the run has logged no step yet; plot it "
            "after its first log step (train.log_every)"
        )
    return rows


@dataclass(frozen=True)
class Series:
    """One curve: ``values`` at ``steps``; ``tokens`` seen at each step, or None."""

    steps: list[int]
    values: list[float]
    tokens: list[float] | None


@dataclass(frozen=True)
class RunCurves:
    """The curves of one run: its label, train loss and eval loss."""

    name: str
    path: Path
    train: Series
    eval: Series


def _eval_tokens(steps: list[int], train: list[dict[str, Any]]) -> list[float] | None:
    """Tokens seen at each eval step, from the train rows (None if they carry no tokens).

    A train row logs ``tokens = step × batch × tokens per example``; an eval row that has
    no ``tokens`` of its own gets ``step ×`` the tokens per step of the last train row at or
    before its step (the first train row's before the first).
    """
    known = [(r["step"], r["tokens"]) for r in train if "tokens" in r and r["step"] > 0]
    if not known:
        return None
    out = []
    for step in steps:
        before = [k for k in known if k[0] <= step]
        s, t = before[-1] if before else known[0]
        out.append(step * t / s)
    return out


def load_run(run_dir: str | Path, name: str | None = None) -> RunCurves:
    """The train and eval loss curves of a run directory (see :func:`read_rows`).

    Train points are the rows with ``loss``; eval points the rows with ``eval_loss`` — in
    rows of their own (``step`` and the ``eval_*`` metrics) or in a train row.

    Raises:
      PathError: as :func:`read_rows`, or if no row has ``loss`` or ``eval_loss``.
    """
    path = _metrics_path(run_dir)
    rows = read_rows(path)
    train = [r for r in rows if isinstance(r.get("loss"), (int, float))]
    evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    if not train and not evals:
        raise PathError(
            f"{path}: no row has 'loss' or 'eval_loss' (keys seen: "
            f"{', '.join(sorted({k for r in rows for k in r}))}); give the "
            "metrics of a training run"
        )
    train_tokens = [r["tokens"] for r in train] if all("tokens" in r for r in train) else None
    eval_steps = [r["step"] for r in evals]
    if evals and all("tokens" in r for r in evals):
        eval_tokens = [r["tokens"] for r in evals]
    else:
        eval_tokens = _eval_tokens(eval_steps, train)
    if not train:
        train_tokens = None
    return RunCurves(
        name or path.parent.name,
        path,
        Series([r["step"] for r in train], [float(r["loss"]) for r in train], train_tokens),
        Series(eval_steps, [float(r["eval_loss"]) for r in evals], eval_tokens),
    )


def run_names(run_dirs: list[str | Path]) -> list[str]:
    """A label per run: its directory's name, with parent folders where names repeat."""
    parts = [_metrics_path(d).resolve().parent.parts for d in run_dirs]
    names = []
    for i, mine in enumerate(parts):
        others = parts[:i] + parts[i + 1 :]
        k = 1
        while k < len(mine) and any(o[-k:] == mine[-k:] for o in others):
            k += 1
        names.append("/".join(mine[-k:]))
    return names


# ---- the loss figure -----------------------------------------------------------------------


def _draw(ax, run: RunCurves, colour: str, by_tokens: bool) -> None:
    """The run's train (solid) and eval (dashed, dots) curves on ``ax``."""
    for series, kind, style in ((run.train, "train", "-"), (run.eval, "eval", "--o")):
        xs = series.tokens if by_tokens else series.steps
        if xs is None or not series.steps:
            continue
        ax.plot(
            xs,
            series.values,
            style,
            color=colour,
            label=f"{run.name} {kind} loss",
            markersize=4,
            linewidth=1.5,
        )


def loss_figure(runs: list[RunCurves]) -> Figure:
    """Train and eval loss of ``runs`` against step, and against tokens seen if any has them.

    Lines are labelled ``"<name> train loss"`` and ``"<name> eval loss"``; each run keeps one
    colour in both panels.
    """
    from matplotlib.ticker import EngFormatter

    by_tokens = any(r.train.tokens is not None or r.eval.tokens is not None for r in runs)
    panels = [False, True] if by_tokens else [False]
    fig = new_figure(6.0 * len(panels), 4.5)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, tokens in zip(axes, panels):
        for run, colour in zip(runs, colours):
            _draw(ax, run, colour, tokens)
        ax.set_xlabel("tokens seen" if tokens else "step")
        ax.set_title("loss by tokens seen" if tokens else "loss by step")
        ax.grid(True, alpha=0.3)
        if tokens:
            ax.xaxis.set_major_formatter(EngFormatter())
    axes[0].set_ylabel("loss")
    axes[0].legend(fontsize="small")
    return fig


def plot_runs(run_dirs: list[str | Path], out: str | Path = "plot.png") -> Path:
    """Draws :func:`loss_figure` of the runs in ``run_dirs`` and writes it at ``out``.

    Raises:
      PathError: for a directory without ``metrics.jsonl``, an empty or malformed one, or
        an image suffix matplotlib cannot write; the message names the path.
    """
    if not run_dirs:
        raise PathError("jaxpar plot needs at least one run directory")
    image_format(out)  # a bad suffix fails before any reading
    runs = [load_run(d, name) for d, name in zip(run_dirs, run_names(run_dirs))]
    return save_figure(loss_figure(runs), out)


# ---- the command ---------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``jaxpar plot RUN_DIR [RUN_DIR …] [--out PATH]`` to ``subparsers``."""
    cmd = subparsers.add_parser(
        "plot", help="draw train and eval loss of one or more runs against step (and tokens)"
    )
    cmd.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help=f"run directories (run.dir) holding {METRICS_FILE}",
    )
    cmd.add_argument(
        "--out",
        default="plot.png",
        metavar="PATH",
        help="the image to write; the suffix picks the format (.png, .svg, …; default: plot.png)",
    )
    cmd.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file; without it that is refused (a "
        "run's own files and a running run's directory never are written)",
    )
    return cmd


def run(args: argparse.Namespace) -> None:
    """Runs ``jaxpar plot``: checks ``--out`` (:mod:`jaxpar.outputs`: an existing file only
    with ``--overwrite``), reads the runs, writes the figure, says where."""
    image_format(args.out)
    check_new_file(args.out, "--out", getattr(args, "overwrite", False))
    print(f"plot written to {plot_runs(args.run_dirs, args.out)}")
