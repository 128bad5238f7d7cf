"""Layouts estimated (:func:`jaxpar.lab.analytic.estimate`) and compiled on as many
simulated devices as this process has: one JSON line per layout with both figures.
``tests/test_analytic.py`` runs it in a process of 32 devices (the suite's own has 8):

    python -m tests.analytic_grid CONFIG.yaml "key=value,…" LAYOUT [LAYOUT …]
"""

from __future__ import annotations

import json
import sys

import jax

import jaxpar
from jaxpar.lab import analytic, hardware
from jaxpar.lab.measure import measure

FIELDS = ("flops", "mem_args_bytes", "mem_output_bytes", "mem_temp_bytes", "error")


def main(argv: list[str]) -> None:
    path, overrides, *layouts = argv
    config = jaxpar.load_config([path], [x for x in overrides.split(",") if x])
    h100 = hardware.get_profile("h100")
    devices = jax.device_count()
    for layout in layouts:
        estimated = analytic.estimate(config, layout, h100, devices, cpu=True)
        compiled = measure(config, layout, h100)
        rows = {"estimated": estimated, "compiled": compiled}
        found = {k: {f: getattr(r, f) for f in FIELDS} for k, r in rows.items()}
        print(json.dumps({"layout": layout, "devices": devices, **found}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
