"""Data-parallel scaling over processes: 2 processes on one core each vs 1 process on one core.

    python benchmarks/multiprocess_scaling.py [--steps 40] [--batch-per-process 16]

Trains ``configs/gpt_tiny.yaml`` with the same per-process batch (``--batch-per-
process`` sequences of 128 tokens) twice, side by side in one run:

* 1 process pinned to core 0, one CPU device, ``mesh.data=1``;
* ``jaxpar launch -n 2 --devices-per-process 1 --cpus-per-process 1``: 2 processes,
  each pinned to its own core with one CPU device, ``mesh.data=2`` across processes
  (gradients all-reduced over gloo on the loopback network), twice the global batch.

Throughput is the median ``examples_per_s`` of the logged intervals after the first
(compile) one and before the last (which includes the final checkpoint). The published
rule of thumb for 2 GPUs is 1.7–1.9×.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _throughput(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["examples_per_s"] for row in rows[1:-1])


def _run(cmd: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-per-process", type=int, default=16)
    args = parser.parse_args()
    b, steps = args.batch_per_process, args.steps
    common = ["train", "configs/gpt_tiny.yaml", f"train.steps={steps}", "train.log_every=5",
              "train.eval_every=0", "train.progress=false", "optim.decay_steps=1000"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "one", Path(tmp) / "two"
        _run([sys.executable, "-m", "jaxpar", *common, "mesh.data=1", f"train.batch_size={b}",
              f"run.dir={one}"],
             {**env, "JAXPAR_CPUS": "0", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
        _run([sys.executable, "-m", "jaxpar", "launch", "-n", "2", "--devices-per-process", "1",
              "--cpus-per-process", "1", "--", *common, "mesh.data=2",
              f"train.batch_size={2 * b}", f"run.dir={two}"], env)
        a, c = _throughput(one), _throughput(two)
    print(f"gpt_tiny, {b} × 128 tokens per process, {steps} steps, examples/s "
          "(median of the logged intervals)")
    print("| run | global batch | examples/s | speed-up |")
    print("|---|---|---|---|")
    print(f"| 1 process, 1 core | {b} | {a:.1f} | 1.00× |")
    print(f"| 2 processes, 1 core each | {2 * b} | {c:.1f} | {c / a:.2f}× |")


if __name__ == "__main__":
    main()
