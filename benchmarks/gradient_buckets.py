"""The data-parallel step with gradients summed in buckets against one reduction per array,
in one process (8 simulated CPU devices, ``mesh.data=8``), side by side.

    python benchmarks/gradient_buckets.py [--steps 20] [--config configs/gpt_tiny.yaml]

Builds the run twice — ``train.grad_bucket_mb=25`` (what the default, auto, means on the
CPU) and 0 (XLA's reduction, one collective per array, inside the layer scan: the default
on GPUs) — and times their
train steps interleaved (one of each in turn, after a warm-up: the machine's drift falls
on both), printing the median ms per step, their ratio, and what each compiled step
all-reduces (instructions and arrays, loops counted by their trip counts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar import hlo  # noqa: E402
from jaxpar.config import load_config  # noqa: E402
from jaxpar.run import build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    args = parser.parse_args()
    runs = {}
    for name, extra in (
        ("buckets", ["train.grad_bucket_mb=25"]),
        ("per array", ["train.grad_bucket_mb=0"]),
    ):
        config = load_config([args.config], ["run.devices=8", "mesh.data=8", *extra])
        run = build(config)
        batch = run.trainer.shard_batch(run.data.batch(0, config.train.batch_size))
        text = run.trainer.compile_step(run.data.batch(0, config.train.batch_size)).as_text()
        stat = hlo.program_cost(text).collectives["all-reduce"]
        state = run.trainer.init()
        for _ in range(3):  # compile and warm up
            state, _ = run.trainer.step(state, batch)
        jax.block_until_ready(state)
        runs[name] = [run, state, batch, [], stat]
    for _ in range(args.steps):
        for entry in runs.values():
            run, state, batch, times, _ = entry
            start = time.perf_counter()
            entry[1], _ = run.trainer.step(state, batch)
            jax.block_until_ready(entry[1])
            times.append(time.perf_counter() - start)
    medians = {name: statistics.median(entry[3]) * 1e3 for name, entry in runs.items()}
    print(f"{args.config}, mesh.data=8 on 8 simulated CPU devices, {args.steps} steps each")
    print("| reduction | ms per step (median) | all-reduce instructions | arrays |")
    print("|---|---|---|---|")
    for name, entry in runs.items():
        stat = entry[4]
        print(f"| {name} | {medians[name]:.1f} | {stat.count} | {stat.arrays} |")
    print(f"buckets / per array: {medians['buckets'] / medians['per array']:.3f}")


if __name__ == "__main__":
    main()
