"""Sizes checked before anything is built (``jaxpar/plan/sizes.py``): a config whose state
or one step's arrays fit no device, whose sizes overflow the compiler's int64 counts, or
whose pipeline microbatches outnumber the batch's rows is refused in one line within
seconds — exit 2, naming the setting and the size it implies — where it used to hang in
its first step (ignoring SIGTERM), fill the host's memory or abort natively (SIGABRT)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.errors import LayoutError
from jaxpar.plan import sizes
from jaxpar.run import build
from jaxpar.user_code import load_task
from tests.helpers import Child, child_env, grid, kill_all

ROOT = Path(__file__).resolve().parents[1]
HOST = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
TASK = load_task("examples/two_device_mlp.py:TASK")
#: seconds a refusal may take in a child (it starts JAX: ~2 s alone, more beside the others)
BOUND = 45

# each case: the command's arguments, then what its one line must hold. All start at once
# (a module fixture), so the file takes about as long as the slowest.
CASES = {
    # the project's own config, trained on one CPU device as a new user would
    "mixtral_one_cpu": (
        ["train", "configs/mixtral_8x7b.yaml", "--devices", "1"],
        [
            "the train state needs 560 GB in all",
            "this host's memory",
            "model.d_ff=14336",
            "choose a smaller model",
        ],
    ),
    "experts": (
        ["train", "configs/llama_tiny.yaml", "model.n_experts=1000000000"],
        ["more than any device holds", "from model.n_experts=1000000000", "lower model.n_experts"],
    ),
    "vocab": (
        ["train", "model.vocab_size=1000000000000"],
        [
            "the train state needs 3.07 PB per device",
            "embed [1000000000000, 128]",
            "lower model.vocab_size",
        ],
    ),
    "positions": (
        ["train", "model.max_seq_len=1000000000"],
        ["pos [1000000000, 128] from model.max_seq_len=1000000000"],
    ),
    # was a native abort of the compiler ("overflow in static extent product")
    "inspect_width": (
        ["inspect", "model.d_model=1000000000", "model.n_heads=1"],
        ["192 EB per device", "lower model.d_model"],
    ),
    # beyond int64: no array dim at all
    "beyond_int64": (
        ["inspect", "model.vocab_size=10000000000000000000"],
        ["model.vocab_size=10000000000000000000 is larger than any array dim"],
    ),
    # grew memory past 6 GB building a tick table of 10^9 microbatches
    "mpmd_microbatches": (
        [
            "train",
            "mesh.stage=2",
            "mesh.data=4",
            "rules.layers=stage",
            "pipeline.executor=mpmd",
            "pipeline.microbatches=1000000000",
        ],
        [
            (
                "pipeline.microbatches=1000000000 × train.grad_accum=1 = "
                "1000000000 microbatches, more than one step's "
                "train.batch_size=32 rows"
            ),
            "set pipeline.microbatches=32",
        ],
    ),
    # activations: was "internal error … Out of memory allocating 6516358998584 bytes"
    "attention": (
        [
            "train",
            "data.dataset=synthetic",
            "train.batch_size=512",
            "data.seq_len=8192",
            "model.max_seq_len=8192",
        ],
        [
            ("one train step computes float32[512,4,8192,1,8192] (550 GB, a dot_general output"),
            "from data.seq_len=8192",
            "lower train.batch_size",
        ],
    ),
}
#: bytes a case needs of this host's memory (a host with as much runs it)
NEEDS = {"mixtral_one_cpu": 560e9, "positions": 12.3e12, "attention": 550e9}


# Mixtral-8x7B on one CPU device (the slowest child: it builds a 32-layer model's abstract
# state) is refused by the same check as `positions`, the state summed over the CPU
# devices that share this host's memory, the setting it follows from named: `exhaustive`.
# So is `experts`: `train` of a state above what any device holds, named by the setting
# its largest parameter's largest dim equals — `vocab` keeps that refusal (the same
# `sizes.check_state` branch and message, from model.vocab_size).
SUITE = set(CASES) - {"mixtral_one_cpu", "experts"}


@pytest.fixture(scope="module")
def refused(request, tmp_path_factory):
    """The child of each case this session runs, started together: {case: Child}."""
    selected = {
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module
        and hasattr(item, "callspec")
        and "case" in item.callspec.params
    }
    root = tmp_path_factory.mktemp("sizes")
    children = {}
    for case, (args, _) in CASES.items():
        if case not in selected:
            continue
        run_dir = [f"run.dir={root / case}"] if args[0] == "train" else []
        children[case] = Child(
            subprocess.Popen(
                [sys.executable, "-m", "jaxpar", *args, *run_dir],
                cwd=ROOT,
                env=child_env(8),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    yield children
    kill_all(child.proc for child in children.values())


@pytest.mark.parametrize("case", grid([pytest.param(case, id=case) for case in CASES], SUITE))
def test_a_size_no_device_holds_is_refused_in_one_line_within_seconds(refused, case):
    if HOST >= NEEDS.get(case, float("inf")):
        pytest.skip(f"this host has the memory {case} needs")
    child = refused[case]
    _, err, elapsed = child.ended(case, 60)  # elapsed: from its start to its own exit
    proc = child.proc
    lines = [
        line for line in err.splitlines() if line.strip() and not line.startswith("jaxpar: warning")
    ]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("jaxpar: error: "), err
    for part in CASES[case][1]:
        assert part in lines[0], lines[0]
    assert elapsed < BOUND, f"{case}: refused after {elapsed:.0f} s"


def _wide(rngs: nnx.Rngs, width: int) -> nnx.Sequential:
    return nnx.Sequential(
        nnx.Linear(784, width, rngs=rngs), nnx.relu, nnx.Linear(width, 10, rngs=rngs)
    )


@pytest.mark.filterwarnings("ignore:4 parameters carry no logical axes")
def test_a_user_task_is_checked_from_its_abstract_state():
    """Any model, not only the families: a task's parameter that no device holds is named
    with its path and shape (its sizes are no config key) — before a byte is allocated."""
    wide = dataclasses.replace(TASK, model_fn=lambda rngs: _wide(rngs, 2**40))
    with pytest.raises(
        LayoutError,
        match=r"more than any device holds .*its largest "
        r"parameter is layers/0/kernel \[784, 1099511627776\]; choose a "
        r"smaller model$",
    ):
        build(load_config([], ["train.batch_size=16"]), wide)


def test_the_memory_is_this_hosts_on_the_cpu_and_each_devices_elsewhere():
    """On the CPU the simulated devices share the host's memory, so their states add up;
    a device with its own memory is asked for enough devices to shard the state over."""
    run = build(load_config([], ["train.batch_size=16", "mesh.data=8"]), TASK)
    memory = sizes.device_memory(run.devices)
    assert memory == sizes.Memory(
        HOST, True, f"this host's memory ({sizes.size(HOST)}, shared by its 8 CPU devices)"
    )
    per_device = run.plan.state_bytes().total
    host = sizes.Memory(8 * per_device - 1, True, "this host's memory (tiny)")
    with pytest.raises(
        LayoutError,
        match=r"needs .* in all \(per device: .*\), more than "
        r"this host's memory \(tiny\).* train it on accelerators",
    ):
        sizes.check_state(run.plan, host, {})
    sizes.check_state(run.plan, dataclasses.replace(host, bytes=8 * per_device), {})
    gpu = sizes.Memory(per_device - 1, False, "a GPU's memory")
    with pytest.raises(
        LayoutError,
        match=r"per device \(.*\), more than a GPU's memory; .*"
        r"shard it over at least 2 such devices",
    ):
        sizes.check_state(run.plan, gpu, {})
