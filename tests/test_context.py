"""Context parallelism (``mesh.context``): each sequence split over devices trains the same
numbers as one device — GPT (learned and rotary positions, causal) and BERT (bidirectional)
under every strategy, with and without load balancing, composed with the other axes; the
balanced order is exact and balances the work; the compiled program holds no full-sequence
activation; bad input is one line."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.context import balanced_order, order, restore
from jaxpar.errors import LayoutError
from tests.helpers import assert_params_close, grid, one_device_steps, run_steps

T = 32  # tokens per sequence: 2 × 8 chunks for context=8 with load balancing
MODEL = [
    "model.d_model=16",
    "model.n_heads=2",
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
FAMILIES = {"gpt": [], "rotary": ["model.positions=rotary"], "bert": ["model.name=bert"]}


@functools.cache
def _one_device(family: str):
    losses, params, run = run_steps([*MODEL, *FAMILIES[family], "mesh.data=1"], devices=1)
    return losses, params, _grads(run, run.init_params)


def _grads(run, params):
    """The gradients of the first batch at ``params`` (host arrays)."""
    batch = run.trainer.shard_batch(run.data.batch(0, 8))
    params = jax.device_put(params, run.plan.state_shardings.params)
    model_state = run.trainer.init().model_state
    return jax.tree.map(np.asarray, run.trainer.grads(params, batch, model_state)[2])


CASES = [  # (family, layout, strategy, balance)
    ("gpt", "context=2", "all_gather", True),
    ("gpt", "context=4", "ring", True),
    ("gpt", "context=8", "all_gather", False),
    ("gpt", "data=2,context=2,tensor=2", "ring", False),
    ("gpt", "fsdp=2,context=4", "all_gather", True),
    ("rotary", "context=2", "ring", True),
    ("rotary", "context=4", "all_gather", False),
    ("rotary", "context=8", "ring", True),
    ("rotary", "data=2,context=2,tensor=2", "all_gather", True),
    ("rotary", "fsdp=2,context=4", "ring", False),
    ("bert", "context=2", "all_gather", False),
    ("bert", "context=4", "ring", False),
    ("bert", "context=8", "all_gather", False),
    ("bert", "data=2,context=2,tensor=2", "ring", False),
    ("bert", "fsdp=2,context=4", "all_gather", False),
]


def _layout(text: str) -> list[str]:
    degrees = dict(part.split("=") for part in text.split(","))
    return [
        f"mesh.{axis}={degrees.get(axis, -1 if axis == 'data' else 1)}"
        for axis in ("data", "fsdp", "context", "tensor")
    ]


# every suite: the GPT round the ring in order beside data and tensor (the one case whose
# ring skips a block wholly in a query's future: balanced, every block holds a visible key;
# and the ring's gradients against one device). The other families and layouts extended:
# all_gather, balanced, against one device in every suite in
# tests/test_gpt_dropout.py::test_hidden_dropout_under_context_parallelism_matches_one_device
# (the GPT, data=4 × context=2), beside fsdp in tests/test_sequence_parallel.py's
# llama-fsdp=2,context=2,tensor=2, in a pipeline in tests/test_packing.py's GPT; rotary
# positions round a balanced ring, BERT under context: packed, in
# tests/test_pack_families.py (Gemma 3's ring; BERT's all_gather, heavy)
@pytest.mark.parametrize(
    "family,layout,strategy,balance",
    grid(
        [
            pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}-{'balanced' if c[3] else 'in_order'}")
            for c in CASES
        ],
        {"gpt-data=2,context=2,tensor=2-ring-in_order"},
    ),
)
def test_context_parallel_equals_one_device(family, layout, strategy, balance):
    """Losses of 3 AdamW steps, the first batch's gradients and the final parameters equal
    one device's."""
    losses, params, run = run_steps(
        [
            *MODEL,
            *FAMILIES[family],
            *_layout(layout),
            f"context.attention={strategy}",
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
                [
                    "mesh.stage=2",
                    "mesh.data=2",
                    "pipeline.executor=spmd",
                    "pipeline.microbatches=2",
                ],
                id="stage-spmd",
            ),
            pytest.param(
                [
                    "mesh.stage=2",
                    "mesh.data=2",
                    "pipeline.executor=mpmd",
                    "pipeline.microbatches=2",
                ],
                id="stage-mpmd",
            ),
            pytest.param(
                ["mesh.data=4", "train.grad_accum=2", "context.attention=ring"],
                id="grad_accum-ring",
            ),
            pytest.param(
                ["mesh.data=4", "model.remat=full", "context.attention=ring"], id="remat-ring"
            ),
        ],
        # all extended: each crossing runs no code of its own. Context in the spmd
        # pipeline: tests/test_packing.py's stage=2 × context=2 (the same layout and
        # strategy, against each document alone) and tests/test_pack_families.py's Gemma 3
        # there. In the sub-mesh executor's stages attend runs on a stage's sub-mesh under
        # the same activation rules (jaxpar/pipeline/chunks.py, nothing context-specific):
        # the sub-mesh executor against one device in tests/test_submesh.py and
        # tests/test_moe.py's mpmd pipeline, context against one device above, and context
        # inside sub-mesh stages compiled in every suite by the lab's interleaved mpmd case
        # below and tests/test_analytic.py's sub-mesh sends. Accumulation splits the rows,
        # not the sequences (the same loop with and without context). Remat re-runs the
        # ring's custom_vjp forward as JAX does any function's (no remat code in
        # jaxpar/ring_attention.py or jaxpar/context.py): the ring's gradients against one
        # device above, remat's in tests/test_models.py::test_remat_changes_memory_not_numbers
        set(),
    ),
)
def test_context_composes_with_stages_accumulation_and_remat(extra):
    """``context=2`` with pipeline stages (both executors), gradient accumulation and remat:
    losses and parameters equal one device's (accumulating the same microbatches)."""
    micro = 2 if any("stage" in e or "grad_accum" in e for e in extra) else 1
    # without accumulation the reference is the GPT's of test_context_parallel_equals_one_device
    one = _one_device("gpt") if micro == 1 else one_device_steps([*MODEL, "train.grad_accum=2"])
    losses, params, _ = run_steps([*MODEL, "mesh.context=2", *extra])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


@pytest.mark.heavy  # 14 s: float32 rings equal one device in every suite
def test_bfloat16_under_context_parallelism_tracks_one_device():
    """bf16 compute: ring attention merges its blocks in float32, so the losses stay within
    bf16 rounding of one device's."""
    bf16 = [*MODEL, "model.dtype=bfloat16"]
    one = run_steps([*bf16, "mesh.data=1"], devices=1)
    losses, _, _ = run_steps([*bf16, "mesh.context=4", "mesh.data=2", "context.attention=ring"])
    np.testing.assert_allclose(losses, one[0], rtol=2e-2)


# ---- the balanced order ---------------------------------------------------------------------
@pytest.mark.parametrize("ways", [2, 4, 8])
def test_balanced_order_round_trips_and_balances_the_causal_work(ways):
    """Device r holds chunks r and 2c−1−r; ``restore`` undoes ``order`` exactly; each device's
    queries see the same number of keys (causal): a c-th of all, where in the natural order
    device r's n queries see r·n² + n(n+1)/2."""
    length = 8 * ways
    pos = balanced_order(length, ways)
    assert sorted(pos) == list(range(length))
    chunk = length // (2 * ways)
    assert list(pos[: 2 * chunk]) == [*range(chunk), *range(length - chunk, length)]
    x = jnp.arange(3 * length, dtype=jnp.float32).reshape(3, length)
    np.testing.assert_array_equal(restore(order(x, pos), pos), x)
    np.testing.assert_array_equal(order(x, pos)[:, 0], x[:, pos[0]])

    def work(positions):  # visible (query, key) pairs per device: keys at or before it
        return [
            int((positions[:, None] >= np.arange(length)[None, :]).sum())
            for positions in np.split(positions, ways)
        ]

    n, total = length // ways, length * (length + 1) // 2
    assert work(pos) == [total // ways] * ways
    assert work(np.arange(length)) == [r * n * n + n * (n + 1) // 2 for r in range(ways)]


# ---- what the compiled program holds ------------------------------------------------------
def _float_shapes(hlo: str) -> set[tuple[int, ...]]:
    return {
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\bf32\[([\d,]*)\]", hlo)
    }


@pytest.mark.parametrize(
    "strategy",
    grid(
        [pytest.param("all_gather", id="all_gather"), pytest.param("ring", id="ring")],
        # every suite: the ring (the per-token activations split, and no whole-sequence
        # array at all). all_gather's per-token activations are split by the same rules,
        # and what it moves whole is K/V: its dK/dV reduce-scatters to 1% and the step's
        # collective bytes to 5% of the lab's in every suite
        # (test_the_lab_predicts_context_collectives[stage=2,context=4]): extended
        {"ring"},
    ),
)
def test_no_device_holds_a_full_sequence_activation(strategy):
    """From the compiled train step of ``context=4`` (sequence 48, so 12 tokens a device;
    D=20, F=36, head dim 10 — sizes no other dim has): no float array holds the whole
    sequence next to the model width, MLP width or vocabulary — no [b, T, D], [b, T, F],
    [b, T, V] activation. ``all_gather``'s whole-sequence arrays are the gathered K/V (and
    their gradients: [b, 48, N, 10]) and the scores against them ([b, N, 12, 48]); ``ring``
    has none at all."""
    long = 48
    layout = [
        "mesh.context=4",
        "mesh.data=2",
        f"context.attention={strategy}",
        "model.d_model=20",
        "model.n_heads=2",
        "model.d_ff=36",
        "model.max_seq_len=64",
        f"data.seq_len={long}",
        "train.batch_size=4",
    ]
    run = jaxpar.build(jaxpar.load_config([], [*MODEL, *layout]))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.data.batch(0, 4))
    hlo = run.trainer.compile_step(shapes).as_text()
    whole = {s for s in _float_shapes(hlo) if long in s}
    assert not {s for s in whole if {20, 36, 256} & set(s)}, whole
    if strategy == "ring":
        assert not whole, whole
    else:
        assert whole, "the gathered K/V"
        assert all(10 in s or 12 in s for s in whole), whole


# ---- bad input ------------------------------------------------------------------------------
class _OwnAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.attn(x).mean()


def _own_task():
    return jaxpar.Task(
        _OwnAttention,
        lambda model, batch: (model(batch["tokens"]), {}),
        {"tokens": ("batch", "seq")},
        tokens_per_example=8,
        name="own",
        data=lambda step, n: {"tokens": np.zeros((n, 8), np.int32)},
    )


@pytest.mark.parametrize(
    "overrides,task,message",
    [
        (
            ["data.seq_len=20", "mesh.context=4"],
            None,
            r"sequence length 20 does not split into 2 × mesh.context = 8 "
            r".*set context.balance=false",
        ),
        (
            ["data.seq_len=18", "mesh.context=4", "context.balance=false"],
            None,
            r"sequences of 18 tokens do not divide into 4; change data.seq_len or mesh.context",
        ),
        (
            ["mesh.context=2"],
            "own",
            r"the attention of task 'own' does not run across a split sequence; set mesh.context=1",
        ),
        (
            ["model.name=convnet", "data.image_size=8", "mesh.context=2"],
            None,
            r"task 'convnet' has no sequences \(its batch: images .*\); set mesh.context=1",
        ),
    ],
    ids=["balance", "divisible", "own-model", "no-sequence"],
)
def test_bad_input_is_one_line(overrides, task, message):
    config = jaxpar.load_config([], [*MODEL, *overrides, "train.steps=1"])
    with pytest.raises(LayoutError, match=message) as err:
        run = jaxpar.build(config, _own_task() if task else None)
        run.trainer.compile_step(
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.data.batch(0, 8))
        )
    assert "\n" not in str(err.value)


# ---- sampling and the layout lab ------------------------------------------------------------
# generation drops the split of the sequence from the run's rules in one statement, for
# context and sequence parallelism alike (jaxpar.decoding.Generator._rules), so no
# context code runs in it: a sharded run's checkpoint sampled on its layout and on one
# device in every suite in tests/test_sample.py::test_sharded_run_samples_as_on_one_device,
# the sequence's split dropped in tests/test_sequence_parallel.py's
# test_a_run_trained_with_sequence_parallelism_samples_as_on_one_device
@pytest.mark.exhaustive
def test_a_run_trained_with_context_parallelism_samples_as_on_one_device(tmp_path):
    """Trained (and checkpointed) with ``context=4``: greedy and seeded samples from its
    checkpoint equal the same checkpoint's on one device (generation keeps each sequence
    whole in its KV cache)."""
    from jaxpar import sample as sampling
    from jaxpar.loop import train
    from jaxpar.resume import restore_state

    run_dir = tmp_path / "run"
    train(
        jaxpar.load_config(
            [],
            [
                *MODEL,
                "mesh.context=4",
                "mesh.data=2",
                "train.steps=2",
                "train.eval_every=0",
                "train.progress=false",
                "checkpoint.async_save=false",
                f"run.dir={run_dir}",
            ],
        ),
        echo=False,
    )
    prompt = np.array([list(b"The ")] * 2)
    got = []
    for overrides in ((), ("mesh.context=1", "mesh.data=1", "run.devices=1")):
        run = jaxpar.build(sampling.load_run_config(run_dir, overrides))
        generator = sampling.Generator(run, vocab_limit=256)
        state = restore_state(run, None, "test")
        got.append(
            [
                generator.generate(state, prompt, 8, temperature=0),
                generator.generate(state, prompt, 8, temperature=0.8, seed=3),
            ]
        )
    assert dict(jaxpar.build(sampling.load_run_config(run_dir)).plan.mesh.shape)["context"] == 4
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


#: context layouts of a tiny GPT: each strategy (all_gather inside the spmd pipeline) in the
#: suite; the mpmd executor's interleaved pipeline (each stage's two chunks run every
#: microbatch, each its context collectives) heavy (13–25 s: its programs traced and
#: compiled; tests/test_analytic.py's sub-mesh sends at context=2, interleaved, keep the
#: executor's context sends to the byte in the suite)
LAB_LAYOUTS = grid(
    [
        pytest.param(x, id=x)
        for x in (
            "context=8",
            "data=4,context=2",
            "data=2,context=4,context.attention=ring",
            "data=2,context=4,model.remat=full",
            "fsdp=2,context=4",
            "data=2,context=2,tensor=2,context.attention=ring",
            "stage=2,context=4",
            "stage=2,data=2,context=2,pipeline.executor=mpmd",
            "stage=2,data=2,context=2,pipeline.executor=mpmd,pipeline.schedule=interleaved,"
            "pipeline.virtual_stages=2,model.n_layers=4",
        )
    ],
    # (all_gather's gathers and reduce-scatters beside data alone, data=4,context=2: the
    # same terms as in the spmd pipeline's stage=2,context=4, and the data all-reduce as
    # beside the ring's data=2,context=2,tensor=2: extended)
    {"data=2,context=2,tensor=2,context.attention=ring", "stage=2,context=4"},
    heavy={
        "stage=2,data=2,context=2,pipeline.executor=mpmd,pipeline.schedule=interleaved,"
        "pipeline.virtual_stages=2,model.n_layers=4"
    },
)


@pytest.mark.parametrize("layout", LAB_LAYOUTS)
def test_the_lab_predicts_context_collectives(layout):
    """K/V all-gathers, dK/dV reduce-scatters and ring sends of every context layout equal
    the lab's terms to 1%, and so do the all-reduces (gradients; inside the spmd pipeline
    each tick sums its gradients over context) and the sends (the pipeline's carry a part of
    each sequence); the whole step's collective bytes are within 5% of the prediction."""
    from jaxpar.config import apply_overrides
    from jaxpar.lab import hardware, predict, sweep
    from jaxpar.run import build
    from tests.helpers import GPT_SMALL

    config = jaxpar.load_config([], [*GPT_SMALL, "model.tie_embeddings=true"])
    row = sweep.measure(config, layout, hardware.get_profile("h100"))
    assert row.ok, (layout, row.error)
    run = build(apply_overrides(config, sweep.layout_overrides(layout)))
    prediction = predict.predict_comm(run, "cpu")
    predicted = {t.what: t.wire_bytes for t in prediction.terms}
    kinds = prediction.by_kind()
    if "ring" in layout:
        ring = [
            t.wire_bytes
            for t in prediction.terms
            if t.kind == "collective-permute" and t.what.startswith("context:")
        ]
        assert len(ring) == 3, layout
        assert row.collective_permute_bytes == pytest.approx(sum(ring), rel=0.01), layout
    else:
        assert row.reduce_scatter_bytes == pytest.approx(
            predicted["context: dK and dV reduce-scattered"], rel=0.01
        ), layout
    assert row.collective_permute_bytes == pytest.approx(
        kinds.get("collective-permute", 0), rel=0.01
    ), layout
    assert row.all_reduce_bytes == pytest.approx(kinds["all-reduce"], rel=0.01), layout
    assert row.comm_ratio == pytest.approx(1.0, abs=0.05), layout


def test_sweep_and_plan_offer_context_layouts():
    """``sweep --all`` enumerates context degrees for a model that supports them (none
    left out for the GPT) and leaves them out, with one note, for one that does not; the
    planner's memory fixes move the data degree into context parallelism."""
    from jaxpar.lab import plan_fixes, sweep

    gpt = jaxpar.load_config([], MODEL)
    layouts, note = sweep.default_layouts(gpt, 8)
    assert "context=8" in layouts and "data=2,context=2,tensor=2" in layouts and note is None
    convnet = jaxpar.load_config([], ["model.name=convnet"])
    kept, note = sweep.default_layouts(convnet, 8)
    assert not [x for x in kept if "context=" in x]
    assert re.search(
        r"note: \d+ layouts with mesh.context > 1 left out: convnet does not run "
        r"with its sequences split",
        note,
    )
    row = sweep.Row(layout="data=4,tensor=2", mem_temp_bytes=2, mem_args_bytes=1)
    assert "context=4,tensor=2" in plan_fixes.fixes(gpt, "data=4,tensor=2", row)


# ---- a researcher's own model -------------------------------------------------------------
def _partitioned(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class TinyLM(nnx.Module):
    """A one-layer causal LM a user might write: its attention through ``jaxpar.attend``
    with each token's position, everything else per token."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, width: int = 16, length: int = T):
        self.embed = nnx.Embed(
            vocab,
            width,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
        )
        self.pos = nnx.Embed(
            length,
            width,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "embed")),
        )
        self.qkv = nnx.Linear(width, 3 * width, kernel_init=_partitioned("embed", "mlp"), rngs=rngs)
        self.out = nnx.Linear(width, vocab, kernel_init=_partitioned("embed", "vocab"), rngs=rngs)

    def __call__(self, tokens_BT, positions_T):
        x = self.embed(tokens_BT) + self.pos(jnp.asarray(positions_T))[None]
        x = jaxpar.constrain(x, ("batch", "seq", "act_embed"))
        B, L, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, L, 3, 2, D // 2), 3, axis=2)
        o = jaxpar.attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], positions_T, causal=True)
        return self.out(x + o.reshape(B, L, D))


def _tiny_lm_loss(model, batch):
    tokens = batch["tokens"]
    pos = jaxpar.context.positions(tokens.shape[1] - 1)
    inputs = jaxpar.context.order(tokens[:, :-1], pos)
    targets = jaxpar.context.order(tokens[:, 1:], pos)
    logits = model(inputs, pos)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), {}


def _tokens(step, n):
    return {"tokens": np.random.default_rng(step).integers(0, 64, (n, T + 1)).astype(np.int32)}


TINY_LM = jaxpar.Task(
    TinyLM,
    _tiny_lm_loss,
    {"tokens": ("batch", None)},
    tokens_per_example=T,
    context_parallel=True,
    data=_tokens,
    name="tiny_lm",
)


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.context=4", "mesh.data=2", "context.attention=ring"], id="ring"),
            pytest.param(["mesh.context=8", "context.attention=all_gather"], id="all_gather"),
        ],
        # both extended: jaxpar.attend, jaxpar.context.positions and order are the
        # functions the built-in models call (the ring against one device:
        # test_context_parallel_equals_one_device; all_gather's: tests/test_gpt_dropout.py's
        # context case), and Task.context_parallel is checked for every task alike (a
        # user's Task declaring it, traced under context=2 and trained on one device:
        # test_a_context_parallel_model_that_skips_jaxpar_attend_is_refused)
        set(),
    ),
)
def test_a_users_model_with_jaxpar_attend_equals_one_device(layout):
    """A user's Task declaring ``context_parallel`` (its attention through ``jaxpar.attend``,
    its loss reordered with ``jaxpar.context.positions``/``order``) trains under context
    parallelism to one device's losses and parameters."""

    def run(overrides, devices):
        config = jaxpar.load_config(
            [],
            [
                "train.batch_size=8",
                "optim.name=adamw",
                "optim.warmup_steps=0",
                f"run.devices={devices}",
                *overrides,
            ],
        )
        r = jaxpar.build(config, TINY_LM)
        state, losses = r.trainer.init(), []
        for step in range(3):
            state, metrics = r.trainer.step(state, r.trainer.shard_batch(_tokens(step, 8)))
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.tree.map(np.asarray, state.params)

    one = run(["mesh.data=1"], 1)
    losses, params = run(layout, 8)
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


class PlainAttentionLM(TinyLM):
    """TinyLM with the mistake: attention by ``jax.nn.dot_product_attention`` itself, which
    reads the balanced order of a split sequence as if it were the natural one."""

    def __call__(self, tokens_BT, positions_T):
        x = self.embed(tokens_BT) + self.pos(jnp.asarray(positions_T))[None]
        x = jaxpar.constrain(x, ("batch", "seq", "act_embed"))
        B, L, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, L, 3, 2, D // 2), 3, axis=2)
        o = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
        return self.out(x + o.reshape(B, L, D))


def test_a_context_parallel_model_that_skips_jaxpar_attend_is_refused():
    """A Task declaring ``context_parallel`` whose model never calls ``jaxpar.attend``:
    under ``mesh.context`` > 1 its loss would be wrong (9.4e-3 off one device in the
    campaign), so tracing its step refuses it in one line naming the loss and the fix;
    on one context device the same task trains, and its loss is TinyLM's there."""
    task = dataclasses.replace(TINY_LM, model_fn=PlainAttentionLM, name="plain")

    def step(devices, overrides):
        config = jaxpar.load_config(
            [], ["train.batch_size=8", f"run.devices={devices}", *overrides]
        )
        r = jaxpar.build(config, task)
        return r.trainer.step(r.trainer.init(), r.trainer.shard_batch(_tokens(0, 8)))[1]

    with pytest.raises(
        jaxpar.errors.TaskError,
        match=r"^loss_fn \(test_context\.py:_tiny_lm_loss\) "
        r"ran with each sequence split over 2 devices \(mesh\.context\), but its "
        r"model never called jaxpar\.attend.*or set mesh\.context=1",
    ):
        step(8, ["mesh.context=2", "mesh.data=4"])
    alone = jaxpar.build(jaxpar.load_config([], ["train.batch_size=8", "run.devices=1"]), TINY_LM)
    expected = alone.trainer.step(alone.trainer.init(), alone.trainer.shard_batch(_tokens(0, 8)))[
        1
    ]["loss"]
    np.testing.assert_allclose(float(step(1, [])["loss"]), float(expected), rtol=1e-6)


def test_plan_finds_the_longest_sequence_that_fits(monkeypatch):
    """``jaxpar plan --longest``: doubling ``data.seq_len`` (and ``model.max_seq_len``), the
    longest that fits the memory given and what twice as long needs, per layout. (Each
    sequence length is compiled once: the planner's rows read the programs measured here.)"""
    from jaxpar.lab import hardware, longest
    from tests.helpers import GPT_SMALL, measured_once

    config = jaxpar.load_config([], [*GPT_SMALL, "train.batch_size=8"])
    h100 = hardware.get_profile("h100")
    measure = measured_once()
    at = {
        n: measure(config, f"context=8,data.seq_len={n},model.max_seq_len={n}", h100)
        for n in (16, 32, 64)
    }
    memory = (at[32].mem_total_bytes + at[64].mem_total_bytes) / 2
    assert at[16].mem_total_bytes < at[32].mem_total_bytes < memory < at[64].mem_total_bytes
    monkeypatch.setattr(longest, "measure", measure)
    found = longest.longest_sequence(config, "context=8", h100, memory)
    assert (found.tokens, found.row.mem_total_bytes) == (32, at[32].mem_total_bytes)
    assert found.beyond.mem_total_bytes == at[64].mem_total_bytes and not found.beyond.fits
    text = longest.format_longest([found], memory)
    assert text.startswith("context=8: 32 tokens fit (")


def test_inspect_and_run_names_know_the_context_axis(capsys):
    """``jaxpar inspect`` says how much of each sequence a device holds and how attention
    runs; a run directory's name records the context degree like any layout override."""
    from jaxpar.cli import main

    assert main(["inspect", *MODEL, "mesh.context=4", "mesh.data=2", "context.attention=ring"]) == 0
    out = capsys.readouterr().out
    assert "mesh: data=2 stage=1 fsdp=1 context=4 tensor=1" in out
    assert (
        "sequence split over context: 8 of 32 tokens of each of 4 sequences per device, "
        "a causal one reordered to balance the work; attention ring"
    ) in out
    named = jaxpar.load_config([], ["mesh.context=4", "mesh.data=2", "context.attention=ring"])
    assert named.run.dir.endswith("-context4-data2-attentionring"), named.run.dir
