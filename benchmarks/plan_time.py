"""How long `jaxpar plan` takes for gpt_tiny over 8 devices, and what each speed-up saves.

    python benchmarks/plan_time.py                 # the command itself, wall and CPU seconds
    python benchmarks/plan_time.py --compare       # + each way of measuring the layouts
    python benchmarks/plan_time.py --compare --check   # + the figures of both compile settings
    python benchmarks/plan_time.py --rank DIR/sweep.csv    # the ranking against measured steps
    python benchmarks/plan_time.py --cluster       # Llama-3-70B on 1,024 GPUs, estimated

``--cluster`` times ``jaxpar plan configs/llama3_70b.yaml train.batch_size=1024 --devices
1024`` in a fresh process: every layout estimated from the model's shape
(:mod:`jaxpar.lab.analytic`), nothing compiled (issue 45's goal: a minute).

The command (``jaxpar plan configs/gpt_tiny.yaml --devices 8 --hardware h100``) runs in a
fresh process, without a persistent compilation cache, then a second time with one
(``JAX_COMPILATION_CACHE_DIR`` set: what a repeated plan costs). ``--compare`` measures the
default layouts in a fresh process each way:

* ``one at a time, XLA defaults`` — how the plan measured before: lower, compile, read;
* ``one at a time, analysis options`` — the same with :func:`jaxpar.lab.measure.analysis_options`;
* ``threads`` — lowering here while a pool of threads compiles;
* ``processes`` — worker processes (what ``jaxpar plan`` does for a built-in model).

The layouts are those of the plan less any on which XLA aborts (found by the processes'
run first: the others would die with it). ``--check`` compares the figures read with XLA's
defaults and with the analysis options, layout by layout. Printed: wall and CPU seconds
(this process's children, so all the workers' compiling counts) and the load average,
since the machine may be shared: compare figures taken at the same load.

``--rank`` reads a ``sweep.csv`` whose steps were timed (``jaxpar sweep … --steps N``) and
prints the Spearman rank correlation between the measured step times and the predicted
ones (the plan's roofline, in the same file), with and without the latency term: how well
the plan orders layouts on the machine that measured them. A CPU's steps are not a GPU's:
8 simulated devices share its cores, so sharding saves no compute there and a pipeline's
bubbles cost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["jaxpar", "plan", "configs/gpt_tiny.yaml", "--devices", "8", "--hardware", "h100"]
WAYS = {
    "one at a time, XLA defaults": "defaults",
    "one at a time, analysis options": "one",
    "threads": "threads",
    "processes": "processes",
}

CHILD = """
import json, sys, time
from jaxpar.mesh import setup_devices
setup_devices(8)
from jaxpar.config import load_config
from jaxpar.lab import hardware, measure, sweep, workers
way, skip = sys.argv[1], set(json.loads(sys.argv[2]))
config, hw = load_config(["configs/gpt_tiny.yaml"], []), hardware.get_profile("h100")
layouts = [x for x in sweep.default_layouts(config, 8)[0] if x not in skip]
start = time.perf_counter()
if way == "defaults":
    rows = []
    for layout in layouts:
        lowered = measure.lower(config, layout, hw)
        if isinstance(lowered, measure.Row):
            rows.append(lowered)
            continue
        begun = time.perf_counter()
        compiled = lowered.step.compile()
        rows.append(measure.read(lowered, compiled, time.perf_counter() - begun, hw))
elif way == "one":
    rows = [measure.measure(config, layout, hw) for layout in layouts]
else:
    rows = workers.measure_all(config, layouts, hw, processes=way == "processes")
wall = time.perf_counter() - start
print(json.dumps({"wall": wall, "rows": {r.layout: [r.error, r.mem_args_bytes, r.mem_temp_bytes,
    r.mem_total_bytes, r.flops, r.comm_bytes, r.collective_ops] for r in rows}}))
"""


def _env(cache: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("XLA_FLAGS", None)  # jaxpar's own device count and compile settings only
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds of the process and its children, and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"{' '.join(argv[:3])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def command_times() -> None:
    wall, cpu, out = _timed(COMMAND, _env())
    top = [line for line in out.splitlines() if line.startswith("fastest")]
    print(f"`{' '.join(COMMAND)}`: {wall:.1f} s wall, {cpu:.1f} s CPU ({_load()}); {top[0]}")
    with tempfile.TemporaryDirectory() as cache:
        _timed(COMMAND, _env(cache))
        wall, cpu, _ = _timed(COMMAND, _env(cache))
    print(
        f"again with a persistent compilation cache: {wall:.1f} s wall, {cpu:.1f} s CPU ({_load()})"
    )


def compare(check: bool) -> None:
    results, skip = {}, []
    for name, way in sorted(WAYS.items(), key=lambda kv: kv[1] != "processes"):
        wall, cpu, out = _timed([sys.executable, "-c", CHILD, way, json.dumps(skip)], _env())
        found = json.loads(out.splitlines()[-1])
        if way == "processes":  # the layouts XLA aborts on would take the others down
            skip = [x for x, r in found["rows"].items() if "aborted" in r[0]]
            found["rows"] = {x: r for x, r in found["rows"].items() if x not in skip}
        results[name] = found
        print(
            f"| {name} | {len(found['rows'])} | {found['wall']:.1f} | {cpu:.1f} | {_load()} |",
            flush=True,
        )
        if way == "processes" and skip:
            print(f"(left out of every way: {', '.join(skip)}, on which XLA aborts)")
    if check:
        _check(results["one at a time, XLA defaults"]["rows"], results["processes"]["rows"])


def _check(defaults: dict, fast: dict) -> None:
    """Per layout: what the analysis options change in the figures read."""
    names = ["args", "temp", "total", "flops", "comm bytes", "collectives"]
    changed = {}
    for layout, row in defaults.items():
        for name, a, b in zip(names, row[1:], fast[layout][1:]):
            if a != b:
                changed.setdefault(name, []).append(abs(b - a) / a if a else float("inf"))
    same = [n for n in names if n not in changed]
    print(f"same under both settings in all {len(defaults)} layouts: {', '.join(same)}")
    for name, diffs in changed.items():
        print(f"{name}: differs in {len(diffs)} layouts, by at most {max(diffs):.2e} (relative)")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's ρ: scipy's where installed, else the Pearson correlation of average ranks."""
    try:
        from scipy.stats import spearmanr
    except ImportError:
        import numpy as np

        def ranks(x: list[float]) -> np.ndarray:
            x = np.asarray(x, float)
            r = np.empty(len(x))
            r[np.argsort(x, kind="stable")] = np.arange(len(x))
            return np.array([r[x == v].mean() for v in x])  # ties share their mean rank

        return float(np.corrcoef(ranks(a), ranks(b))[0, 1])
    return float(spearmanr(a, b).statistic)


def rank(csv_path: str) -> None:
    import csv

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["step_time_s"] and r["predicted_step_time_s"]]
    measured = [float(r["step_time_s"]) for r in rows]
    predicted = [float(r["predicted_step_time_s"]) for r in rows]
    bytes_only = [p - float(r["predicted_latency_s"] or 0) for p, r in zip(predicted, rows)]
    print(
        f"{len(rows)} layouts with a measured step ({csv_path}); Spearman ρ, measured vs "
        f"predicted: {spearman(measured, predicted):.3f} (without the latency term: "
        f"{spearman(measured, bytes_only):.3f})"
    )
    order = sorted(rows, key=lambda r: float(r["step_time_s"]))
    print(
        "fastest measured: "
        + ", ".join(f"{r['layout']} {float(r['step_time_s']):.3f} s" for r in order[:5])
    )


CLUSTER = [
    sys.executable,
    "-m",
    "jaxpar",
    "plan",
    "configs/llama3_70b.yaml",
    "train.batch_size=1024",
    "--devices",
    "1024",
]


def cluster_time() -> None:
    wall, cpu, out = _timed(CLUSTER, _env())
    counts = [line for line in out.splitlines() if line.startswith("estimating")]
    top = [line for line in out.splitlines() if line.startswith("fastest")]
    print(
        f"`{' '.join(CLUSTER[2:])}`: {wall:.1f} s wall, {cpu:.1f} s CPU ({_load()}); "
        f"{'; '.join(counts)}; {top[0]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", action="store_true", help="time each way of measuring")
    parser.add_argument("--check", action="store_true", help="with --compare: the figures")
    parser.add_argument("--rank", metavar="SWEEP_CSV", help="only: rank correlation of a sweep")
    parser.add_argument("--cluster", action="store_true", help="only: a 1,024-GPU plan")
    args = parser.parse_args()
    if args.rank:
        return rank(args.rank)
    if args.cluster:
        return cluster_time()
    command_times()
    if args.compare:
        print("| way | layouts | wall s (measuring) | CPU s (process) | |\n|---|---|---|---|---|")
        compare(args.check)


if __name__ == "__main__":
    main()
