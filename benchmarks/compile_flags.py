"""What the test suite's compiler flags save: XLA:CPU compile time of real train steps.

    python benchmarks/compile_flags.py

The suite compiles with ``--xla_backend_optimization_level=0`` (set here too, as in
``tests/conftest.py``) and, where the jaxlib has it, ``xla_cpu_use_fusion_emitters=false``
(XLA:CPU's older elemental fusion code generator). This lowers the train step of three
layouts (8 simulated CPU devices, persistent compilation cache off, the backend warmed up
by a trivial compile first) and compiles each lowered program twice in one process, with
the option on (XLA's default) and off. Printed: process CPU seconds of ``Lowered.compile``
per layout and setting, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "gpt_tiny stage=4 zb_h1": [
        "mesh.stage=4",
        "pipeline.schedule=zb_h1",
        "pipeline.microbatches=8",
    ],
    "gpt_tiny data=4 tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "bert_tiny fsdp=8": ["configs/bert_tiny.yaml", "mesh.fsdp=8"],
}
OPTION = "xla_cpu_use_fusion_emitters"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    )
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import jax

    from jaxpar import build, load_config

    jax.jit(lambda x: x + 1)(1.0).block_until_ready()
    print(f"| layout | compile, {OPTION}=true (s CPU) | =false | ratio |")
    print("|---|---|---|---|")
    for name, args in LAYOUTS.items():
        files = [a for a in args if a.endswith(".yaml")]
        run = build(load_config(files, [a for a in args if a not in files]))
        lowered = run.trainer.lower_step(run.data.batch(0, run.config.train.batch_size))
        seconds = {}
        for value in (True, False):
            start = time.process_time()
            try:
                lowered.compile(compiler_options={OPTION: value})
            except Exception as err:  # a jaxlib without the option (0.12 removed it)
                sys.exit(f"this jaxlib has no {OPTION}: {err}")
            seconds[value] = time.process_time() - start
        print(
            f"| {name} | {seconds[True]:.1f} | {seconds[False]:.1f} | "
            f"{seconds[False] / seconds[True]:.2f} |"
        )


if __name__ == "__main__":
    main()
