"""Checkpoint cost: how long the training loop is blocked per save, async vs sync, and restore.

    python benchmarks/checkpoint_save.py [--saves 3] [--configs tiny gpt2_small]

For each model (``configs/gpt_tiny.yaml``, 0.87 M parameters, and
``configs/gpt2_small.yaml``, 124 M — params + AdamW moments ≈ 1.5 GB per
checkpoint) on 8 simulated devices under ``mesh.fsdp=8``: the train state is
initialized, then saved ``--saves`` times with ``checkpoint.async_save`` on and
off, side by side. Between saves the host sleeps ``--gap`` seconds (training
steps on an accelerator, during which the host mostly waits) and a jitted
update changes every array (as a train step would). Per row: the median time the
caller is blocked in
``Checkpointer.save`` (async: the device-to-host copy; sync: the whole write),
the time until the last write is complete, and the time to restore the latest
checkpoint onto the same shardings. The write goes to a temporary directory on
the local disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

from jaxpar import build, load_config
from jaxpar.checkpoint import Checkpointer

CONFIGS = {"tiny": "configs/gpt_tiny.yaml", "gpt2_small": "configs/gpt2_small.yaml"}


def measure(config: str, async_save: bool, saves: int, gap: float) -> dict[str, float]:
    """Blocked-per-save, finish and restore seconds for one model and mode."""
    run = build(
        load_config(
            [config], ["mesh.data=1", "mesh.fsdp=8", "train.batch_size=8", "train.grad_accum=1"]
        )
    )
    trainer = run.trainer
    state = trainer.init()
    touch = jax.jit(
        lambda s: jax.tree.map(lambda x: x + 1 if x.dtype.kind == "i" else x * 1.0001, s),
        donate_argnums=0,
    )
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(tmp, run.plan, keep=2, async_save=async_save)
        blocked = []
        for step in range(1, saves + 1):
            time.sleep(gap)  # training steps on an accelerator: the host mostly waits
            state = jax.block_until_ready(touch(state))
            start = time.perf_counter()
            ckpt.save(step, state, {"step": step})
            blocked.append(time.perf_counter() - start)
        start = time.perf_counter()
        ckpt.wait()
        finish = time.perf_counter() - start
        start = time.perf_counter()
        restored, _ = ckpt.restore()
        jax.block_until_ready(restored)
        restore = time.perf_counter() - start
        ckpt.close()
    return {
        "bytes": nbytes,
        "blocked": statistics.median(blocked),
        "finish": finish,
        "restore": restore,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument(
        "--gap",
        type=float,
        default=5.0,
        help="seconds of (simulated, host-idle) training between saves",
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    print(
        f"{jax.device_count()} × {jax.devices()[0].platform} devices, mesh fsdp=8, "
        f"{args.saves} saves each, {args.gap:g} s apart\n"
    )
    print(
        "| model | state (MiB) | mode | blocked per save (s) | last write done after (s) "
        "| restore (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.configs:
        rows = {
            mode: measure(CONFIGS[name], mode == "async", args.saves, args.gap)
            for mode in ("async", "sync")
        }
        for mode, r in rows.items():
            print(
                f"| {name} | {r['bytes'] / 2**20:.1f} | {mode} | {r['blocked']:.3f} | "
                f"{r['finish']:.3f} | {r['restore']:.3f} |"
            )
        ratio = rows["sync"]["blocked"] / rows["async"]["blocked"]
        print(f"| {name} | | sync/async blocked | {ratio:.1f}× | | |")


if __name__ == "__main__":
    main()
