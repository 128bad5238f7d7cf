"""Loader throughput against the training step rate it has to feed.

    python benchmarks/input_pipeline.py [--batches 300] [--steps 10]

For ``configs/gpt_tiny.yaml`` (batch 32 × 128 tokens) and ``configs/gpt2_small.yaml``
(batch 64 × 1024 tokens), both over the built-in corpus: the grain loader's rate
with the default settings (``data.threads=2``, ``data.prefetch=4``) and with
none (``threads=0, prefetch=0``), in batches/s and tokens/s, timed over
``--batches`` batches after 5 warm-up batches. Next to it, the step rate the
loader must feed:

* ``gpt_tiny``: measured here — the median of ``--steps`` train steps on the 8
  simulated CPU devices (``mesh.data=8``), after one compile step;
* ``gpt2_small``: PREDICTED for one H100 SXM (989 TFLOP/s dense bf16) at 40% MFU
  from 6·params·tokens FLOPs per step — a CPU step of this model takes minutes
  and says nothing about a GPU.

Headroom = loader batches/s ÷ steps/s (the issue asks ≥ 10×).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

from jaxpar import build, load_config
from jaxpar.config import DataConfig

H100_BF16_FLOPS = 989e12
MFU = 0.4


def loader_rate(config: str, batches: int, threads: int, prefetch: int) -> float:
    """Batches per second of the training loader of ``config`` (data only, no model)."""
    cfg = load_config([config], ["mesh.data=8", "train.grad_accum=1"])
    data = build(cfg).data
    loader = data.loader(cfg.train.batch_size, DataConfig(threads=threads, prefetch=prefetch))
    for _ in range(5):
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    rate = batches / (time.perf_counter() - start)
    loader.close()
    return rate


def tiny_step_rate(steps: int) -> float:
    run = build(load_config(["configs/gpt_tiny.yaml"], ["mesh.data=8"]))
    state = run.trainer.init()
    batch = run.trainer.shard_batch(run.data.batch(0, run.config.train.batch_size))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = run.trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times[1:])


def gpt2_predicted_step_rate() -> float:
    run = build(load_config(["configs/gpt2_small.yaml"], ["mesh.data=8", "train.grad_accum=1"]))
    params = sum(x.size for x in jax.tree.leaves(run.plan.model.params))
    tokens = run.config.train.batch_size * run.config.data.seq_len
    return H100_BF16_FLOPS * MFU / (6 * params * tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rows = [
        (
            "gpt_tiny",
            "configs/gpt_tiny.yaml",
            32 * 128,
            tiny_step_rate(args.steps),
            "measured, 8 CPU devices",
        ),
        (
            "gpt2_small",
            "configs/gpt2_small.yaml",
            64 * 1024,
            gpt2_predicted_step_rate(),
            "predicted, 1 H100 at 40% MFU",
        ),
    ]
    print("| model | tokens/batch | loader | batches/s | tokens/s | steps/s to feed | headroom |")
    print("|---|---|---|---|---|---|---|")
    for name, config, tokens, steps, how in rows:
        for label, threads, prefetch in (
            ("default (2 threads, prefetch 4)", 2, 4),
            ("no threads, no prefetch", 0, 0),
        ):
            rate = loader_rate(config, args.batches, threads, prefetch)
            print(
                f"| {name} | {tokens:,} | {label} | {rate:,.0f} | {rate * tokens:,.0f} | "
                f"{steps:.2f} ({how}) | {rate / steps:,.0f}× |"
            )


if __name__ == "__main__":
    main()
