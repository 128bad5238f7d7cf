"""Pipeline schedules side by side: bubble, peak activations, compiled memory, step time.

    python benchmarks/pipeline_schedules.py [--stages 4] [--microbatches 4 8 16 32] [--steps 5]
                                            [--schedules gpipe 1f1b interleaved zb_h1]
                                            [--attention library|reference]

Trains ``configs/gpt_tiny.yaml`` made 8 layers deep (so interleaved can run
2 chunks per device) on ``--stages`` devices with ``mesh.stage = --stages``
and the default global batch (32 × 128 tokens), for every schedule and
microbatch count. Per row: the schedule's bubble fraction and peak in-flight
activations (from the schedule table, F = I = W = 1 and B = 2), the bubble of
the tick table the executor runs (every action one tick, devices in lockstep),
the compiled
train step's temporary bytes per device (``memory_analysis``), and the median
step time over ``--steps`` steps after one warm-up step. A last row gives the
same model without a pipeline (``mesh.data = --stages``) for reference.

On CPU the simulated devices share the host's cores, so step time measures the
total work (including the per-microbatch recomputation the executor does), not
the bubble; the bubble shows on real accelerators.

``--attention reference`` traces the model with the hand-written attention of
``benchmarks/attention_memory.py`` instead of ``jax.nn.dot_product_attention``
(the model's), to separate the attention's CPU cost from the executor's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling attention_memory module

import jax  # noqa: E402
from attention_memory import attention_traced  # noqa: E402

from jaxpar import (
    build,  # noqa: E402
    load_config,  # noqa: E402
)
from jaxpar.pipeline import (  # noqa: E402
    SCHEDULES,
    simulate,
    tick_table,  # noqa: E402
)

CONFIG = "configs/gpt_tiny.yaml"


def measure(overrides: list[str], steps: int, attention: str = "library") -> tuple[int, float]:
    """(temp bytes per device, median step seconds) of the config's train step, traced
    with ``attention`` (``library`` or ``reference``)."""
    with attention_traced(attention):
        return _measure(overrides, steps)


def _measure(overrides: list[str], steps: int) -> tuple[int, float]:
    run = build(load_config([CONFIG], [*overrides, "model.n_layers=8"]))
    trainer, size = run.trainer, run.config.train.batch_size
    batch = run.data.batch(0, size)
    temp = trainer.compile_step(batch).memory_analysis().temp_size_in_bytes
    state = trainer.init()
    sharded = trainer.shard_batch(batch)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = trainer.step(state, sharded)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return temp, statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="the schedules to measure (default: all)",
    )
    parser.add_argument(
        "--attention",
        choices=("library", "reference"),
        default="library",
        help="the model's jax.nn.dot_product_attention (default) or the "
        "hand-written reference attention",
    )
    args = parser.parse_args()
    p = args.stages
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; "
        f"gpt_tiny × 8 layers, batch 32×128, stage={p}, {args.attention} attention"
    )
    print(
        f"{'schedule':<12}{'m':>4}{'bubble':>9}{'ticks':>7}{'tick bubble':>13}"
        f"{'peak act':>10}{'temp MiB':>10}{'step s':>9}"
    )
    for schedule in args.schedules:
        v = 2 if schedule == "interleaved" else 1
        for m in args.microbatches:
            table = tick_table(schedule, p, m, v)
            timing = simulate(table.orders, v)
            tick_bubble = 1 - (table.kind != 0).sum() / table.kind.size
            temp, step = measure(
                [
                    f"mesh.stage={p}",
                    "mesh.data=1",
                    f"run.devices={p}",
                    f"pipeline.schedule={schedule}",
                    f"pipeline.microbatches={m}",
                    f"pipeline.virtual_stages={v}",
                ],
                args.steps,
                args.attention,
            )
            peak = max(timing.peak_in_flight) / v
            print(
                f"{schedule:<12}{m:>4}{timing.bubble:>9.3f}{table.ticks:>7}"
                f"{tick_bubble:>13.3f}{peak:>10g}{temp / 2**20:>10.2f}{step:>9.3f}",
                flush=True,
            )
    temp, step = measure([f"mesh.data={p}", f"run.devices={p}"], args.steps, args.attention)
    print(
        f"{'no pipeline':<12}{'-':>4}{'-':>9}{'-':>7}{'-':>13}{'-':>10}{temp / 2**20:>10.2f}"
        f"{step:>9.3f}"
    )


if __name__ == "__main__":
    main()
