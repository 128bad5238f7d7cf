"""The Llama-style family (``model.name=llama``): every layout and both pipeline executors
equal one device; grouped-query attention with more tensor devices than key/value heads;
KV-cache decoding equals the forward pass; counts equal the compiled program; bad input is
one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import ConfigError
from jaxpar.models.llama import Llama, LlamaConfig
from tests.helpers import (
    assert_params_close,
    decode_stepwise,
    grid,
    one_device_steps,
    run_steps,
)

LLAMA = [
    "model.name=llama",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=48",
    "model.n_layers=4",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.batch_size=16",
    "optim.name=adamw",
    "optim.lr=3e-3",
    "optim.warmup_steps=0",
    "optim.weight_decay=0.1",
    "optim.clip_norm=1.0",
]
STAGES = ["pipeline.microbatches=4"]


@pytest.mark.parametrize(
    "layout",
    grid(
        [
            pytest.param(["mesh.data=8"], id="data8"),
            pytest.param(["mesh.data=1", "mesh.fsdp=8"], id="fsdp8"),
            pytest.param(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], id="data2-fsdp2-tensor2"),
            pytest.param(
                ["mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "pipeline.executor=spmd", *STAGES],
                id="stage2-spmd-tensor2",
            ),
            pytest.param(
                ["mesh.data=4", "mesh.stage=2", "pipeline.executor=mpmd", *STAGES], id="stage2-mpmd"
            ),
            pytest.param(
                ["mesh.data=2", "mesh.context=4", "context.attention=ring"], id="context4-ring"
            ),
        ],
        # a Llama stack under mpmd: tests/test_moe.py's pipelines. context4-ring is
        # extended: the Llama under context against one device in every suite in
        # tests/test_sequence_parallel.py's llama-fsdp=2,context=2,tensor=2 (all_gather) and
        # tests/test_ulysses.py's llama_kv2 case; the ring's one Llama-like branch, grouped
        # key/value heads repeated to the query heads (jaxpar.context._specs), round a
        # balanced ring with gradients in tests/test_pack_families.py's
        # gemma3-mesh.context=4,context.attention=ring
        {"data2-fsdp2-tensor2"},
    ),
)
def test_llama_layouts_equal_one_device(layout):
    """Losses of 3 AdamW steps and the final parameters equal one device's (with a
    pipeline: one device accumulating the same 4 microbatches)."""
    micro = 4 if any("stage" in x for x in layout) else 1
    one = one_device_steps([*LLAMA, f"train.grad_accum={micro}"])
    losses, params, run = run_steps([*LLAMA, *layout])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


def test_more_tensor_devices_than_key_value_heads():
    """``tensor=4`` over 2 key/value heads: they cannot split 4 ways, so a warning says
    every device of the tensor group holds both; the query heads still split; the numbers
    equal one device's."""
    with pytest.warns(
        UserWarning,
        match=r"rules.kv_heads=tensor: 2 kv_heads of 'blocks/wk' "
        r"do not split 4 ways, so they are not sharded",
    ):
        losses, params, run = run_steps([*LLAMA, "mesh.data=2", "mesh.tensor=4"])
    specs = run.plan.param_specs["blocks"]
    assert specs["wk"] == jax.sharding.PartitionSpec(None, None, None, None)
    assert specs["wq"] == jax.sharding.PartitionSpec(None, None, "tensor", None)
    one = one_device_steps([*LLAMA, "train.grad_accum=1"])
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


# the suite: 2 key/value heads for 4 query heads (groups of 2); 1 (one group) and 4 (groups
# of 1), the same cache and grouping code at other group sizes, in the extended tier
@pytest.mark.parametrize("kv_heads", grid([pytest.param(n, id=str(n)) for n in (1, 2, 4)], {"2"}))
def test_decode_with_cache_matches_forward(kv_heads):
    """A prompt, then one token at a time through the KV cache: the logits of the full
    forward pass (grouped-query attention with 1, 2 and 4 key/value heads)."""
    cfg = LlamaConfig(
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        d_ff=48,
        max_seq_len=16,
        rope_theta=500000.0,
    )
    with nnx.use_eager_sharding(False):
        model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
    np.testing.assert_allclose(decode_stepwise(model, tokens, 6), jax.jit(model)(tokens), atol=1e-5)


def test_counts_match_the_compiled_program():
    """Parameters equal the model's; FLOPs per example × the examples a device computes
    equal the compiled step's (2%); the untied head counts; so do the variants' biases,
    norms and head dims (a window changes no FLOP count: XLA computes the masked
    products)."""
    from jaxpar import hlo
    from jaxpar.plan import global_batch_shapes

    variants = (
        ["model.tie_embeddings=false"],
        # Qwen2's biases on a tied table; Qwen3's norms and own head dim with Mistral's window
        ["model.tie_embeddings=true", "model.qkv_bias=true"],
        ["model.qk_norm=true", "model.head_size=16", "model.sliding_window=4"],
    )
    for variant in variants:
        run = jaxpar.build(jaxpar.load_config([], [*LLAMA, "mesh.data=8", *variant]))
        counts = run.family.counts(run.config.model, run.data)
        assert counts.params == sum(x.size for x in jax.tree.leaves(run.plan.model.params))
        batch = global_batch_shapes(run.data.batch(0, run.config.train.batch_size), 1)
        flops = hlo.program_cost(run.trainer.compile_step(batch).as_text()).flops
        assert flops == pytest.approx(counts.train_flops_per_example * 2, rel=0.02)


def test_bad_shapes_are_one_line():
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=3 does not divide model.n_heads=4"):
        jaxpar.load_config([], ["model.name=llama", "model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match=r"d_model=30 is not divisible by model.n_heads=4"):
        jaxpar.load_config([], ["model.name=llama", "model.d_model=30"])
    with pytest.raises(
        ConfigError,
        match=r"model.rope_factor=8.0 has no effect with "
        r"model.rope_type=default",
    ):
        jaxpar.load_config([], ["model.name=llama", "model.rope_factor=8"])


@pytest.mark.parametrize(
    "layout",
    grid(
        [pytest.param(x, id=x) for x in ("data=8", "data=4,tensor=2", "data=2,fsdp=2,tensor=2")],
        {"data=2,fsdp=2,tensor=2"},
    ),
)
def test_the_lab_predicts_llama_collectives(layout):
    """Under tensor parallelism the Llama's backward all-reduces five input gradients a
    layer (q, k, v, gate, up): the step's collective bytes equal the lab's prediction (2%)."""
    from jaxpar.lab import hardware, sweep

    row = sweep.measure(jaxpar.load_config([], LLAMA), layout, hardware.get_profile("h100"))
    assert row.ok, row.error
    assert row.comm_ratio == pytest.approx(1.0, abs=0.02), layout
