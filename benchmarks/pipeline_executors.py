"""The two pipeline executors side by side, and what splitting the texts' two-layer model
by layer saves per device.

    python benchmarks/pipeline_executors.py [--layouts stage=2,data=4 stage=4,data=2]
                                            [--schedule 1f1b] [--steps 5]

1. **The same GPT layout under both executors** (``configs/gpt_tiny.yaml``, 4 layers,
   global batch 32 × 128 tokens, ``pipeline.microbatches=4``; the sub-mesh executor with
   each backward recomputing its forward, and keeping the forward's residuals instead,
   ``pipeline.backward=residuals``): per device, the peak
   memory of the step (arguments + outputs + temporaries, from the compiled programs),
   the FLOPs in the step-time view (the busiest device's, bubbles counted), the collective
   bytes of one step (from their HLO), the bytes the sub-mesh executor
   moves between stages with ``device_put`` (from its programs' output shapes), and the
   median step time over ``--steps`` steps — measured by ``jaxpar sweep``'s own
   ``measure``, one row per executor, in one run.
2. **Does async dispatch overlap the stages on this backend?** The sub-mesh executor on 2
   devices (``mesh.stage=2``, one device a stage, so no program has a collective), its
   programs run each to its end before the next is dispatched (what it does on the CPU
   backend) against dispatched asynchronously: if the stages overlapped, the second
   would be faster.
3. **The texts' 784→512→10 model** (``examples/two_device_mlp.py``, Adam) on one device and
   split by layer over two: state (parameters + Adam's moments) and peak memory of the
   step, per device.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar import build, lab, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/gpt_tiny.yaml")
MiB = 2**20


def executors(layouts: list[str], schedule: str, steps: int) -> None:
    hw = lab.hardware.get_profile("h100")
    print(f"1. gpt_tiny, batch 32×128, pipeline.schedule={schedule}, 4 microbatches; per device")
    print(
        f"{'layout':<18}{'executor':>16}{'peak MiB':>10}{'GFLOP':>8}{'collectives MiB':>17}"
        f"{'moved MiB':>11}{'step s':>9}"
    )
    config = load_config([CONFIG], [f"pipeline.schedule={schedule}", "pipeline.microbatches=4"])
    variants = {
        "spmd": "pipeline.executor=spmd",
        "mpmd": "pipeline.executor=mpmd",
        "mpmd, residuals": "pipeline.executor=mpmd,pipeline.backward=residuals",
    }
    for layout in layouts:
        for name, executor in variants.items():
            row = lab.sweep.measure(config, f"{layout},{executor}", hw, steps)
            assert row.ok, row.error
            moved = f"{row.transfer_bytes / MiB:.2f}" if row.transfer_bytes else "-"
            print(
                f"{layout:<18}{name:>16}{row.mem_total_bytes / MiB:>10.2f}"
                f"{row.flops / 1e9:>8.2f}{row.comm_bytes / MiB:>17.2f}{moved:>11}"
                f"{row.step_time_s:>9.3f}",
                flush=True,
            )


def _step_time(run, steps: int) -> float:
    trainer = run.trainer
    state = trainer.init()
    batch = trainer.shard_batch(run.data.batch(0, run.config.train.batch_size))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def overlap(steps: int) -> None:
    print(
        "\n2. sub-mesh executor, gpt_tiny on 2 devices (stage=2: a device a stage), "
        "1f1b, 4 microbatches"
    )
    run = build(
        load_config(
            [CONFIG],
            [
                "mesh.stage=2",
                "mesh.data=1",
                "run.devices=2",
                "pipeline.executor=mpmd",
                "pipeline.microbatches=4",
            ],
        )
    )
    in_order = _step_time(run, steps)
    plan = run.plan
    dispatched = dataclasses.replace(plan.gradients, in_order=False, _programs={})
    run_async = dataclasses.replace(
        run, trainer=run.trainer.with_plan(dataclasses.replace(plan, gradients=dispatched))
    )
    asynchronous = _step_time(run_async, steps)
    print(
        f"  each program run to its end: {in_order:.3f} s/step; dispatched asynchronously: "
        f"{asynchronous:.3f} s/step (ratio {asynchronous / in_order:.2f})"
    )


def two_layer_model() -> None:
    spec = importlib.util.spec_from_file_location("two", ROOT / "examples/two_device_mlp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    print("\n3. the texts' 784→512→10 model, Adam, batch 32; per device")
    print(f"{'layout':<28}{'params MiB':>11}{'Adam MiB':>10}{'peak MiB':>10}")
    for name, overrides in (
        ("one device", ["mesh.data=1", "run.devices=1"]),
        ("split by layer (stage=2)", ["mesh.stage=2", "run.devices=2"]),
    ):
        run = build(load_config([], [*overrides, "train.batch_size=32"]), example.TASK)
        state = run.plan.state_bytes()
        compiled = run.trainer.compile_step(run.data.batch(0, 32))
        mem = compiled.memory_analysis()
        peak = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
        print(
            f"{name:<28}{state.params / MiB:>11.3f}{state.opt_state / MiB:>10.3f}"
            f"{peak / MiB:>10.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["stage=2,data=4", "stage=4,data=2"])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    executors(args.layouts, args.schedule, args.steps)
    overlap(args.steps)
    two_layer_model()


if __name__ == "__main__":
    main()
