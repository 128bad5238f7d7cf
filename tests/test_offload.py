"""Host offload: the named ``model.remat`` policies (residuals saved on the device or
offloaded to pinned host memory) and ``train.optimizer_offload`` (the optimizer state in
pinned host memory between steps) train exactly as one device does, place what they say
where they say, resume bitwise, and refuse what they cannot do in one line.

XLA:CPU shares one RAM between ``device`` and ``pinned_host`` and lowers a
``device_put`` between memory kinds inside a program to nothing: the placements are
asserted on the traced program, on the compiled program's entry layout (``S(5)``: host
memory space) and on the arrays, and the CUDA lowering of the same step is asserted to
annotate the transfers. The device-memory saving is a GPU's to measure.
"""

import dataclasses
import json
import re
from typing import get_args

import jax
import numpy as np
import optax
import pytest
from jax import export

from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.gradients import AccumulatedPerDataShard
from jaxpar.lab import hardware
from jaxpar.lab.measure import measure
from jaxpar.models.transformer import REMAT_POLICIES, Remat
from jaxpar.run import build
from jaxpar.user_code import load_task
from tests.helpers import GPT_SMALL, assert_params_close, grid, one_device_steps, run_steps
from tests.test_gemma import GEMMA
from tests.test_llama import LLAMA

GPT = [*GPT_SMALL, "optim.name=adamw", "optim.weight_decay=0.1", "optim.clip_norm=1.0"]
FAMILIES = {"gpt": GPT, "llama": LLAMA}
MESHES = {
    "data8": ["mesh.data=8"],
    "data2-fsdp2-tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}
NEW_REMAT = ["save_qkv", "save_out", "save_matmuls", "save_matmuls_context", "offload"]


def test_every_remat_choice_has_a_policy():
    """The config's choices are the policies' keys (and ``none``)."""
    assert set(get_args(Remat)) == {"none", *REMAT_POLICIES}
    assert set(NEW_REMAT) < set(REMAT_POLICIES)


BOTH = ["train.optimizer_offload=true", "model.remat=offload"]
#: per mesh, the variants trained: on ``data8`` the two offloads, alone and together; on
#: data × fsdp × tensor the choices that keep their residuals on the device, and both
#: offloads together
VARIANTS = {
    "data8": {"optimizer": BOTH[:1], "remat": BOTH[1:], "both": BOTH},
    "data2-fsdp2-tensor2": {
        **{r: [f"model.remat={r}"] for r in NEW_REMAT if r != "offload"},
        "both": BOTH,
    },
}


@pytest.mark.parametrize(
    "family,mesh,variant",
    grid(
        [
            pytest.param(f, m, v, id=f"{f}-{m}-{v}")
            for f in FAMILIES
            for m in MESHES
            for v in VARIANTS[m]
        ],
        # all extended. The suite keeps the mechanism in test_offload_through_a_pipeline:
        # both offloads equal one device there, the named residuals offloaded by the same
        # jax.checkpoint policy in the same layer scan (GPT.run_blocks, inside a stage or
        # not: no pipeline code touches remat) and the optimizer state moved by the same
        # jaxpar.update.Update, which every strategy's step runs. save_matmuls keeps on the
        # device what offload moves: on XLA:CPU, which drops the moves, the same numbers, and
        # test_remat_offload_moves_the_named_residuals_to_the_host traces both; save_qkv,
        # save_out and save_matmuls_context are the same policy of other names
        # (tests/test_ulysses.py's suite compiles save_matmuls_context's step); the sharded
        # optimizer state held on the host over data × fsdp × tensor: trained and restored
        # in test_offloaded_run_resumes_bitwise (heavy: every CI, right after the suite).
        # The Llama's offloaded names: their own test below
        set(),
    ),
)
def test_host_offload_equals_one_device(family, mesh, variant):
    """Every new remat choice and the optimizer state offloaded: losses of 3 AdamW steps
    and the final parameters equal one device's without either (:data:`VARIANTS`)."""
    base = FAMILIES[family]
    one = one_device_steps(base)
    losses, params, _ = run_steps([*base, *MESHES[mesh], *VARIANTS[mesh][variant]])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5, err_msg=variant)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


@pytest.mark.exhaustive  # the same mechanism as GPT's and Llama's, in the extended tier
def test_gemma_offloads_as_one_device():
    """Gemma takes the same choices: both offloads on data × fsdp × tensor equal one
    device."""
    one = one_device_steps(GEMMA)
    offload = ["model.remat=offload", "train.optimizer_offload=true"]
    losses, params, _ = run_steps([*GEMMA, *MESHES["data2-fsdp2-tensor2"], *offload])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


def test_offload_through_a_pipeline():
    """With two pipeline stages (spmd executor) both offloads train as one device
    accumulating the same 4 microbatches (the mpmd executor refuses the optimizer's:
    :func:`test_bad_combinations_are_one_line`)."""
    one = one_device_steps([*GPT, "train.grad_accum=4"])
    stages = ["mesh.data=4", "mesh.stage=2", "pipeline.executor=spmd"]
    extra = ["pipeline.microbatches=4", "model.remat=offload", "train.optimizer_offload=true"]
    losses, params, _ = run_steps([*GPT, *stages, *extra])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


def _puts(jaxpr, memory: str) -> list[str]:
    """Shapes of the ``device_put``s into ``memory`` (``<host>`` or ``""``: the device)
    in a jaxpr, nested ones included."""
    return re.findall(rf"\w+:f32{memory}(\[[\d,]*\]) = device_put", str(jaxpr))


def _rows(run, batch: int) -> int:
    """The rows a traced residual has: the whole batch, or one data shard's where the
    step runs per data shard (gradient buckets: ``train.grad_bucket_mb=auto`` on the CPU)."""
    per_shard = isinstance(run.plan.gradients, AccumulatedPerDataShard)
    return batch // run.plan.mesh.shape["data"] if per_shard else batch


def test_remat_offload_moves_the_named_residuals_to_the_host():
    """The step's traced program moves the residuals the backward reads of the named
    projections to host memory and back: q/k/v [B, T, 3, N, H], the attention output
    [B, T, D] and the MLP's input projection [B, T, F] (GPT's MLP output is no residual:
    the block's output is the next block's saved input); ``save_matmuls`` keeps the same
    on the device. The CUDA lowering of the same step annotates the pinned-host
    placements (XLA's host offloader turns them into copies on a GPU; XLA:CPU drops
    them). B: the batch, or one data shard's rows where the step runs per shard."""
    moved = {}
    for remat in ("save_matmuls", "offload"):
        run = build(load_config([], [*GPT, "mesh.data=8", f"model.remat={remat}"]))
        state = run.trainer.init()
        batch = run.trainer.shard_batch(run.data.batch(0, 16))
        jaxpr = jax.make_jaxpr(run.trainer._step)(state, batch)
        moved[remat] = (_puts(jaxpr, "<host>"), _puts(jaxpr, ""))
    b = _rows(run, 16)  # T=16, N=4, H=8, D=32, F=64
    shapes = [f"[{b},16,3,4,8]", f"[{b},16,32]", f"[{b},16,64]"]
    assert moved == {"save_matmuls": ([], []), "offload": (shapes, shapes)}
    cuda = export.export(run.trainer._step, platforms=["cuda"])(state, batch).mlir_module()
    placed = re.findall(r'_xla_buffer_placement = "(\w+)"', cuda)
    assert placed.count("pinned_host") == 3


@pytest.mark.parametrize(
    "family,moved",
    [
        # q [B, T, N, H], k and v [B, T, K, H], attention output, gate and up projections
        ("llama", ["[B,16,4,8]", "[B,16,2,8]", "[B,16,2,8]", "[B,16,32]", *["[B,16,48]"] * 2]),
        # the same, and the MLP output, which Gemma's post-MLP norm reads (head dim 16)
        (
            "gemma",
            [
                "[B,16,4,16]",
                *["[B,16,2,16]"] * 2,
                "[B,16,32]",
                *["[B,16,48]"] * 2,
                "[B,16,32]",
            ],
        ),
    ],
)
def test_the_llama_and_gemma_projections_are_offloaded(family, moved):
    """Each layer scan of the Llama (one) and of Gemma (three here: it scans each run of
    layers of one kind apart) moves its named projections to host memory."""
    base = {"llama": LLAMA, "gemma": GEMMA}[family]
    run = build(load_config([], [*base, "mesh.data=8", "model.remat=offload"]))
    state = run.trainer.init()
    batch = run.trainer.shard_batch(run.data.batch(0, 16))
    scans = 1 if family == "llama" else 3
    moved = [m.replace("B", str(_rows(run, 16))) for m in moved]
    assert _puts(jax.make_jaxpr(run.trainer._step)(state, batch), "<host>") == moved * scans


def test_optimizer_state_lives_in_pinned_host_memory():
    """Between steps every optimizer-state leaf is in ``pinned_host`` (the parameters on
    the device); the compiled step takes and returns them in host memory space
    ``S(5)``; the plan counts them as host bytes, not device bytes."""
    run = build(load_config([], [*GPT, "mesh.data=8", "train.optimizer_offload=true"]))
    state = run.trainer.init()
    batch = run.trainer.shard_batch(run.data.batch(0, 16))
    text = run.trainer.compile_step(batch).as_text()
    state, _ = run.trainer.step(state, batch)
    opt = jax.tree.leaves(state.opt_state)
    assert {x.sharding.memory_kind for x in opt} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    entry = re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1)
    assert entry.count("S(5)") == len(opt)
    on_device = build(load_config([], [*GPT, "mesh.data=8"])).plan.state_bytes()
    held = run.plan.state_bytes()
    assert held.host == held.opt_state == on_device.opt_state > 0
    assert held.total == on_device.total - on_device.opt_state


RESUME = [
    *GPT,
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "model.remat=offload",
    "train.optimizer_offload=true",
    "optim.schedule=cosine",
    "optim.decay_steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "checkpoint.every_steps=2",
]


def _losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _final(run_dir) -> list[np.ndarray]:
    run = build(load_config([], [*RESUME, "train.steps=4"]))
    ckpt = Checkpointer(run_dir / "checkpoints", run.plan)
    state, meta = ckpt.restore()
    ckpt.close()
    assert meta["step"] == 4
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.heavy  # 14 s: three runs of the command
def test_offloaded_run_resumes_bitwise(tmp_path):
    """4 steps straight vs 2 steps, then a resume for 2 more: the same losses and
    state, bit for bit; the restored optimizer state is in pinned host memory."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *RESUME, "train.steps=4", f"run.dir={straight}"]) == 0
    assert main(["train", *RESUME, "train.steps=2", f"run.dir={resumed}"]) == 0
    assert main(["train", *RESUME, "train.steps=4", f"run.dir={resumed}"]) == 0
    assert _losses(resumed) == _losses(straight)
    assert [s for s, _ in _losses(resumed)] == [1, 2, 3, 4]
    for a, b in zip(_final(straight), _final(resumed)):
        np.testing.assert_array_equal(a, b)


def test_bad_combinations_are_one_line():
    """The sub-mesh pipeline executor cannot hold the optimizer state on the host; an
    unknown remat choice names the choices."""
    stages = ["mesh.data=4", "mesh.stage=2", "pipeline.executor=mpmd", "pipeline.microbatches=4"]
    with pytest.raises(ConfigError) as err:
        build(load_config([], [*GPT, *stages, "train.optimizer_offload=true"]))
    text = str(err.value)
    assert "\n" not in text and "train.optimizer_offload" in text and "executor=spmd" in text
    with pytest.raises(ConfigError) as err:
        load_config([], [*GPT, "model.remat=offloaded"])
    assert "\n" not in str(err.value) and "offload" in str(err.value)


def test_the_lab_counts_an_offloaded_optimizer_state_as_host_memory():
    """The lab's row of a layout with the optimizer state offloaded: its device memory
    (compiled, and predicted from the shardings) is the same layout's less the optimizer
    state, which it reports as host memory."""
    config = load_config([], GPT)
    h100 = hardware.get_profile("h100")
    kept = measure(config, "data=8", h100)
    offloaded = measure(config, "data=8,train.optimizer_offload=true", h100)
    assert kept.ok and offloaded.ok, (kept.error, offloaded.error)
    opt_bytes = build(load_config([], [*GPT, "mesh.data=8"])).plan.state_bytes().opt_state
    assert (kept.mem_host_bytes, offloaded.mem_host_bytes) == (0, opt_bytes)
    assert offloaded.mem_args_bytes == kept.mem_args_bytes - opt_bytes
    assert offloaded.mem_total_bytes == kept.mem_total_bytes - opt_bytes
    assert offloaded.predicted_mem_args_bytes == kept.predicted_mem_args_bytes - opt_bytes
    assert offloaded.mem_args_bytes == pytest.approx(offloaded.predicted_mem_args_bytes, rel=0.01)


def test_eval_params_read_an_offloaded_optimizer_state():
    """A schedule-free optimizer's evaluation parameters (``Task.eval_params``) come from
    its state: offloaded to the host, the evaluation is the same to the last bit."""
    task = dataclasses.replace(
        load_task("examples/research_cnn.py:TASK"),
        eval_params=optax.contrib.schedule_free_eval_params,
    )
    results = []
    for offload in ("false", "true"):
        config = load_config([], ["mesh.data=8", f"train.optimizer_offload={offload}"])
        run = build(config, task, optax.contrib.schedule_free_adamw(0.05, b1=0.5))
        state = run.trainer.init()
        for step in range(2):
            batch = run.trainer.shard_batch(run.data.batch(step, 16))
            state, _ = run.trainer.step(state, batch)
        held_out = run.trainer.shard_batch(run.data.batch(0, 16, "eval"))
        results.append(float(run.trainer.evaluate(state, held_out)["loss"]))
    assert results[0] == results[1]
