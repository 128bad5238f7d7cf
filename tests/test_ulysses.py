"""Ulysses context parallelism (``context.attention=ulysses``): q, k, v exchanged
all-to-all from sequence shards to head shards trains the same numbers as one device —
GPT (learned and rotary positions) and the Llama (grouped-query heads split or repeated),
balanced and in order, beside tensor, data and fsdp, pipeline stages and remat; the
attention alone equals one device's with a sliding window and packed documents; the
compiled step exchanges all-to-alls and gathers no K/V; heads that do not divide are one
line; the lab predicts the all-to-all bytes, inside both pipeline executors too; the
layout file moves what it says."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import hlo
from jaxpar.context import ContextConfig, attend, balanced_order
from jaxpar.errors import LayoutError
from jaxpar.logical import activation_rules
from tests.helpers import assert_params_close, grid, one_device_steps, run_steps
from tests.test_context import _grads, _layout

T = 32  # tokens per sequence: 2 × 4 chunks for context=4 with load balancing
MODEL = [
    "model.d_model=32",
    "model.n_heads=8",  # head dim 4: context=4 beside tensor=2 splits them 8 ways
    "model.d_ff=32",
    "model.n_layers=2",
    f"model.max_seq_len={T}",
    f"data.seq_len={T}",
    "train.batch_size=8",
    "optim.name=adamw",
    "optim.lr=3e-3",
    "optim.weight_decay=0.1",
    "optim.clip_norm=1.0",
    "optim.warmup_steps=0",
]
LLAMA = ["model.name=llama", "model.d_ff=48"]
FAMILIES = {
    "gpt": [],
    "rotary": ["model.positions=rotary"],
    # 4 key/value heads: 2 per device under context=2 beside tensor=2, split as the queries
    "llama": [*LLAMA, "model.n_kv_heads=4"],
    # 2 key/value heads: context=4 does not divide them, so they are repeated to the queries
    "llama_kv2": [*LLAMA, "model.n_kv_heads=2"],
}


@functools.cache
def _one_device(family: str):
    losses, params, run = run_steps([*MODEL, *FAMILIES[family], "mesh.data=1"], devices=1)
    return losses, params, _grads(run, run.init_params)


CASES = [  # (family, layout, balance)
    ("gpt", "data=4,context=2", True),
    ("gpt", "fsdp=2,context=4", False),
    ("rotary", "context=4,tensor=2", True),
    ("rotary", "data=2,context=2,tensor=2", False),
    ("llama", "data=2,context=2,tensor=2", True),
    ("llama_kv2", "data=2,context=4", True),
]


@pytest.mark.parametrize(
    "family,layout,balance",
    grid(
        [pytest.param(*c, id=f"{c[0]}-{c[1]}-{'balanced' if c[2] else 'in_order'}") for c in CASES],
        {"llama_kv2-data=2,context=4-balanced"},  # tensor × ulysses: the lab's compiled case
    ),
)
def test_ulysses_equals_one_device(family, layout, balance):
    """Losses of 3 AdamW steps, the first batch's gradients and the final parameters equal
    one device's."""
    losses, params, run = run_steps(
        [
            *MODEL,
            *FAMILIES[family],
            *_layout(layout),
            "context.attention=ulysses",
            f"context.balance={str(balance).lower()}",
        ]
    )
    assert run.plan.mesh.shape["context"] > 1
    want_losses, want_params, want_grads = _one_device(family)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_params_close(_grads(run, run.init_params), want_grads, elementwise=False, rtol=1e-4)
    assert_params_close(params, want_params, elementwise=False, rtol=1e-4)


@pytest.mark.parametrize(
    "extra",
    grid(
        [
            pytest.param(
                ["mesh.stage=2", "pipeline.executor=spmd", "pipeline.microbatches=2"],
                id="stage-spmd",
            ),
            pytest.param(
                ["mesh.stage=2", "pipeline.executor=mpmd", "pipeline.microbatches=2"],
                id="stage-mpmd",
            ),
            pytest.param(["mesh.data=4", "model.remat=full"], id="remat"),
        ],
        # every suite: the spmd stages (the all-to-alls run inside a stage's branch, where
        # XLA:CPU deadlocks on the ring strategy; the lab's case only compiles them); the
        # sub-mesh stages and remat extended (context inside the sub-mesh executor's stages:
        # compiled in every suite by the lab's cases, against one device in
        # tests/test_context.py's extended stage-mpmd case; Ulysses' exchanges under remat:
        # the lab's gpt-tensor-remat and gpt-kept-output cases)
        # heavy (14 s): the lab's spmd-pipeline case compiles the stages' all-to-alls in
        # every suite
        set(),
        heavy={"stage-spmd"},
    ),
)
def test_ulysses_composes_with_stages_and_remat(extra):
    """``context=2`` with pipeline stages (both executors; ``data=2`` beside) and remat:
    losses and parameters equal one device's (accumulating the same microbatches)."""
    micro = 2 if any("stage" in e for e in extra) else 1
    data = ["mesh.data=2"] if micro == 2 else []
    one = one_device_steps([*MODEL, f"train.grad_accum={micro}"])
    losses, params, _ = run_steps(
        [*MODEL, "mesh.context=2", *data, *extra, "context.attention=ulysses"]
    )
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


# ---- the attention alone: windows, documents, grouped heads ----------------------------------
RULES = {
    "batch": ("data",),
    "seq": ("context",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "kv": (),
}


@pytest.mark.parametrize(
    "mesh_shape,kv_heads,window,documents,balance",
    [
        ((2, 4, 1), 4, 0, True, True),  # grouped heads split as the queries; documents
        ((1, 4, 2), 2, 5, False, True),  # K=2 over tensor=2 and context=4: repeated; window
        # plain heads, window and documents, in order: extended (one mask of the gathered
        # positions and segment ids whatever their order, windows and documents each in a
        # case above; plain heads: the repeated ones, which the queries' split takes as is)
        pytest.param((2, 2, 2), 8, 3, True, False, marks=pytest.mark.exhaustive),
    ],
    ids=["grouped-documents", "repeated-window", "window-documents-in_order"],
)
def test_attention_alone_equals_one_device(mesh_shape, kv_heads, window, documents, balance):
    """``attend`` on a (data, context, tensor) mesh with ulysses, the sequence in the
    order the layout runs it: its output and the gradients of q, k, v equal
    ``attend`` on one device (with a sliding ``window`` and packed ``documents``' segment
    ids where given) to 1e-5."""
    B, N, H = 4, 8, 4
    mesh = jax.make_mesh(
        mesh_shape, ("data", "context", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k, v = (jax.random.normal(key, (B, T, kv_heads, H)) for key in keys[1:3])
    segments = jnp.cumsum(jax.random.bernoulli(keys[3], 0.1, (B, T)), axis=1) if documents else None
    pos = balanced_order(T, mesh_shape[1]) if balance else np.arange(T)

    def loss(q, k, v, segments):
        out = attend(q, k, v, pos, window=window, segments=segments)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    def taken(x):  # the sequence in the layout's order
        return None if x is None else jnp.take(x, jnp.asarray(pos), axis=1)

    args = (taken(q), taken(k), taken(v), taken(segments))
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)  # no rules: one device
    options = ContextConfig(attention="ulysses", balance=balance)
    with activation_rules(mesh, RULES, options):
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---- the compiled program -------------------------------------------------------------------
def _compiled(overrides: list[str]) -> str:
    run = jaxpar.build(jaxpar.load_config([], [*MODEL, *overrides]))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.data.batch(0, 8))
    return run.trainer.compile_step(shapes).as_text()


# Extended tier: the same compiled step's exchanges (all-to-alls, no K/V all-gather but the
# positions') are counted in every suite against the layout file's stated bytes
# (test_the_layout_file_moves_what_it_says, gpt_tiny under context=4) and to 1% against the
# lab's terms (test_the_lab_predicts_the_all_to_alls); all_gather's K/V gathers: against the
# lab's in every suite in tests/test_context.py::test_the_lab_predicts_context_collectives
@pytest.mark.exhaustive
def test_the_step_exchanges_all_to_alls_and_gathers_no_keys():
    """``data=2,context=4``, 2 layers: 16 all-to-alls (per layer q, k, v in and the output
    back, and their 4 gradients), each moving a device's [b, T/c, N, H] = [4, 8, 8, 4]
    float32 (512 B); the one all-gather is the positions' [T] int32; ``all_gather``'s
    program instead gathers K and V ([4, 32, 8, 4])."""
    uly = hlo.collective_stats(
        _compiled(["mesh.data=2", "mesh.context=4", "context.attention=ulysses"])
    )
    assert uly["all-to-all"].count == 2 * 8
    assert uly["all-to-all"].payload_bytes == 2 * 8 * 4 * 8 * 8 * 4 * 4
    assert uly["all-gather"].payload_bytes == T * 4
    assert uly["reduce-scatter"].count == 0
    gathered = hlo.collective_stats(_compiled(["mesh.data=2", "mesh.context=4"]))
    assert gathered["all-to-all"].count == 0
    assert gathered["all-gather"].payload_bytes >= 2 * 2 * 4 * T * 8 * 4 * 4


# ---- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.n_heads=2", "mesh.context=4", "mesh.data=2"],
            r"context.attention=ulysses splits each device's 2 query heads "
            r"\(model.n_heads=2\) over mesh.context=4, which does not divide them; "
            r"change model.n_heads, mesh.context or mesh.tensor, or use "
            r"context.attention=all_gather",
        ),
        (
            ["mesh.context=4", "mesh.tensor=2", "mesh.data=1", "model.n_heads=4"],
            r"each device's 2 query heads \(model.n_heads=4 over mesh.tensor=2\) over "
            r"mesh.context=4",
        ),
    ],
    ids=["context", "tensor"],
)
def test_heads_that_do_not_divide_are_one_line(overrides, message):
    with pytest.raises(LayoutError, match=message) as err:
        _compiled([*overrides, "context.attention=ulysses"])
    assert "\n" not in str(err.value)


# ---- the lab --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,layout",
    grid(
        [
            pytest.param("gpt", "data=2,context=4", id="gpt-data=2,context=4"),
            pytest.param("gpt", "context=4,tensor=2,model.remat=full", id="gpt-tensor-remat"),
            pytest.param("llama", "data=2,context=2,tensor=2", id="llama-grouped"),
            pytest.param("llama_kv2", "data=2,context=4", id="llama-repeated"),
            # attention's output kept by name: the recomputation does not exchange it again
            pytest.param(
                "gpt", "data=2,context=4,model.remat=save_matmuls_context", id="gpt-kept-output"
            ),
        ],
        {"gpt-tensor-remat", "llama-grouped", "gpt-kept-output"},
    ),
)
def test_the_lab_predicts_the_all_to_alls(family, layout):
    """The compiled step's all-to-all bytes equal the lab's terms to 1% (the q, k, v and
    output exchanges, their gradients, again under remat; grouped key/value heads moved as
    they are, or repeated first); the whole step's collective bytes are within 5% of the
    prediction."""
    from jaxpar.config import apply_overrides
    from jaxpar.lab import hardware, predict, sweep

    config = jaxpar.load_config([], [*MODEL, *FAMILIES[family], "context.attention=ulysses"])
    row = sweep.measure(config, layout, hardware.get_profile("h100"))
    assert row.ok, row.error
    run = jaxpar.build(apply_overrides(config, sweep.layout_overrides(layout)))
    kinds = predict.predict_comm(run, "cpu").by_kind()
    assert row.all_to_all_bytes == pytest.approx(kinds["all-to-all"], rel=0.01)
    assert row.comm_ratio == pytest.approx(1.0, abs=0.05)


PIPELINE = "stage=2,data=2,context=2,pipeline.microbatches=2"
#: a chunk of 2 layers under remat: each rematerialized layer exchanges again in the backward
TWO_LAYER_CHUNKS = "model.n_layers=4,model.remat=full"


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(f"{PIPELINE},pipeline.executor=spmd", id="spmd"),
            pytest.param(f"{PIPELINE},pipeline.executor=mpmd", id="mpmd"),
            pytest.param(f"{PIPELINE},pipeline.executor=mpmd,{TWO_LAYER_CHUNKS}", id="mpmd-remat"),
            pytest.param(f"{PIPELINE},pipeline.executor=spmd,{TWO_LAYER_CHUNKS}", id="spmd-remat"),
            pytest.param(
                f"{PIPELINE},pipeline.executor=mpmd,pipeline.backward=residuals,{TWO_LAYER_CHUNKS}",
                id="mpmd-residuals-remat",
            ),
            # attention's output kept by name: its rematerialized layers exchange q again
            pytest.param(
                f"{PIPELINE},pipeline.executor=mpmd,model.n_layers=4,"
                "model.remat=save_matmuls_context",
                id="mpmd-kept-output",
            ),
        ],
        # every suite: the spmd pipeline (its ticks' exchanges inside the one program).
        # Extended: the sub-mesh executor's, whose step the lab sums from its chunk
        # programs' collectives whatever they are (checked in every suite on context's in
        # tests/test_context.py's interleaved case, on all-reduces in tests/test_submesh.py;
        # Ulysses' all-to-alls without a pipeline: above)
        {"spmd"},
    ),
)
def test_the_lab_predicts_the_all_to_alls_inside_a_pipeline(layout):
    """Ulysses inside both pipeline executors (rotary GPT: no learned position table, whose
    gradient gather the lab leaves out): the compiled step's all-to-alls and all-gathers
    (the positions, and in the spmd pipeline the first stage's embedding gradient and
    token ids) are the lab's in count and to 1% in bytes, every collective kind's bytes
    within 5%. ``data=2`` rows of 2 microbatches: an all-to-all moves [1, 16, 8, 4]
    float32 (4096 B over context=2); spmd: 6 ticks of a one-layer backward (its forward
    again, 4 exchanges, and 4 gradients: 48), mpmd: a forward and a backward program per
    microbatch (12 a layer: 24; remat with 2-layer chunks: 32 a microbatch, the
    rematerialized layers exchanging again, 24 with residuals)."""
    from jaxpar.lab import hardware, measure, predict

    config = jaxpar.load_config([], [*MODEL, *FAMILIES["rotary"], "context.attention=ulysses"])
    lowered = measure.lower(config, layout, hardware.get_profile("h100"))
    compiled, _ = measure.compile_lowered(lowered)
    got = hlo.step_cost(compiled).collectives
    terms = predict.predict_comm(lowered.run, "cpu").terms
    assert got["all-to-all"].count > 0
    for kind, stat in got.items():
        want = [t for t in terms if t.kind == kind]
        wire = sum(t.wire_bytes for t in want)
        assert stat.wire_bytes == pytest.approx(wire, rel=0.05, abs=1), kind
        if kind in ("all-to-all", "all-gather"):
            assert stat.count == sum(t.times for t in want), kind
            assert stat.wire_bytes == pytest.approx(wire, rel=0.01), kind


def test_the_layout_file_moves_what_it_says():
    """``configs/layouts/ulysses.yaml`` over gpt_tiny compiles, and its step moves the
    6.00 MiB of all-to-all per device (and no K/V all-gather) its comment states."""
    from tests.helpers import ROOT

    files = [ROOT / "configs/gpt_tiny.yaml", ROOT / "configs/layouts/ulysses.yaml"]
    run = jaxpar.build(jaxpar.load_config(files, ["run.devices=8"]))
    assert run.plan.context.attention == "ulysses" and run.plan.mesh.shape["context"] == 4
    batch = run.data.batch(0, run.config.train.batch_size)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    stats = hlo.collective_stats(run.trainer.compile_step(shapes).as_text())
    assert f"{stats['all-to-all'].wire_bytes / 2**20:.2f}" == "6.00"
    assert stats["all-gather"].wire_bytes < 1024  # the positions
