"""Data-parallel scaling over processes: 2 processes on one core each vs 1 process on one core.

    python benchmarks/multiprocess_scaling.py [--steps 40] [--batch-per-process 16]
                                              [--psum-mib 3.33]

Trains ``configs/gpt_tiny.yaml`` with the same per-process batch (``--batch-per-
process`` sequences of 128 tokens) twice, side by side in one run:

* 1 process pinned to core 0, one CPU device, ``mesh.data=1``;
* ``jaxpar launch -n 2 --devices-per-process 1 --cpus-per-process 1``: 2 processes,
  each pinned to its own core with one CPU device, ``mesh.data=2`` across processes
  (gradients all-reduced over gloo on the loopback network; the default settings, so
  ``train.grad_bucket_mb=auto``: 25 MiB buckets on the CPU), twice the global batch;
* the same launch with ``train.grad_bucket_mb=0`` (the default on GPUs): one all-reduce
  per gradient array, as XLA reduces them (inside the layer scan);

* the same launch without ``--cpus-per-process``: each process may use either core, so
  the threads that are not the step's compute (gloo's and the distributed runtime's) run
  where there is room.

Throughput is the median ``examples_per_s`` of the logged intervals after the first
(compile) one and before the last (which includes the final checkpoint). The published
rule of thumb for 2 GPUs is 1.7–1.9×.

Then, to read the figures: the time of a bare ``psum`` across 2 processes pinned to a core
each (gloo over loopback TCP; median of 30 calls after a warm-up) of ``--psum-mib`` MiB
(gpt_tiny's gradient, float32) in one array, of one float, and of the same bytes as 10
arrays (as many as one layer's gradient); a profiler trace of the plain data-parallel step
in those 2 processes (the time inside its all-reduce ops, and how many arrays they reduce:
XLA:CPU makes one gloo call per array of a combined all-reduce); and the time of a
compute-only program (no collective) in those 2 pinned processes with and without
``jax.distributed`` started (median of 15 calls): what the idle runtime's threads cost
the compute on a shared core.

Last, the train step alone (no loop, one batch, ``benchmarks/step_overhead.py``'s
interleaved timing of jaxpar's ``Trainer.step`` and a plain hand-written ``jax.jit`` step):
in 1 process on core 0 alone; in 2 pinned processes at once that do not communicate
(``mesh.data=1`` each: what the two cores cost each other); and in 2 pinned processes with
``mesh.data=2`` (the data-parallel step); and the same data-parallel step in 1 process
with 2 simulated devices on the 2 cores (its all-reduce stays inside the process, no gloo).
The speed-up column is 2 × the 1-process time
over the 2-process time (twice the examples per step).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROBE_CALLS = {"psum": 30, "compute": 15}
PSUM_PARTS = 10  # arrays of the split psum: as many as one layer's gradient in the step


def probe(kind: str, index: int, port: int, mib: float, distributed: bool) -> None:
    """One process of a probe: pinned to core ``index`` (``step2``: cores 0 and 1), one CPU
    device (``step2``: two); prints one line of numbers (the probe's medians in ms)."""
    devices = 2 if kind == "step2" else 1  # step2: 1 process, 2 devices on cores 0 and 1
    os.sched_setaffinity(0, set(range(devices)) if devices > 1 else {index})
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if distributed:
        jax.distributed.initialize(f"127.0.0.1:{port}", 2, index)
    if kind in ("step", "step2"):
        print(step_probe(int(mib), jax.device_count()), flush=True)
        if distributed:
            jax.distributed.shutdown()
        return
    if kind == "trace":
        print(trace_probe(int(mib)), flush=True)
        jax.distributed.shutdown()
        return
    if kind == "psum":  # one array of `mib` MiB, one float, `mib` MiB as 10 arrays
        mesh = Mesh(np.array(jax.devices()), ("data",))
        local = lambda n: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), np.ones((1, n), np.float32)
        )
        floats = int(mib * 2**20 / 4)
        psum = jax.jit(
            jax.shard_map(
                lambda a: jax.lax.psum(a, "data"),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
            )
        )
        calls = [
            (psum, local(floats)),
            (psum, local(1)),
            (psum, tuple(local(floats // PSUM_PARTS) for _ in range(PSUM_PARTS))),
        ]
    else:
        x = jnp.ones((512, 512), jnp.float32, device=jax.local_devices()[0])
        calls = [(jax.jit(lambda a: jax.lax.fori_loop(0, 100, lambda _, b: jnp.tanh(b @ a), a)), x)]
    print(" ".join(f"{median_ms(fn, x, PROBE_CALLS[kind]):.2f}" for fn, x in calls), flush=True)
    if distributed:
        jax.distributed.shutdown()


def median_ms(fn: Any, x: Any, calls: int) -> float:
    """Median milliseconds of ``fn(x)`` until ready, after one warm-up call."""
    import jax

    jax.block_until_ready(fn(x))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_probe(rows: int, ways: int) -> str:
    """Milliseconds per train step of gpt_tiny, ``rows`` sequences per device,
    ``mesh.data=ways`` (every device): jaxpar's ``Trainer.step`` and a plain hand-written
    ``jax.jit`` step (``benchmarks/step_overhead.py``: same model, shardings and loss),
    alternating blocks of 5 steps on one batch, medians of 4 rounds."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_overhead import (
        check_same_losses,
        copy_tree,
        interleaved,
        jaxpar_stepper,
        make_plain_step,
        plain_stepper,
    )

    from jaxpar import build, load_config

    os.chdir(ROOT)
    run = build(
        load_config(
            ["configs/gpt_tiny.yaml"],
            [f"mesh.data={ways}", f"train.batch_size={rows * ways}"],
        )
    )
    trainer = run.trainer
    batch = trainer.shard_batch(run.data.batch(0, rows * ways))  # this process's rows
    state = trainer.init()
    plain = plain_stepper(make_plain_step(run.plan), state.params, state.opt_state, batch)
    ours = jaxpar_stepper(trainer, copy_tree(state), batch)
    check_same_losses(ours, plain)
    times = interleaved(ours, plain, steps=5, rounds=4)
    return f"{times['t'] * 1e3:.1f} {times['t_plain'] * 1e3:.1f}"


def trace_probe(rows: int) -> str:
    """Where the data-parallel step's time goes, from a profiler trace of this process:
    ms per step, ms per step inside all-reduce ops, all-reduce ops executed per step and
    the arrays they reduce per step (XLA:CPU reduces each array of a combined all-reduce
    with its own gloo call). The plain ``jax.jit`` step, ``mesh.data=2``, 5 steps."""
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_overhead import make_plain_step, plain_stepper

    from jaxpar import build, load_config

    os.chdir(ROOT)
    run = build(
        load_config(["configs/gpt_tiny.yaml"], ["mesh.data=2", f"train.batch_size={2 * rows}"])
    )
    trainer, steps = run.trainer, 5
    batch = trainer.shard_batch(run.data.batch(0, 2 * rows))
    state = trainer.init()
    step = make_plain_step(run.plan)
    arrays = all_reduce_arrays(step.lower(state.params, state.opt_state, batch).compile().as_text())
    plain = plain_stepper(step, state.params, state.opt_state, batch)
    plain.block(3)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            per_step = plain.block(steps)[0]
        paths = list(Path(tmp).rglob("*.trace.json.gz"))
        if len(paths) != 1:
            sys.exit(f"expected one perfetto trace under {tmp}, found {len(paths)}")
        path = paths[0]
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    reduces = [e for e in events if e.get("ph") == "X" and e["name"] in arrays]
    ms = sum(e["dur"] for e in reduces) / 1e3 / steps
    return (
        f"{per_step * 1e3:.1f} {ms:.1f} {len(reduces) / steps:.1f} "
        f"{sum(arrays[e['name']] for e in reduces) / steps:.1f}"
    )


def all_reduce_arrays(hlo: str) -> dict[str, int]:
    """Each all-reduce op of a compiled program's text and the number of arrays it reduces."""
    found = re.findall(r"%(all-reduce[\w.-]*) = .*? all-reduce\(([^)]*)\)", hlo)
    return {name: operands.count("%") for name, operands in found}


def _env_without_device_settings() -> dict[str, str]:
    """This environment less the device count and XLA flags (each child sets its own)."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}


def _probe_one(kind: str, arg: float) -> list[float]:
    """The probe in 1 process on core 0, alone on the machine."""
    env = _env_without_device_settings()
    out = subprocess.run(
        [sys.executable, __file__, "--probe", kind, "0", "0", str(arg), "0"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"the {kind} probe failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return _numbers(kind, out.stdout)


def _numbers(kind: str, stdout: str) -> list[float]:
    """The numbers on the last line a probe printed."""
    lines = stdout.strip().splitlines()
    try:
        return [float(x) for x in lines[-1].split()]
    except (IndexError, ValueError):
        sys.exit(f"the {kind} probe printed no numbers: {stdout[-2000:]!r}")


def _probe_pair(kind: str, mib: float, distributed: bool) -> list[float]:
    """Milliseconds per call of the probe in 2 processes at once (core 0 and core 1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env_without_device_settings()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--probe",
                kind,
                str(i),
                str(port),
                str(mib),
                str(int(distributed)),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"the {kind} probe failed: {outs}")
    return [x for out in outs for x in _numbers(kind, out)]


def _throughput(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["examples_per_s"] for row in rows[1:-1])


def _run(cmd: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def _pinned_pair(common: list[str], b: int, run_dir: Path, extra: list[str]) -> list[str]:
    """The command of 2 pinned processes training with ``mesh.data=2``."""
    launch = ["launch", "-n", "2", "--devices-per-process", "1", "--cpus-per-process", "1"]
    data = ["mesh.data=2", f"train.batch_size={2 * b}", f"run.dir={run_dir}"]
    return [sys.executable, "-m", "jaxpar", *launch, "--", *common, *data, *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-per-process", type=int, default=16)
    parser.add_argument(
        "--psum-mib",
        type=float,
        default=3.33,
        help="size of the bare psum (default: gpt_tiny's gradient)",
    )
    parser.add_argument("--probe", nargs=5, help=argparse.SUPPRESS)  # a probe's process
    args = parser.parse_args()
    if args.probe:
        kind, index, port, mib, distributed = args.probe
        probe(kind, int(index), int(port), float(mib), distributed == "1")
        return
    b, steps = args.batch_per_process, args.steps
    common = [
        "train",
        "configs/gpt_tiny.yaml",
        f"train.steps={steps}",
        "train.log_every=5",
        "train.eval_every=0",
        "train.progress=false",
        "optim.decay_steps=1000",
    ]
    env = _env_without_device_settings()
    with tempfile.TemporaryDirectory() as tmp:
        one, two, free = Path(tmp) / "one", Path(tmp) / "two", Path(tmp) / "free"
        per_array = Path(tmp) / "per_array"
        _run(
            [
                sys.executable,
                "-m",
                "jaxpar",
                *common,
                "mesh.data=1",
                f"train.batch_size={b}",
                f"run.dir={one}",
            ],
            {**env, "JAXPAR_CPUS": "0", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
        )
        _run(
            [
                sys.executable,
                "-m",
                "jaxpar",
                "launch",
                "-n",
                "2",
                "--devices-per-process",
                "1",
                "--cpus-per-process",
                "1",
                "--",
                *common,
                "mesh.data=2",
                f"train.batch_size={2 * b}",
                f"run.dir={two}",
            ],
            env,
        )
        _run(
            [
                sys.executable,
                "-m",
                "jaxpar",
                "launch",
                "-n",
                "2",
                "--devices-per-process",
                "1",
                "--",
                *common,
                "mesh.data=2",
                f"train.batch_size={2 * b}",
                f"run.dir={free}",
            ],
            env,
        )
        _run(_pinned_pair(common, b, per_array, ["train.grad_bucket_mb=0"]), env)
        a, c, f = _throughput(one), _throughput(two), _throughput(free)
        p = _throughput(per_array)
    alone = _probe_one("step", b)
    independent = _probe_pair("step", b, False)
    data_parallel = _probe_pair("step", b, True)
    in_process = _probe_one("step2", b)
    psum = _probe_pair("psum", args.psum_mib, True)
    traced = _probe_pair("trace", b, True)
    solo, shared = _probe_pair("compute", 0, False), _probe_pair("compute", 0, True)
    print(
        f"gpt_tiny, {b} × 128 tokens per process, {steps} steps, examples/s "
        "(median of the logged intervals)"
    )
    print("| run | global batch | examples/s | speed-up |")
    print("|---|---|---|---|")
    print(f"| 1 process, 1 core | {b} | {a:.1f} | 1.00× |")
    print(f"| 2 processes, 1 core each (defaults) | {2 * b} | {c:.1f} | {c / a:.2f}× |")
    print(f"| the same, a reduction per array | {2 * b} | {p:.1f} | {p / a:.2f}× |")
    print(f"| 2 processes, not pinned (2 cores) | {2 * b} | {f:.1f} | {f / a:.2f}× |")
    print(
        f"\nstep time: 1 process {b / a * 1e3:.0f} ms, 2 pinned processes "
        f"{2 * b / c * 1e3:.0f} ms (+{(2 * b / c - b / a) * 1e3:.0f} ms)"
    )
    big, tiny, split = (max(psum[i], psum[i + 3]) for i in range(3))
    print(
        f"bare psum across the 2 pinned processes (gloo), ms per call: {args.psum_mib} MiB "
        f"in one array {big:.1f}; one float {tiny:.1f}; {args.psum_mib} MiB as "
        f"{PSUM_PARTS} arrays {split:.1f}"
    )
    print(
        "data-parallel plain step traced (jax.profiler, 5 steps; process 0 / process 1): "
        + " / ".join(
            f"{t[0]:.0f} ms per step, {t[1]:.0f} ms in all-reduce ops ({t[2]:.0f} "
            f"ops reducing {t[3]:.0f} arrays per step, "
            f"{t[1] / t[3] if t[3] else float('nan'):.1f} ms per array)"
            for t in (traced[:4], traced[4:])
        )
    )
    print(
        "compute-only program, 2 pinned processes, ms per call (core 0 / core 1): "
        f"alone {solo[0]:.0f} / {solo[1]:.0f}; with jax.distributed started "
        f"{shared[0]:.0f} / {shared[1]:.0f} "
        f"({statistics.mean(shared) / statistics.mean(solo):.3f}×)"
    )
    print(
        f"\ntrain step alone, ms (jaxpar's Trainer.step / a plain jax.jit step), {b} rows "
        "per process:"
    )
    print("| processes | jaxpar | plain jax.jit | speed-up (jaxpar) |")
    print("|---|---|---|---|")
    print(f"| 1, core 0, alone | {alone[0]:.0f} | {alone[1]:.0f} | 1.00× |")
    for name, t in (
        ("2 at once, independent (mesh.data=1 each, no communication)", independent),
        ("2, mesh.data=2 (all-reduce over gloo)", data_parallel),
    ):
        ours, plain = max(t[0], t[2]), max(t[1], t[3])
        print(f"| {name} | {ours:.0f} | {plain:.0f} | {2 * alone[0] / ours:.2f}× |")
    print(
        f"| 1 process, 2 devices on cores 0 and 1, mesh.data=2 (in-process all-reduce) | "
        f"{in_process[0]:.0f} | {in_process[1]:.0f} | {2 * alone[0] / in_process[0]:.2f}× |"
    )


if __name__ == "__main__":
    main()
