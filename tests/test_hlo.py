"""The HLO reader on a fixed module: collectives inside and outside while loops."""

from jaxpar import hlo

MODULE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch_0 (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %ar.1 = f32[4] all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%branch_1 (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %cp = f32[4] collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4] get-tuple-element(%t), index=1
  %c = f32[4] conditional(%i, %x, %x), branch_computations={%branch_0, %branch_1}
  ROOT %r = (s32[], f32[4]) tuple(%i, %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> (f32[4], f32[4]) {
  %x = f32[4] parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]) tuple(%z, %x)
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body
  %y = f32[4] get-tuple-element(%w), index=1
  %ar.2 = (f32[4], f32[4]) all-reduce(%y, %x), replica_groups={{0,1}}, to_apply=%add
  ROOT %g = f32[4] get-tuple-element(%ar.2), index=0
}
"""


def test_loop_computations_follow_body_and_every_branch():
    assert hlo.loop_computations(MODULE) >= {"body", "branch_0", "branch_1"}
    assert "main" not in hlo.loop_computations(MODULE)


def test_count_ops_inside_and_outside_loops():
    assert hlo.count_ops(MODULE, "all-reduce") == 2
    assert hlo.count_ops(MODULE, "all-reduce", in_loops=True) == 1  # in branch 0
    assert hlo.count_ops(MODULE, "all-reduce", in_loops=False) == 1  # the tuple one
    assert hlo.count_ops(MODULE, "collective-permute", in_loops=True) == 1  # in branch 1
    assert hlo.count_ops(MODULE, "conditional", in_loops=True) == 1
    assert hlo.count_ops(MODULE, "all-gather") == 0


def test_branch_names_without_percent_signs():
    plain = MODULE.replace("%branch_0, %branch_1", "branch_0, branch_1")
    assert hlo.loop_computations(plain) >= {"branch_0", "branch_1"}


def test_program_cost_counts_loop_trips_and_the_costliest_branch():
    # the loop records no trip count: counted once, and reported as unknown
    cost = hlo.program_cost(MODULE)
    assert cost.unknown_loops == 1
    ar, cp = cost.collectives["all-reduce"], cost.collectives["collective-permute"]
    # branch 0's all-reduce of 16 B inside the loop + the tuple of 2 × 16 B outside
    assert (ar.count, ar.payload_bytes) == (2, 48)
    # participants: each all-reduce's group of 2; the permute, every device (1 here)
    assert (ar.participants, cp.participants) == (2 + 2, 1)
    assert ar.wire_bytes == 48 * 2 * (2 - 1) / 2
    assert (cp.count, cp.payload_bytes) == (1, 16)
    assert cp.wire_bytes == 16 * 2 / 1  # 2 pairs over num_partitions (1 when not printed)
    with_trips = MODULE.replace(
        "body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}'
    )
    looped = hlo.program_cost(with_trips).collectives["all-reduce"]
    assert (looped.count, looped.payload_bytes) == (6, 5 * 16 + 32)
    assert looped.participants == 6 * 2


ASYNC = """HloModule async, num_partitions=8

ENTRY %main (p: f32[16,4]) -> f32[128,16] {
  %p = f32[16,4]{1,0} parameter(0)
  %ags = (f32[16,4]{1,0}, f32[128,4]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[128,4]{1,0} all-gather-done(%ags)
  %ars = f32[128,4]{1,0} all-reduce-start(%agd), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ard = f32[128,4]{1,0} all-reduce-done(%ars)
  %rs = f32[32,4]{1,0} reduce-scatter(%ard), replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, to_apply=%add
  %cps = (f32[32,4]{1,0}, f32[32,4]{1,0}, u32[], u32[]) collective-permute-start(%rs), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[32,4]{1,0} collective-permute-done(%cps)
  %a2a = bf16[32,4]{1,0} all-to-all(%cpd), replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'a'}, dimensions={0}
  ROOT %d = f32[128,16]{1,0} dot(%agd, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_async_forms_and_every_replica_group_syntax_give_exact_bytes():
    """Bytes, arrays and participants (each collective's group; a permute's: all 8)."""
    cost = hlo.program_cost(ASYNC)
    stats = cost.collectives
    assert stats["all-gather"] == hlo.CollectiveStat(
        1, 128 * 4 * 4, 128 * 4 * 4 * 7 / 8, arrays=1, participants=8
    )
    assert stats["all-reduce"] == hlo.CollectiveStat(
        1, 2048, 2048 * 2 * 3 / 4, arrays=1, participants=4
    )
    # reduce-scatter: payload = n × result over the 4 devices of axis 'b'
    assert stats["reduce-scatter"] == hlo.CollectiveStat(
        1, 4 * 512, 4 * 512 * 3 / 4, arrays=1, participants=4
    )
    # 4 of 8 devices send 512 B: 256 B per device on average
    assert stats["collective-permute"] == hlo.CollectiveStat(1, 512, 256, arrays=1, participants=8)
    assert stats["all-to-all"] == hlo.CollectiveStat(
        1, 256, 256 * 1 / 2, arrays=1, participants=2
    )  # bf16, axis 'a' = 2
    assert cost.collective_participants == 8 + 4 + 4 + 8 + 2


def test_dot_flops_use_the_contracting_dims():
    # [128, 4] · [16, 4]ᵀ → [128, 16]: 2 · 128 · 16 · 4
    assert hlo.program_cost(ASYNC).flops == 2 * 128 * 16 * 4


#: lines of the train step XLA compiled for one NVIDIA H200 (gpt2_small, batch 8 × 1024,
#: JAX 0.11.2; benchmarks/gpt2_small_h200_step_save_dots.hlo.txt.gz), shortened to what the counter
#: reads: a cuBLASLt gemm and cuDNN's fused attention, forward and backward
GPU = """HloModule jit_step, num_partitions=1

ENTRY %main (a: bf16[8192,768], b: bf16[768,2304], q: bf16[8,1024,12,64], s: f32[8,12,1024]) -> bf16[8,12,1024,64] {
  %a = bf16[8192,768]{1,0} parameter(0)
  %b = bf16[768,2304]{1,0} parameter(1)
  %q = bf16[8,1024,12,64]{3,2,1,0} parameter(2)
  %s = f32[8,12,1024]{2,1,0} parameter(3)
  %custom-call.10 = (bf16[8192,2304]{1,0}, s8[33554432]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_imag":0,"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"},"operation_queue_id":"0"}
  %fwd = (bf16[8,12,1024,64]{3,1,2,0}, f32[8,12,1024]{2,1,0}, u8[256]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"bmm1_dot_dimension_numbers":{"lhs_batch_dimensions":["0","2"],"lhs_contracting_dimensions":["3"],"rhs_batch_dimensions":["0","2"],"rhs_contracting_dimensions":["3"]},"intermediate_tensor_shape":{"dimensions":["8","12","1024","1024"],"element_type":"BF16"},"is_flash_attention":true,"mask_type":"CAUSAL"}}
  ROOT %bwd = (bf16[8,12,1024,64]{3,1,2,0}, bf16[8,12,1024,64]{3,1,2,0}, bf16[8,12,1024,64]{3,1,2,0}, u8[25559296]{0}) custom-call(%q, %q, %q, %s, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["8","12","1024","1024"],"element_type":"BF16"},"is_flash_attention":true,"mask_type":"CAUSAL"}}
}
"""


def test_a_gpu_programs_library_matmuls_and_fused_attention_count_their_flops():
    """On a GPU XLA hands matmuls to cuBLAS and attention to cuDNN as custom calls (no
    ``dot`` left for the counter): a gemm counts 2·M·N·K from its backend config's
    contracting dims; the fused attention 2·B·N·T·S·D per product over its scores, two
    forward and five backward (FlashAttention-2 recomputes the scores)."""
    scores = 8 * 12 * 1024 * 1024 * 64
    assert hlo.program_cost(GPU).flops == 2 * 8192 * 2304 * 768 + (2 + 5) * 2 * scores


#: a strided 3×3 convolution's step as cuDNN runs it: XLA's conv rewriter gives each call
#: the forward's window and dimension labels (xla/service/gpu/transforms/conv_rewriter.cc;
#: written here in XLA's printed form, not taken from a GPU's program), the kernel's output
#: features first (``o01i``), so that taking the wrong arrays for either backward call
#: counts a different number
CUDNN_CONV = """HloModule jit_grad, num_partitions=1

ENTRY %main (x: f32[8,32,32,16], k: f32[32,3,3,16], dy: f32[8,16,16,32]) -> f32[32,3,3,16] {
  %x = f32[8,32,32,16]{3,2,1,0} parameter(0)
  %k = f32[32,3,3,16]{3,2,1,0} parameter(1)
  %dy = f32[8,16,16,32]{3,2,1,0} parameter(2)
  %y = (f32[8,16,16,32]{3,2,1,0}, u8[0]{0}) custom-call(%x, %k), window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %dx = (f32[8,32,32,16]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %k), window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput"
  %reordered = s8[32,3,3,16]{3,2,1,0} custom-call(%k), custom_call_target="__cudnn$convReorderFilter"
  ROOT %dk = (f32[32,3,3,16]{3,2,1,0}, u8[16]{0}) custom-call(%x, %dy), window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
}
"""


def test_cudnn_convolutions_count_the_forwards_flops_as_the_cpus_gradient_does():
    """cuDNN's forward, backward-input and backward-filter calls each do the forward's
    multiply-adds (2 · 8·16·16 outputs · 32 features · 3·3·16; an int8 filter's
    reordering none): together exactly what the counter reads from the gradient XLA:CPU compiles for the same convolution as three
    ``convolution`` instructions (one with the zeros of its stride inserted)."""
    import jax
    import jax.numpy as jnp

    def loss(x, k):
        dims = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(x, k, (2, 2), ((1, 1), (1, 1)), dimension_numbers=dims)
        return jnp.sum(y**2)

    cpu = _compiled_text(
        jax.grad(loss, argnums=(0, 1)), jnp.ones((8, 32, 32, 16)), jnp.ones((3, 3, 16, 32))
    )
    forward = 2 * 8 * 16 * 16 * 32 * 3 * 3 * 16
    assert hlo.program_cost(CUDNN_CONV).flops == 3 * forward == hlo.program_cost(cpu).flops


def test_the_step_compiled_for_an_h200_counts_the_models_flops():
    """The whole train step XLA compiled for one H200 (gpt2_small under ``save_dots``):
    every weight's matmuls 6·N a token (cuBLAS gemms and Triton gemm fusions), and
    attention 18·T·d a layer and token where XLA's own counts 12: the fused forward runs
    again in the backward (a policy that saves dots keeps no custom call's output), and
    the fused backward recomputes the scores. Before GPU custom calls were counted, the
    same model's step on an H100 read 0.00 of the model's FLOPs (docs/performance.md)."""
    import gzip
    from pathlib import Path

    path = (
        Path(__file__).resolve().parents[1] / "benchmarks/gpt2_small_h200_step_save_dots.hlo.txt.gz"
    )
    with gzip.open(path, "rt") as f:
        cost = hlo.program_cost(f.read())
    tokens, layers, seq, d, d_ff, vocab = 8 * 1024, 12, 1024, 768, 3072, 50304
    weights = layers * (4 * d * d + 2 * d * d_ff) + vocab * d
    assert cost.flops == tokens * (6 * weights + 18 * layers * seq * d)
    assert cost.unknown_loops == 0 and cost.collective_ops == 0


# ---- real compiled programs: known collectives of known sizes ------------------------------
def _compiled_text(fn, *args):
    import jax

    return jax.jit(fn).lower(*args).compile().as_text()


def _mesh():
    import jax

    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def test_compiled_psum_all_gather_and_ppermute_byte_counts():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()

    def body(x):  # per device: x is f32[256]
        total = jax.lax.psum(x, "x")  # all-reduce of 1 KiB
        gathered = jax.lax.all_gather(x[:32], "x", tiled=True)  # f32[256] result
        shifted = jax.lax.ppermute(x[:64], "x", [(i, (i + 1) % 8) for i in range(8)])
        return total + gathered + jnp.tile(shifted, 4)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    stats = hlo.collective_stats(_compiled_text(fn, jnp.ones(2048, jnp.float32)))
    assert stats["all-reduce"] == hlo.CollectiveStat(1, 1024, 1024 * 2 * 7 / 8, 1, 8)
    assert stats["all-gather"] == hlo.CollectiveStat(1, 1024, 1024 * 7 / 8, 1, 8)
    assert stats["collective-permute"] == hlo.CollectiveStat(1, 256, 256, 1, 8)
    assert stats["reduce-scatter"].count == stats["all-to-all"].count == 0


def test_compiled_collectives_in_a_scan_count_once_per_iteration():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def body(x):  # f32[64] per device, reduced in each of 5 iterations
        def step(c, _):
            return c + jax.lax.psum(c, "x") * 1e-3, None

        return jax.lax.scan(step, x, None, length=5)[0]

    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"))
    cost = hlo.program_cost(_compiled_text(fn, jnp.ones(512, jnp.float32)))
    assert cost.unknown_loops == 0
    assert cost.collectives["all-reduce"] == hlo.CollectiveStat(
        5, 5 * 256, 5 * 256 * 2 * 7 / 8, arrays=5, participants=5 * 8
    )


def test_compiled_matmul_flops_match_cost_analysis_and_scale_with_a_scan():
    import jax
    import jax.numpy as jnp

    a, b = jnp.ones((64, 32)), jnp.ones((32, 32))
    text = _compiled_text(jnp.dot, a, b)
    xla = jax.jit(jnp.dot).lower(a, b).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert hlo.program_cost(text).flops == 2 * 64 * 32 * 32 == xla["flops"]

    def looped(a, b):  # each iteration multiplies the carry: 4 dots, one loop body
        return jax.lax.scan(lambda c, _: (jnp.tanh(jnp.dot(c, b)), None), a, None, length=4)[0]

    assert hlo.program_cost(_compiled_text(looped, a, b)).flops == 4 * 2 * 64 * 32 * 32
