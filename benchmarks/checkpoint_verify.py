"""What verifying a checkpoint costs at restore: restore time with and without it.

    python benchmarks/checkpoint_verify.py [--d-model 512] [--layers 8] [--repeats 3] [--cold]

Saves one checkpoint of a GPT (parameters and AdamW state) on 8 simulated CPU devices,
then restores it ``--repeats`` times with ``checkpoint.verify`` on and off, and prints
the checkpoint's size, the time to hash it (SHA-256 of every file) and both restore
times. ``--cold`` drops the page cache before each restore (needs root and a writable
``/proc/sys/vm/drop_caches``): verification then reads the files from disk and the
restore finds them in the cache, so the disk is still read once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

from jaxpar import build, integrity, load_config
from jaxpar.checkpoint import Checkpointer


def _drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    cfg = load_config(
        [],
        [
            f"model.d_model={args.d_model}",
            f"model.n_layers={args.layers}",
            f"model.d_ff={4 * args.d_model}",
            "model.n_heads=8",
            "mesh.data=1",
            "mesh.fsdp=8",
        ],
    )
    run = build(cfg)
    state = run.trainer.init()
    jax.block_until_ready(state)
    root = Path(args.dir or tempfile.mkdtemp(prefix="jaxpar-verify-"))
    shutil.rmtree(root / "ckpt", ignore_errors=True)
    ckpt = Checkpointer(root / "ckpt", run.plan, async_save=False)
    ckpt.save(1, state, {"step": 1})
    ckpt.close()
    step_dir = root / "ckpt" / "1"
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    print(
        f"checkpoint: {size / 2**20:.1f} MiB in {sum(1 for _ in step_dir.rglob('*'))} "
        f"entries ({jax.device_count()} devices, {os.cpu_count()} CPU cores)"
    )
    if args.cold and not _drop_caches():
        print("cannot drop the page cache here: measuring with a warm cache")
        args.cold = False
    times: dict[str, list[float]] = {"hash only": [], "verify on": [], "verify off": []}
    for _ in range(args.repeats):
        for what, values in times.items():
            if args.cold:
                _drop_caches()
            start = time.perf_counter()
            if what == "hash only":
                result = integrity.verify(step_dir)
                assert result.ok, result.problems
            else:
                reader = Checkpointer(root / "ckpt", run.plan, verify=what == "verify on")
                restored, _ = reader.restore(1)
                jax.block_until_ready(restored)
                reader.close()
            values.append(time.perf_counter() - start)
    cache = "cold" if args.cold else "warm"
    for what, values in times.items():
        best, median = min(values), statistics.median(values)
        rate = f", {size / best / 2**30:.2f} GiB/s" if what == "hash only" else ""
        print(f"{what:>10}: median {median:.3f} s, best {best:.3f} s ({cache} page cache{rate})")
    extra = statistics.median(times["verify on"]) - statistics.median(times["verify off"])
    print(
        f"verification adds {extra:.3f} s to a restore of {size / 2**20:.0f} MiB "
        f"({extra / max(statistics.median(times['verify off']), 1e-9):.0%})"
    )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
