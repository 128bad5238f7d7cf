"""``benchmarks/published.py``: the planner's estimates against published training
measurements (issue 45, item 4; the table and its reading: ``docs/published.md``).

The goal is a prediction within ±20% of each published figure. These tests hold the rows
that reach it to it, and state how far the others are today, so that a change that moves
them is seen:

* the unit conversions reproduce the sources' own arithmetic (Megatron-LM SC'21 Eq. (3)
  and Table 2's training days, MaxText's TFLOP count, NeMo's tokens per second);
* Megatron's 2021 attention is priced as it ran, its [s, s] scores written and read back
  (``model.attention=xla``), the others' fused kernels keeping none;
* Megatron's dropout (0.1 of the hidden states and of the attention probabilities, its
  2021 defaults) is priced as the masks jaxpar's GPT keeps;
* rows within the goal (0.8–1.2× the published figure): Table 1's 1.7B, 7.5B (since
  collectives are priced at the share of NVLink that NCCL reaches), 18.4B, 39.1B and 1T,
  its interleaved 76.1B, 145.6B, 310.1B and 529.6B (on the sub-mesh executor: a program
  per stage, each action as its input arrives, as Megatron's stages run), Table 2's PTD-P
  175B on 384 GPUs and 530B on 560 GPUs, MaxText's Llama 2 7B on 1, 2 and 4 A3 VMs of 8
  H100s (its ``minimal_flash`` recomputation as ``model.remat=save_matmuls_context``,
  which fits in 80 GB as the runs did), NeMo's FP8 Llama 2 7B on 8 H100s (the suite
  predicts rows of each family; Table 1's 145.6B, 310.1B, 529.6B and 1T and Table 2's 530B
  are in the extended tier: :data:`SUITE`);
* rows outside it, in today's band: MaxText over 16 A3 VMs (1.2–1.35×: the planner hides
  the gradient all-reduce over the VMs, where MaxText's steps grew by about its whole
  time); ZeRO-3's
  175B on 384 GPUs (1.7–2.1×: DeepSpeed's 2021 parameter gathers took far longer than
  NCCL's bandwidth allows, and the planner overlaps them);
* the order of ZeRO-3 and PTD-P at equal GPUs, which the planner gets wrong today.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import grid

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "published_benchmark", ROOT / "benchmarks" / "published.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


P = _benchmark()
ENTRIES = {e["name"]: e for e in P.load()}
#: rows the planner predicts within the goal, 0.8–1.2× the published figure
WITHIN = [
    "megatron_sc21_table1_1p7b",
    "megatron_sc21_table1_7p5b",
    "megatron_sc21_table1_18p4b",
    "megatron_sc21_table1_39p1b",
    "megatron_sc21_table1_76p1b",
    "megatron_sc21_table1_145p6b",
    "megatron_sc21_table1_310p1b",
    "megatron_sc21_table1_529p6b",
    "megatron_sc21_table1_1008p0b",
    "megatron_sc21_table2_ptd_174p6b_384gpu",
    "megatron_sc21_table2_ptd_529p6b_560gpu",
    "maxtext_a3_llama2_7b_1vm",
    "maxtext_a3_llama2_7b_2vm",
    "maxtext_a3_llama2_7b_4vm",
    "nemo_24p07_llama2_7b_fp8_8xh100",
]
GOAL = (0.8, 1.2)
#: rows outside the goal, and predicted / published today (the module docstring)
OUTSIDE = {
    # over A3 VMs' network the gradient all-reduce is hidden: flat where MaxText fell
    "maxtext_a3_llama2_7b_16vm": (1.2, 1.35),
    "megatron_sc21_table2_zero3_174p6b_384gpu": (1.7, 2.1),
}


#: the rows within the goal the suite predicts: each family's (Table 1 without and with
#: interleaving, Table 2's PTD-P, MaxText, NeMo); the other five (Table 1's 529.6B and
#: 1T, Table 2's PTD-P 530B on 560 GPUs: 2.3-3.8 s each, 8.7 of the 13 s of all rows; Table
#: 1's interleaved 145.6B and 310.1B, the 76.1B's layout and schedule with deeper pipelines)
#: are further rows of their families, in the extended tier
SUITE = set(WITHIN) - {
    "megatron_sc21_table1_145p6b",
    "megatron_sc21_table1_310p1b",
    "megatron_sc21_table1_529p6b",
    "megatron_sc21_table1_1008p0b",
    "megatron_sc21_table2_ptd_529p6b_560gpu",
}


class _Predicted(dict):
    """A row's prediction, made when a test first asks for it (once a module)."""

    def __missing__(self, name: str):
        self[name] = P.predict(ENTRIES[name])
        return self[name]


@pytest.fixture(scope="module")
def results() -> dict:
    return _Predicted()


# ---- (a) the conversions against the sources' own arithmetic ---------------------------------
def test_eq3_for_the_1p7b_row_by_hand():
    """Eq. (3) for B 512, s 2048, l 24, h 2304, V 51200: 96·512·2048·24·2304² = 1.28247e16
    times (1 + 0.148148 + 0.057870) = 1.54668e16 FLOPs an iteration. The step time the
    printed 137 TFLOP/s implies (1.54668e16 / 32 / 137e12 = 3.528 s) converts back to 137,
    and to the printed aggregate 4.4 PFLOP/s and 44% of the 312 TFLOP/s peak."""
    assert P.megatron_eq3_flops(512, 2048, 24, 2304, 51200) == pytest.approx(1.54668e16, 1e-5)
    entry = ENTRIES["megatron_sc21_table1_1p7b"]
    step = 1.54668e16 / 32 / 137e12
    assert step == pytest.approx(3.528, abs=5e-4)
    assert P.published_step_s(entry) == pytest.approx(step, 1e-5)
    per_gpu = P.tflops_per_gpu(entry, step)
    assert per_gpu == pytest.approx(137, 1e-5)
    assert round(per_gpu * 32 / 1000, 1) == entry["measured"]["aggregate_pflops"]
    assert round(100 * per_gpu / 312) == entry["measured"]["percent_of_peak"]


def test_eq3_reproduces_table2_training_days():
    """Table 2's days for 300B tokens are 300e9 · F/(B·s) / (n · X) with F Eq. (3)'s
    count: each row to the rounding of its printed TFLOP/s and days (Eq. (3) is the count
    the paper converts with, not an approximation of it)."""
    rows = [e for e in ENTRIES.values() if "_table2_" in e["name"]]
    assert len(rows) == 12
    for e in rows:
        m, lay, x = e["model"], e["layout"], e["measured"]
        flops = P.megatron_eq3_flops(
            lay["global_batch"], m["seq_len"], m["n_layers"], m["d_model"], m["vocab"]
        )
        per_token = flops / (lay["global_batch"] * m["seq_len"])
        days = 300e9 * per_token / (e["gpus"] * x["tflops_per_gpu"] * 1e12) / 86400
        printed = x["training_days_300B_tokens"]
        rounding = 0.5 / x["tflops_per_gpu"] + 0.5 / printed
        assert abs(days / printed - 1) <= rounding, (e["name"], days, printed)


def test_maxtext_count_by_hand():
    """Llama 2 7B's parameters as a pytree counts them: 2·32000·4096 embedding and output,
    32 × (4·4096² attention + 3·4096·11008 SwiGLU + 2·4096 norms), + 4096 = 6,738,415,616
    (the Hugging Face checkpoint's count). Per device and step at b = 4, S = 4096:
    6·N·S·b = 6.6236e14 plus causal attention 6·32·32·128·4096²·4 = 5.2777e13."""
    entry = ENTRIES["maxtext_a3_llama2_7b_1vm"]
    assert P.maxtext_params(entry["model"]) == 6_738_415_616
    by_hand = 6 * 6_738_415_616 * 4096 * 4 + 6 * 32 * 32 * 128 * 4096**2 * 4
    assert P.maxtext_flops_per_device(entry["model"], 4) == pytest.approx(by_hand, 1e-12)
    assert P.published_flops_per_gpu(entry) == pytest.approx(7.1514e14, 1e-4)
    step = by_hand / 492e12
    assert P.tflops_per_gpu(entry, step) == pytest.approx(492, 1e-9)


def test_nemo_converts_through_its_own_flops_per_token():
    """NeMo publishes no formula: its tokens/s per GPU at the step time they imply converts
    to its own TFLOP/s, so predicted/published is the tokens-per-second ratio."""
    entry = ENTRIES["nemo_24p07_llama2_7b_fp8_8xh100"]
    step = 128 * 4096 / (8 * 16847)
    assert P.tflops_per_gpu(entry, step) == pytest.approx(776, 1e-9)
    assert P.tflops_per_gpu(entry, step / 1.25) == pytest.approx(776 * 1.25, 1e-9)


# ---- the mapping -----------------------------------------------------------------------------
def test_megatron_layouts_map_onto_the_mesh_and_the_schedule():
    entry = ENTRIES["megatron_sc21_table1_145p6b"]
    assert P.layout_of(entry) == (
        "data=24,tensor=8,stage=8,pipeline.schedule=interleaved,"
        "pipeline.microbatches=48,pipeline.virtual_stages=2,pipeline.executor=mpmd"
    )
    # full recomputation in a pipeline is the executor's own; without one, model.remat
    assert P.remat_of(entry) == "none" and P.remat_of(entry, literal=True) == "full"
    assert P.layout_of(ENTRIES["megatron_sc21_table1_18p4b"]) == (
        "data=32,tensor=8,train.grad_accum=4"
    )
    assert P.remat_of(ENTRIES["megatron_sc21_table1_18p4b"]) == "full"
    # Table 2 gives only t·p = 96: t = 8 assumed, non-interleaved
    assert P.layout_of(ENTRIES["megatron_sc21_table2_ptd_174p6b_384gpu"]) == (
        "data=4,tensor=8,stage=12,pipeline.schedule=1f1b,pipeline.microbatches=384,"
        "pipeline.executor=mpmd"
    )
    assert P.layout_of(ENTRIES["maxtext_a3_llama2_7b_2vm"]) == "data=2,fsdp=8"


def test_megatrons_attention_is_priced_with_its_scores_materialized():
    """SC'21 predates FlashAttention: its [s, s] scores are written and read back
    (``model.attention=xla``), so the 1.7B row's other kernels move, beyond a fused
    kernel's, each layer's 2 kept scores (GPT's ``Kept.scores``) of b·a·s·s elements over
    the 7 passes (2 forward, 3 backward, 2 recomputing), in 2-byte elements, on its HBM;
    the fused kernel's backward computes the scores' product once more."""
    dropped = ENTRIES["megatron_sc21_table1_1p7b"]
    model = {k: v for k, v in dropped["model"].items() if "dropout" not in k}
    entry = {**dropped, "model": model}  # without dropout, which writes the scores out too
    assert "model.attention=xla" in P.overrides_of(entry)
    fused = {**entry, "model": {**entry["model"], "attention": "fused"}}
    assert "model.attention=auto" in P.overrides_of(fused)
    hw = P.hardware.get_profile(entry["hardware"])
    rows = {}
    for name, e in {"materialized": entry, "fused": fused}.items():
        config = P.load_config([], P.overrides_of(e))
        rows[name] = P.analytic.estimate(config, P.layout_of(e), hw, e["gpus"], processes=False)
    b, a, s, layers = 16, 24, 2048, 24  # microbatch 16, one a step (512 over 32)
    scores = 7 * 2 * 2 * b * a * s * s * layers / hw.hbm_bandwidth
    extra = rows["materialized"].predicted_elementwise_s - rows["fused"].predicted_elementwise_s
    assert extra == pytest.approx(scores, rel=1e-9)
    # cuDNN's backward computes the scores once more (FlashAttention-2: tests/test_hlo.py)
    head_dim = 2304 // a
    assert rows["fused"].flops - rows["materialized"].flops == pytest.approx(
        2 * b * a * s * s * head_dim * layers, rel=1e-9
    )


def test_megatrons_dropout_is_priced_as_its_masks():
    """Megatron's 2021 dropout (0.1 of the hidden states and of the attention
    probabilities): the 1.7B row's other kernels move, beyond the same model without
    dropout, each layer's masks (a byte an element: two [b, s, h], the attention's and the
    MLP's outputs; one [b, a, s, s]) over the same 7 passes."""
    entry = ENTRIES["megatron_sc21_table1_1p7b"]
    overrides = P.overrides_of(entry)
    assert {"model.dropout=0.1", "model.attention_dropout=0.1"} <= set(overrides)
    model = {k: v for k, v in entry["model"].items() if "dropout" not in k}
    hw = P.hardware.get_profile(entry["hardware"])
    rows = {}
    for name, e in {"dropout": entry, "none": {**entry, "model": model}}.items():
        config = P.load_config([], P.overrides_of(e))
        rows[name] = P.analytic.estimate(config, P.layout_of(e), hw, e["gpus"], processes=False)
    b, a, s, h, layers = 16, 24, 2048, 2304, 24
    masks = 7 * (2 * b * s * h + b * a * s * s) * layers / hw.hbm_bandwidth
    extra = rows["dropout"].predicted_elementwise_s - rows["none"].predicted_elementwise_s
    assert extra == pytest.approx(masks, rel=1e-9)


@pytest.mark.parametrize(
    "t,d,p,hosts",
    [
        # a stage's 8 data-parallel ranks on one server, the pipeline across the servers
        (1, 8, 8, ["mesh.hosts_stage=8"]),
        (1, 32, 2, ["mesh.hosts_data=4", "mesh.hosts_stage=2"]),
        (1, 4, 16, ["mesh.hosts_stage=8"]),
        # a tensor group fills the server, or there is no data parallelism: jaxpar's own
        (8, 32, 2, []),
        (32, 1, 2, []),
        (2, 1, 32, []),
        (2, 32, 1, []),
    ],
)
def test_megatrons_rank_order_becomes_the_host_degrees(t, d, p, hosts):
    """Megatron-LM's ranks (tensor innermost, then data, the pipeline outermost; 8 to a
    server) as ``mesh.hosts_*``, named only where jaxpar's own order differs."""
    assert P.megatron_hosts(t, d, p, 8) == hosts


# the suite: batch 32, where the order holds only with Megatron's rank order; batch 512 is
# extended (the same sweep of the same entry, the same rank order)
@pytest.mark.parametrize("batch", grid([pytest.param(b, id=str(b)) for b in (32, 512)], {"32"}))
def test_figure_14_throughput_falls_as_the_pipeline_deepens(batch):
    """§5.4.2 (5.9B GPT, 64 A100s, p × d = 64): "for each batch size, the throughput
    decreases as the pipeline-parallel size increases". At batch 32 the order holds
    only with Megatron's rank order, in which the data-parallel all-reduce stays on a
    server's NVLink and the stages cross the network (with jaxpar's, p = 16 came out
    ahead of p = 8: its smaller gradient all-reduce crossed the network)."""
    entry = ENTRIES["megatron_sc21_fig14_pipeline_vs_data_5p9b_64gpu"]
    points = P.sweep_points(entry, batch, literal=False)
    assert not any(error for *_, error in points)
    by_depth = [tflops for tflops, _, _ in sorted(points, key=lambda q: q[1][1])]
    assert by_depth == sorted(by_depth, reverse=True), by_depth


def test_an_entry_that_cannot_be_built_says_why_in_one_line():
    unpublished = P.predict(ENTRIES["megatron_sc21_gpt3_175b_1024gpu"])
    assert unpublished.predicted is None and "not published" in unpublished.error
    refused = P.predict(ENTRIES["megatron_sc21_table2_zero3_529p6b_1120gpu"])
    assert refused.predicted is None and "not divisible" in refused.error
    assert "\n" not in refused.error
    assert "not divisible" in P.table([refused], markdown=True)


# ---- (b) the goal, and today's bands outside it ---------------------------------------------
@pytest.mark.parametrize("name", grid([pytest.param(n, id=n) for n in WITHIN], SUITE))
def test_prediction_lies_within_the_goal(results, name):
    res = results[name]
    assert not res.error, res.error
    assert GOAL[0] <= res.ratio <= GOAL[1], (name, res.ratio)


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_prediction_outside_the_goal_lies_in_todays_band(results, name):
    res = results[name]
    assert not res.error, res.error
    low, high = OUTSIDE[name]
    assert low <= res.ratio <= high, (name, res.ratio)


@pytest.mark.parametrize("name", ["maxtext_a3_llama2_7b_1vm", "maxtext_a3_llama2_7b_4vm"])
def test_a_run_that_was_made_fits(results, name):
    """MaxText trained Llama 2 7B at 4 sequences of 4,096 a GPU on 80 GB H100s, saving
    its matmuls' and attention's outputs (``remat_policy=minimal_flash``): jaxpar's
    ``model.remat=save_matmuls_context`` is estimated to fit (it was estimated as no
    recomputation, 192 GB, before the saving policies were counted)."""
    res = results[name]
    assert res.fits is True and 50 < res.mem_gb < 80, (res.fits, res.mem_gb)


@pytest.mark.parametrize(
    "every",
    # every suite tables the rows it predicts; the extended tier every row
    [
        pytest.param(False, id="suite-rows"),
        pytest.param(True, id="every-row", marks=pytest.mark.exhaustive),
    ],
)
def test_the_markdown_table_has_a_row_per_entry(results, every):
    rows = [results[n] for n in [*(n for n in WITHIN if every or n in SUITE), *OUTSIDE]]
    text = P.table(rows, markdown=True).splitlines()
    assert text[1] == "|" + "---|" * len(P.HEAD)
    assert len(text) == 2 + len(rows)


# ---- (c) ZeRO-3 against PTD-P ----------------------------------------------------------------
@pytest.mark.xfail(
    strict=True,
    reason="the planner ranks ZeRO-3 ahead of PTD-P at 384 GPUs (about 257 vs 172 TFLOP/s "
    "per GPU predicted; published 144 vs 153): issue 45 left open",
)
def test_zero3_against_ptd_at_384_gpus_in_the_published_order(results):
    """Published: PTD-P 153 TFLOP/s per GPU beats ZeRO-3's 144 on 384 GPUs. Predicted today:
    ZeRO-3 ahead, because the planner overlaps ZeRO-3's parameter gathers (18 s of them at
    NCCL's hierarchical bandwidth) with its 45 s of matmuls and other kernels, where the
    2021 DeepSpeed run took 82 s a step. Strict: it fails (turns green) the day the planner
    gets the order right, and must then lose its mark."""
    zero3 = results["megatron_sc21_table2_zero3_174p6b_384gpu"]
    ptd = results["megatron_sc21_table2_ptd_174p6b_384gpu"]
    assert ptd.published > zero3.published
    names = [zero3.name, ptd.name]
    sets = P.order_sets(P.measured(list(ENTRIES.values())))
    assert any(names == v for v in sets.values())
    assert ptd.predicted > zero3.predicted
