"""``jaxpar inspect``: where every parameter lives and what a step costs per device.

Nothing is trained and no parameter is allocated: shapes come from
``nnx.eval_shape``, shardings from the rules, and the compiled step's memory
from ``jit(...).lower(...).compile().memory_analysis()`` on abstract inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpar import sharding as shd
from jaxpar.run import Run


@dataclass(frozen=True)
class Totals:
    """Per-device byte totals of a layout."""

    params_bytes: int
    opt_state_bytes: int
    params_total_bytes: int
    opt_state_total_bytes: int
    step_argument_bytes: int
    step_output_bytes: int
    step_temp_bytes: int


def _example_batch(run: Run) -> dict[str, np.ndarray]:
    """A host batch of the run's global shape (only shapes and dtypes are used)."""
    return run.data.batch(0, run.config.train.batch_size)


def layout_totals(run: Run) -> Totals:
    """State bytes per device from the shardings; step bytes from the compiled program."""
    trainer = run.trainer
    compiled = trainer.compile_step(_example_batch(run))
    mem = compiled.memory_analysis()
    opt_abstract, opt_shardings = trainer.abstract_state.opt_state, trainer.state_shardings.opt_state
    return Totals(
        params_bytes=shd.bytes_per_device(trainer.abstract_params, trainer.state_shardings.params),
        opt_state_bytes=shd.bytes_per_device(opt_abstract, opt_shardings),
        params_total_bytes=shd.total_bytes(trainer.abstract_params),
        opt_state_total_bytes=shd.total_bytes(opt_abstract),
        step_argument_bytes=int(mem.argument_size_in_bytes),
        step_output_bytes=int(mem.output_size_in_bytes),
        step_temp_bytes=int(mem.temp_size_in_bytes),
    )


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_spec(spec) -> str:
    def entry(e):
        if e is None:
            return "None"
        return e if isinstance(e, str) else "(" + ",".join(e) + ")"

    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _fmt_axes(names: tuple) -> str:
    return "(" + ", ".join("-" if n is None else n for n in names) + ")"


def format_report(run: Run, totals: Totals) -> str:
    """The ``jaxpar inspect`` text: one row per parameter, then per-device totals."""
    trainer = run.trainer
    rows = shd.param_rows(trainer.abstract_params, trainer.axes, trainer.state_shardings.params)
    table = [("parameter", "shape", "logical axes", "PartitionSpec", "bytes/device")]
    table += [(r.path, "×".join(map(str, r.shape)), _fmt_axes(r.axes), _fmt_spec(r.spec),
               _fmt_bytes(r.bytes_per_device)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    n_dev = trainer.mesh.devices.size
    lines += [
        "",
        f"devices: {n_dev}  mesh: " + " ".join(f"{k}={v}" for k, v in trainer.mesh.shape.items()),
        f"params per device:           {_fmt_bytes(totals.params_bytes)}"
        f"  (total {_fmt_bytes(totals.params_total_bytes)})",
        f"optimizer state per device:  {_fmt_bytes(totals.opt_state_bytes)}"
        f"  (total {_fmt_bytes(totals.opt_state_total_bytes)})",
        f"train step per device (compiled): arguments {_fmt_bytes(totals.step_argument_bytes)}, "
        f"outputs {_fmt_bytes(totals.step_output_bytes)}, temporaries {_fmt_bytes(totals.step_temp_bytes)}",
    ]
    return "\n".join(lines)
