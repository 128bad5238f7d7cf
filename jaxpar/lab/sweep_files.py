"""What ``jaxpar sweep`` writes and prints: ``sweep.csv`` (:data:`COLUMNS` first), ``sweep.md``,
the chart, the terminal table, and the folder they go in (a stopped sweep's to finish:
:mod:`jaxpar.lab.resume`). The layouts and their measuring are :mod:`jaxpar.lab.sweep`'s."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, fields
from pathlib import Path

from jaxpar.files import ensure_dir, write_atomic
from jaxpar.lab import resume
from jaxpar.lab.chart import Panel, write_chart
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Row
from jaxpar.outputs import check_new_folder, free_folder

#: The documented columns of ``sweep.csv``, in order; more follow them.
COLUMNS = (
    "layout",
    "mem_args_bytes",
    "mem_temp_bytes",
    "mem_total_bytes",
    "flops",
    "all_reduce_bytes",
    "all_gather_bytes",
    "reduce_scatter_bytes",
    "collective_permute_bytes",
    "all_to_all_bytes",
    "predicted_comm_bytes",
    "step_time_s",
    "predicted_step_time_s",
    "fits",
)
#: The files a sweep writes in its folder.
OUTPUT_FILES = ("sweep.csv", "sweep.md", "sweep.png")


# ---- layouts ---------------------------------------------------------------------------------


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def csv_columns() -> list[str]:
    """The CSV header: the documented columns, then the extra ones."""
    return [*COLUMNS, *(f.name for f in fields(Row) if f.name not in COLUMNS)]


def write_csv(rows: list[Row], path: str | Path) -> Path:
    """``sweep.csv``: one row per layout, empty cells where a layout was invalid."""
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(csv_columns())
    for row in rows:
        values = asdict(row)
        writer.writerow([_cell(values[c]) for c in csv_columns()])
    return write_atomic(path, text.getvalue())


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _table_rows(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        if not r.ok:
            out.append([r.layout, "invalid: " + r.error])  # the whole reason: its fix too
            continue
        ratio = "" if r.comm_ratio is None else f"{r.comm_ratio:.3f}"
        out.append(
            [
                r.layout,
                _mib(r.mem_args_bytes),
                _mib(r.mem_temp_bytes),
                _mib(r.mem_total_bytes),
                "yes" if r.fits else "NO",
                f"{r.flops / 1e9:.3f}",
                _mib(r.comm_bytes),
                _mib(r.predicted_comm_bytes),
                ratio,
                "" if r.step_time_s is None else f"{r.step_time_s:.4f}",
                "" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
                f"{r.predicted_step_time_s * 1e3:.3f}",
            ]
        )
    return out


_HEAD = [
    "layout",
    "args MiB",
    "temp MiB",
    "total MiB",
    "fits",
    "GFLOP",
    "comm MiB",
    "predicted MiB",
    "measured/pred",
    "step s",
    "tokens/s",
    "pred. ms",
]


def format_table(rows: list[Row], hw: Hardware) -> str:
    """The terminal table (per device; predicted step time on ``hw``)."""
    body = _table_rows(rows)
    widths = [
        max([len(_HEAD[i])] + [len(b[i]) for b in body if len(b) > 2]) for i in range(len(_HEAD))
    ]
    lines = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(_HEAD, widths))
        ).rstrip()
    ]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))
            ).rstrip()
        )
    lines.append(
        f"per device; comm = collective wire bytes per step; predicted step time on "
        f"{hw.name} (roofline)"
    )
    return "\n".join(lines)


def format_markdown(rows: list[Row], hw: Hardware) -> str:
    """``sweep.md``: the same table in Markdown, invalid layouts with their full reason."""
    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for r, b in zip(rows, _table_rows(rows)):
        cells = b if r.ok else [r.layout, f"invalid: {r.error}", *[""] * (len(_HEAD) - 2)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines.append("")
    lines.append(
        f"Per device. comm: collective wire bytes per step read from the compiled HLO; "
        f"predicted: the textbook formulas; pred. ms: roofline step time on {hw.name}."
    )
    return "\n".join(lines) + "\n"


def output_folder(
    out: str | None,
    run_dir: str,
    overwrite: bool = False,
    key: dict | None = None,
    create: bool = True,
) -> Path:
    """Where :func:`write_outputs` goes — ``out``, or by default ``<run_dir>/sweep`` (or
    ``sweep-2``, ``sweep-3`` … when an earlier sweep's files are there) — checked and
    created before anything is compiled (:mod:`jaxpar.outputs`). A folder holding only a
    stopped sweep's rows (:mod:`jaxpar.lab.resume`) is the same command's to finish: the
    default is the first whose rows the command ``key`` names; an ``--out`` holding
    another command's rows is refused by :func:`jaxpar.lab.resume.kept_rows`. ``create``:
    also create it (not: only check it).

    Raises:
      PathError: a run's own folder, a running run's, a file, or a folder holding files
        without ``overwrite``.
    """
    if out is None:
        default = Path(run_dir) / "sweep"
        out = default if overwrite else free_folder(default, lambda p: resume.matches(p, key))
    resume.refuse_unsuitable(Path(out))
    resumed = resume.only_partial(Path(out))
    check_new_folder(out, "--out", ", ".join(OUTPUT_FILES), overwrite or resumed)
    return ensure_dir(out, "--out", "choose another --out folder") if create else Path(out)


def write_outputs(
    rows: list[Row], hw: Hardware, out_dir: str | Path, chart: str = "sweep.png"
) -> list[Path]:
    """``sweep.csv``, ``sweep.md`` and the chart (``sweep.png``; a ``chart`` name ending in
    ``.svg`` writes SVG) in ``out_dir``, each written whole (a temporary file renamed),
    mode 0644."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = write_atomic(out / "sweep.md", format_markdown(rows, hw))
    labels = [r.layout for r in rows]
    panels = [
        Panel("peak memory per device", [r.mem_total_bytes for r in rows], "B", "bytes per device"),
        Panel(
            "collective bytes per step: measured vs predicted",
            [(r.comm_bytes, r.predicted_comm_bytes) if r.ok else None for r in rows],
            "B",
            "bytes sent per device per step",
        ),
        Panel(
            "measured step time (this machine)", [r.step_time_s for r in rows], "s", "time per step"
        ),
        Panel(
            f"predicted step time ({hw.key}, roofline)",
            [r.predicted_step_time_s for r in rows],
            "s",
            "time per step",
        ),
    ]
    if all(r.step_time_s is None for r in rows):
        panels.pop(2)
    return [write_csv(rows, out / "sweep.csv"), md, write_chart(labels, panels, out / chart)]
