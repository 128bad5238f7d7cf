"""Compile time against depth: the layer scan keeps the train step's compile time flat.

    python benchmarks/compile_depth.py [--depths 4 32] [--reps 3] [--layouts data=8]
                                       [--config configs/gpt_tiny.yaml] [--unrolled]

For each layout and ``model.n_layers`` in ``--depths`` of ``--config`` (other
settings unchanged) on 8 simulated CPU devices, the train step is lowered and
compiled with ``trainer.compile_step`` (abstract inputs, no data on devices),
each time in a FRESH Python process with the persistent compilation cache off,
so no cache helps. Before the timed compile the child starts the backend and
compiles a trivial function, so one-time start-up costs are not counted.
Repetitions are interleaved over the depths; a row gives the medians of
``--reps``: lowering (tracing + StableHLO, i.e. the call's time less XLA's),
XLA compile (JAX's ``backend_compile_duration`` event), their total, and the
process CPU time of the same call (which other work on a shared machine
disturbs less than wall time); the last row per layout is the ratio
deepest/shallowest (the issue asks ≤ 1.5 for the total).

``--unrolled`` adds a HYPOTHETICAL comparison: the same compiles with the layer
scan fully unrolled (``jax.lax.scan`` patched to ``unroll=True`` in the child,
one repetition), i.e. what compile time would be without the scan. Not cheap:
32 unrolled layers take ~3 minutes to compile on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxpar.axes import MESH_AXES

ROOT = Path(__file__).resolve().parents[1]
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def layout_overrides(layout: str) -> list[str]:
    """``"data=2,fsdp=2,tensor=2"`` → mesh overrides, every axis not named set to 1."""
    named = dict(item.split("=") for item in layout.split(","))
    return [f"mesh.{axis}={named.get(axis, 1)}" for axis in MESH_AXES]


def child(config: str, layout: str, depth: int, unrolled: bool) -> dict[str, float]:
    """In a fresh process: seconds to lower and compile the train step at ``depth``."""
    from jaxpar import setup_devices

    setup_devices()  # 8 simulated CPU devices, before JAX starts its backend
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    if unrolled:  # hypothetical: what the step would cost to compile without the layer scan
        jax.lax.scan = functools.partial(jax.lax.scan, unroll=True)
    from jaxpar import build, load_config

    run = build(
        load_config(
            [config], [*layout_overrides(layout), f"model.n_layers={depth}", "train.grad_accum=1"]
        )
    )
    jax.jit(lambda x: x + 1)(1.0).block_until_ready()  # backend start-up, not timed
    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(secs) if event == BACKEND_COMPILE_EVENT else None
    )
    host_batch = run.data.batch(0, run.config.train.batch_size)
    start_cpu, start = time.process_time(), time.perf_counter()
    run.trainer.compile_step(host_batch)
    total, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return {"lower": total - sum(compiles), "compile": sum(compiles), "total": total, "cpu": cpu}


def measure(config: str, layout: str, depth: int, unrolled: bool) -> dict[str, float]:
    """One fresh-process compile; the child's timings."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--config",
        config,
        "--layouts",
        layout,
        "--depths",
        str(depth),
    ] + (["--unrolled"] if unrolled else [])
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def table(
    config: str, layouts: list[str], depths: list[int], reps: int, unrolled: bool
) -> list[str]:
    """Markdown rows: per layout, medians per depth and the deepest/shallowest ratio."""
    rows = []
    for layout in layouts:
        samples: dict[int, list[dict[str, float]]] = {d: [] for d in depths}
        for _ in range(reps):  # interleaved, so slow spells of a shared machine hit all depths
            for d in depths:
                samples[d].append(measure(config, layout, d, unrolled))
        med = {d: medians(samples[d]) for d in depths}
        what = "unrolled (hypothetical)" if unrolled else "layer scan"
        for d in depths:
            m = med[d]
            rows.append(
                f"| {layout} | {what} | {d} | {m['lower']:.2f} | {m['compile']:.2f} "
                f"| {m['total']:.2f} | {m['cpu']:.2f} |"
            )
        lo, hi = med[min(depths)], med[max(depths)]
        rows.append(
            f"| {layout} | {what} | ratio {max(depths)}/{min(depths)} "
            f"| {hi['lower'] / lo['lower']:.2f} | {hi['compile'] / lo['compile']:.2f} "
            f"| **{hi['total'] / lo['total']:.2f}** | {hi['cpu'] / lo['cpu']:.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["data=8"],
        help="mesh degrees per layout, e.g. data=2,fsdp=2,tensor=2",
    )
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument(
        "--unrolled",
        action="store_true",
        help="also compile with the layer scan unrolled (one repetition)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.config, args.layouts[0], args.depths[0], args.unrolled)))
        return
    print(
        f"{args.config}, train step compiled in a fresh process per sample, persistent "
        f"cache off; median of {args.reps} (seconds)\n"
    )
    print("| layout | layers | model.n_layers | lower | compile | total | total, CPU |")
    print("|---|---|---|---|---|---|---|")
    rows = table(args.config, args.layouts, args.depths, args.reps, False)
    if args.unrolled:
        rows += table(args.config, args.layouts, args.depths, 1, True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
