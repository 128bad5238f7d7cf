"""``jaxpar/lab/kernels.py``: what a step's kernels achieve beside its FLOPs (issue 45,
item 3): matmuls on the roofline of their own shapes under the chip's measured best
(MAMF), and the kernels that are not matmuls timed by the bytes they move."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.lab import hardware
from jaxpar.lab.activations import head_bytes
from jaxpar.lab.families import lab_for
from jaxpar.lab.hardware import Kernels, StepTime, compute_time
from jaxpar.lab.kernels import flops_per_device, kernels, shape_efficiency
from jaxpar.lab.measure import layout_overrides
from jaxpar.lab.pipeline_cost import pipeline_factor
from jaxpar.lab.predict import lab_layout
from jaxpar.lab.terms import Matmul
from jaxpar.pipeline.ticks import tick_table
from jaxpar.run import build


def _run(config: str, layout: str, *more: str):
    return build(load_config([config], [*layout_overrides(layout), *more]), target=(8, "gpu"))


@pytest.mark.parametrize(
    "config,layout",
    [
        ("configs/gpt_tiny.yaml", "data=8"),
        ("configs/gpt_tiny.yaml", "data=4,tensor=2"),
        ("configs/llama_tiny.yaml", "data=2,tensor=4,rules.kv_heads=null"),
        ("configs/llama_tiny.yaml", "data=2,tensor=4"),  # 2 K/V heads held whole
        ("configs/gemma_tiny.yaml", "fsdp=8"),
        ("configs/gpt_tiny.yaml", "data=4,context=2,context.attention=ring"),
    ],
)
def test_the_matmuls_are_the_familys_flops(config, layout):
    """The lab's list of a device's matmuls, each with two of its size in the backward,
    adds up to the FLOPs the model family counts (its own file's formula)."""
    run = _run(config, layout)
    matmuls = lab_for(run.family).matmuls(run.config.model, lab_layout(run, cpu=False))
    assert 3 * sum(m.flops for m in matmuls) == pytest.approx(flops_per_device(run))


def test_a_matmul_on_its_own_roofline():
    """A large square matmul is math-limited (its share is 1); a thin one (m = 1) moves
    its weight for 2 FLOPs an element and runs at FLOPs / (bytes × ridge)."""
    rate, hbm = 312e12 * 0.869, 2.039e12  # A100: achievable FLOP/s, HBM bytes/s
    ridge = rate / hbm
    big = Matmul(4096, 4096, 4096)
    assert shape_efficiency([big], 2, rate, hbm) == 1.0
    thin = Matmul(1, 4096, 4096)
    by_hand = 2 * 4096 * 4096 / ((4096 + 4096 * 4096 + 4096) * 2 * ridge)
    assert shape_efficiency([thin], 2, rate, hbm) == pytest.approx(by_hand)
    both = shape_efficiency([big, thin], 2, rate, hbm)
    time = big.flops + thin.bytes(2) * ridge
    assert both == pytest.approx((big.flops + thin.flops) / time)
    assert shape_efficiency([], 2, rate, hbm) == 1.0


def test_an_fp8_matmul_on_the_fp8_roofline():
    """An FP8 matmul is priced at the FP8 rate with one-byte operands: a thin one's time
    is its bytes over HBM (half a bf16 one's), a big one runs at the FP8 rate; without an
    FP8 rate it is a bf16 matmul."""
    rate, hbm, fp8 = 989e12 * 0.803, 3.35e12, 1979e12 * 0.709  # H100
    thin = Matmul(1, 8192, 8192, fp8=True)
    moved = (8192 + 8192 * 8192) * 1 + 8192 * 2  # FP8 operands, a bfloat16 result
    assert thin.bytes(1, 2) == moved
    by_hand = thin.flops / fp8 / (moved / hbm)
    assert shape_efficiency([thin], 2, rate, hbm, fp8) == pytest.approx(by_hand)
    big = Matmul(8192, 8192, 8192, fp8=True)
    both = shape_efficiency([big, thin], 2, rate, hbm, fp8)
    ideal = (big.flops + thin.flops) / fp8
    assert both == pytest.approx(ideal / (big.flops / fp8 + moved / hbm))
    assert shape_efficiency([thin], 2, rate, hbm) == shape_efficiency(
        [Matmul(1, 8192, 8192)], 2, rate, hbm
    )


def test_matmuls_run_at_the_chips_measured_best():
    """The built-in profiles carry the MAMF table's shares (hardware.yaml); a step's
    matmuls take FLOPs / (peak × share × shape efficiency)."""
    profiles = hardware.load_profiles()
    assert profiles["a100"].matmul_efficiency == pytest.approx(271.2 / 312, abs=1e-3)
    assert profiles["h100"].matmul_efficiency == pytest.approx(794.5 / 989, abs=1e-3)
    assert all(0 < p.matmul_efficiency <= 1 for p in profiles.values())
    a100 = profiles["a100"]
    assert compute_time(a100, 312e12, "bfloat16", Kernels(0.5)) == pytest.approx(2 / 0.869)


def test_other_kernels_add_to_the_matmuls():
    """Memory-bound kernels run between the matmuls: their time adds to the matmuls',
    and the whole step's traffic is still a floor."""
    step = StepTime(1.0, 0.5, 0.25, elementwise_s=0.75)
    assert step.total_s == 2.0 and step.bound == "compute"
    assert StepTime(1.0, 3.0, 0.0, elementwise_s=0.75).total_s == 3.0
    assert StepTime(0.5, 0.0, 0.0, elementwise_s=0.75).bound == "elementwise"
    # the bound is the kernels' sum where it outlasts the step's traffic: named by its part
    step = StepTime(1.0, 1.5, 0.0, elementwise_s=0.9)
    assert step.total_s == pytest.approx(1.9) and step.bound == "compute"


def test_fused_attention_moves_no_scores():
    """cuDNN's flash attention (what ``auto`` runs on a GPU) keeps no [T, T] scores, so
    the other kernels move exactly the scores' passes less: 5 passes (7 under remat) of
    2·b·a·s·S elements a layer."""
    bf16 = ("model.dtype=bfloat16",)
    xla = _run("configs/gpt_tiny.yaml", "data=8", "model.attention=xla", *bf16)
    fused = _run("configs/gpt_tiny.yaml", "data=8", "model.attention=auto", *bf16)
    cfg = xla.config.model
    lab = lab_for(xla.family)
    moved = [lab.elementwise_bytes(r.config.model, lab_layout(r, cpu=False)) for r in (xla, fused)]
    rows = xla.config.train.batch_size // 8
    T, e = xla.data.seq_len, 2
    scores = 5 * cfg.n_layers * e * 2 * rows * cfg.n_heads * T * T
    assert moved[0] - moved[1] == pytest.approx(scores)
    remat = _run(
        "configs/gpt_tiny.yaml", "data=8", "model.attention=auto", "model.remat=full", *bf16
    )
    layout = lab_layout(remat, cpu=False)
    again = lab.elementwise_bytes(remat.config.model, layout)
    head = 5 * head_bytes(remat.config.model, layout, lab.kept)  # not recomputed
    assert again == pytest.approx((moved[1] - head) * 7 / 5 + head)


def test_a_cpu_profile_times_the_step_as_fitted():
    run = _run("configs/gpt_tiny.yaml", "data=8")
    cpu = dataclasses.replace(hardware.get_profile("h100"), platform="cpu")
    assert kernels(run, cpu, "float32") == Kernels()
    on_gpu = kernels(run, hardware.get_profile("h100"), "float32")
    assert on_gpu.elementwise_bytes > 0 and 0 < on_gpu.shape_efficiency <= 1


def test_the_sub_mesh_pipeline_lasts_its_critical_path():
    """1F1B over 2 stages and 2 microbatches, each stage running as its input arrives:
    without recomputation (F 1, B 2) the last backward ends at 9; with it (B 3; the last
    chunk's forward is its backward's: F 0, B 3) at 10, against a device's own work of
    3·2 = 6. In step, ticks priced at their busiest device
    cost more. A head of half a chunk's forward on the last chunk, residuals kept (its
    forward 1.5, its backward 3): stage 1 runs F 1–2.5, B 2.5–5.5, F 5.5–7, B 7–10, then
    stage 0's last backward 10–12, against 3·2·(1 + 0.5/2) = 7.5. Recomputing, the last
    chunk's forward is its backward's (F 0, B 3 + 1.5): stage 1's backwards run 1–5.5 and
    5.5–10, stage 0's last 10–13."""
    table = tick_table("1f1b", 2, 2)
    assert pipeline_factor(table, False, asynchronous=True) == pytest.approx(9 / 6)
    assert pipeline_factor(table, True, asynchronous=True) == pytest.approx(10 / 6)
    assert pipeline_factor(table, False, True, head=0.5) == pytest.approx(12 / 7.5)
    assert pipeline_factor(table, True, True, head=0.5) == pytest.approx(13 / 7.5)
    assert pipeline_factor(table, True) > pipeline_factor(table, True, True)


@pytest.mark.parametrize("value", [0, 1.5, -0.2])
def test_a_matmul_efficiency_outside_its_range_is_one_line(tmp_path, value):
    h100 = hardware.get_profile("h100")
    names = ("name", "flops_bf16", "flops_f32", "hbm_bandwidth", "memory_bytes")
    names += ("link_bandwidth", "links", "network_bandwidth", "collective_latency")
    entry = {f: getattr(h100, f) for f in names} | {"matmul_efficiency": value}
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump({"mine": entry}))
    with pytest.raises(ConfigError) as err:
        hardware.get_profile("mine", path)
    assert str(err.value) == (
        f"hardware profile 'mine': matmul_efficiency={value!r} must be above 0 and at most 1"
    )


def test_fp8_matmuls_run_at_the_chips_fp8_rate():
    """``model.precision=fp8``: the weight matmuls (projections and MLP) run at the FP8
    peak × its MAMF share (the H100's 1,979 TFLOP/s × 0.709), attention's products and the
    head at the bf16 one; a chip without FP8 units (the A100) runs them at bf16's."""
    plain = _run("configs/llama_tiny.yaml", "data=8", "model.dtype=bfloat16")
    fp8 = _run("configs/llama_tiny.yaml", "data=8", "model.dtype=bfloat16", "model.precision=fp8")
    h100 = hardware.get_profile("h100")
    assert kernels(plain, h100, "bfloat16").fp8_share == 0
    share = kernels(fp8, h100, "bfloat16").fp8_share
    matmuls = lab_for(fp8.family).matmuls(fp8.config.model, lab_layout(fp8, cpu=False))
    weights = sum(m.flops for m in matmuls[:4])  # q/k/v, output, the MLP's two
    assert share == pytest.approx(weights / sum(m.flops for m in matmuls))
    assert 0.3 < share < 1
    # each FP8 matmul on the FP8 rate's roofline: not the bf16 one's
    no_fp8 = dataclasses.replace(h100, flops_fp8=0.0)
    shapes = kernels(fp8, h100, "bfloat16").shape_efficiency
    assert shapes != pytest.approx(kernels(fp8, no_fp8, "bfloat16").shape_efficiency)
    rate, hbm = h100.flops_bf16 * h100.matmul_efficiency, h100.hbm_bandwidth
    fp8_rate = h100.flops_fp8 * h100.matmul_efficiency_fp8
    assert shapes == pytest.approx(shape_efficiency(matmuls, 2, rate, hbm, fp8_rate))
    assert compute_time(h100, 1e15, "bfloat16", Kernels(fp8_share=1.0)) == pytest.approx(
        1e15 / (1.979e15 * 0.709)
    )
    half = compute_time(h100, 1e15, "bfloat16", Kernels(fp8_share=0.5))
    assert half == pytest.approx(0.5e15 / (989.4e12 * 0.803) + 0.5e15 / (1.979e15 * 0.709))
    a100 = hardware.get_profile("a100")
    assert a100.flops_fp8 == 0
    assert compute_time(a100, 1e15, "bfloat16", Kernels(fp8_share=1.0)) == pytest.approx(
        compute_time(a100, 1e15, "bfloat16", Kernels())
    )
