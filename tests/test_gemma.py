"""The Gemma family without transformers: counts equal the compiled program; KV-cache
decoding equals the forward pass (a pattern that does not divide the layers); pipelines
train as one device, or refuse a chunk the local/global pattern does not divide in one
line; the embedding normalizer is rounded to the compute dtype, as transformers rounds it.
(Against transformers itself: tests/test_hf_gemma.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import ConfigError
from jaxpar.models.gemma import Gemma, GemmaConfig
from tests.helpers import (
    assert_params_close,
    decode_stepwise,
    grid,
    one_device_steps,
    run_steps,
)

SHAPE = dict(
    d_model=32,
    n_layers=5,
    n_heads=4,
    n_kv_heads=2,
    head_size=16,
    d_ff=48,
    max_seq_len=16,
    sliding_window=5,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24.0,
)
GEMMA = [
    "model.name=gemma",
    *(f"model.{k}={v}" for k, v in SHAPE.items()),
    "data.dataset=synthetic",
    "data.seq_len=16",
    "train.batch_size=16",
    "optim.warmup_steps=0",
    "train.eval_every=0",
]


@pytest.mark.parametrize(
    "switches",
    [
        # the suite compiles one program holding every switch: Gemma 3's q/k norms and an
        # untied head (parameters) beside Gemma 2's capped attention, written out (FLOPs);
        # each family's own switches apart, the tied table among them, are extended (the
        # uncapped attention's FLOPs: tests/test_analytic.py's gemma_tiny cases, to 5%)
        pytest.param(
            [
                "model.qk_norm=true",
                "model.tie_embeddings=false",
                "model.attn_softcap=2",
                "model.final_softcap=5",
            ],
            id="qk_norm-untied-capped",
        ),
        pytest.param(
            ["model.qk_norm=true", "model.tie_embeddings=false"],
            id="gemma3-untied",
            marks=pytest.mark.exhaustive,
        ),
        pytest.param(
            ["model.attn_softcap=2", "model.final_softcap=5"],
            id="gemma2-capped",
            marks=pytest.mark.exhaustive,
        ),
    ],
)
def test_counts_match_the_compiled_program(switches):
    """Parameters equal the model's; FLOPs per example × the examples a device computes
    equal the compiled step's (2%), soft-capped attention written out included."""
    from jaxpar import hlo
    from jaxpar.plan import global_batch_shapes

    run = jaxpar.build(jaxpar.load_config([], [*GEMMA, *switches, "mesh.data=8"]))
    counts = run.family.counts(run.config.model, run.data)
    assert counts.params == sum(x.size for x in jax.tree.leaves(run.plan.model.params))
    batch = global_batch_shapes(run.data.batch(0, run.config.train.batch_size), 1)
    flops = hlo.program_cost(run.trainer.compile_step(batch).as_text()).flops
    assert flops == pytest.approx(counts.train_flops_per_example * 2, rel=0.02)


@pytest.mark.parametrize(
    "switches",
    [
        dict(qk_norm=True, rope_theta=1e6, rope_type="linear", rope_factor=8.0),
        dict(attn_softcap=2.0, final_softcap=5.0),
    ],
    ids=["gemma3", "gemma2"],
)
def test_decode_with_cache_matches_forward(switches):
    """A prompt, then one token at a time through the KV cache, past the window: the
    logits of the forward pass (5 layers in a pattern of 3: a scanned group and a tail)."""
    cfg = GemmaConfig(**SHAPE, **switches)
    with nnx.use_eager_sharding(False):
        model = Gemma(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    np.testing.assert_allclose(decode_stepwise(model, tokens, 4), jax.jit(model)(tokens), atol=1e-5)


PIPELINE = [
    "model.n_layers=4",
    "model.sliding_window_pattern=2",
    "model.attn_softcap=2",
    "train.batch_size=8",
]


@pytest.mark.parametrize(
    # the suite's Gemma pipeline: tests/test_pack_families.py's Gemma 3 over stages and context
    "executor",
    grid([pytest.param("spmd", id="spmd"), pytest.param("mpmd", id="mpmd")], set()),
)
def test_pipeline_trains_as_one_device(executor):
    """mesh.stage=2: each chunk holds two layers, a whole (windowed, full) pattern."""
    common = [*GEMMA, *PIPELINE]
    expected, expected_params, _ = one_device_steps(common, steps=2)
    losses, params, _ = run_steps(
        [
            *common,
            "mesh.stage=2",
            "mesh.data=4",
            "pipeline.microbatches=2",
            f"pipeline.executor={executor}",
        ],
        steps=2,
    )
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_params_close(params, expected_params, elementwise=False, rtol=1e-4)


def test_a_chunk_the_pattern_does_not_divide_is_one_line():
    with pytest.raises(ConfigError) as err:
        run_steps(
            [
                *GEMMA,
                *PIPELINE,
                "model.sliding_window_pattern=3",
                "mesh.stage=2",
                "mesh.data=4",
                "pipeline.microbatches=2",
            ],
            steps=1,
        )
    assert "3-layer local/global attention pattern" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_embedding_normalizer_is_rounded_to_the_compute_dtype():
    """transformers multiplies bfloat16 embeddings by √D cast to bfloat16 (√32 → 5.65625)."""
    cfg = GemmaConfig(**SHAPE, dtype="bfloat16")
    with nnx.use_eager_sharding(False):
        model = Gemma(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(8)[None]
    rows = model.embed[...][:8].astype(jnp.bfloat16)
    expected = rows * jnp.asarray(32**0.5, jnp.bfloat16)
    np.testing.assert_array_equal(model.embed_tokens(tokens)[0], expected)
    assert jnp.asarray(32**0.5, jnp.bfloat16) == 5.65625


def test_bad_shapes_are_one_line():
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=3 does not divide model.n_heads=4"):
        jaxpar.load_config([], ["model.name=gemma", "model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match=r"head_size=5: rotary positions need an even"):
        jaxpar.load_config([], ["model.name=gemma", "model.d_model=20"])
