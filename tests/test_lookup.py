"""Tokens looked up where the table's rows lie (:func:`jaxpar.tensor_parallel.lookup`,
Megatron's vocabulary-parallel embedding) equal a lookup in the whole table — the rows and
the table's gradient — under each split of the vocabulary and of the tokens; the compiled
step sums the rows (one all-reduce over ``tensor``) and gathers no table. An output layer
read through :func:`jaxpar.logical.gathered` is gathered once for both passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import hlo
from jaxpar.logical import activation_rules, gathered, names_of, spec_for
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.rules import RulesConfig, resolve_rules
from jaxpar.tensor_parallel import TensorConfig, lookup

V, D, B, T = 64, 16, 8, 8
NAMES = ("vocab", "embed")


def _layout(mesh: str, sequence: bool):
    sizes = dict(kv.split("=") for kv in mesh.split(","))
    m = make_mesh(MeshConfig(**{k: int(v) for k, v in sizes.items()}))
    tensor = TensorConfig(sequence=sequence)
    return m, resolve_rules(RulesConfig(preset="fsdp_tp"), tensor), tensor


def _loss_and_grad(table, ids, weights, mesh, rules, tensor, look):
    """The rows' weighted sum and its gradient w.r.t. the table, jitted on ``mesh`` with
    the table laid out as the rules say."""

    def loss(table_VD):
        with activation_rules(mesh, rules, tensor):
            rows = look(table_VD, ids, NAMES)
        return jnp.sum(rows * weights), rows

    spec = spec_for(NAMES, rules, mesh, table.shape, "table")
    table = jax.device_put(table, NamedSharding(mesh, spec))
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return step, step(table)


@pytest.mark.parametrize(
    "mesh, sequence",
    [
        ("data=2,fsdp=2,tensor=2", False),
        ("data=2,fsdp=2,tensor=2", True),
        ("data=2,tensor=4", True),
        ("data=2,context=2,tensor=2", True),  # ids split over the sequence too
        ("fsdp=4,context=2", False),  # no tensor: the whole table, as before
    ],
)
def test_a_lookup_where_the_rows_lie_equals_the_whole_tables(mesh, sequence):
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, D)).astype(np.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    m, rules, tensor = _layout(mesh, sequence)
    step, ((_, rows), grad) = _loss_and_grad(table, ids, weights, m, rules, tensor, lookup)
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(ids)])
    expected = np.zeros_like(table)
    np.add.at(expected, np.asarray(ids).ravel(), np.asarray(weights).reshape(-1, D))
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-6)
    text = step.lower(jnp.asarray(table)).compile().as_text()
    t = m.shape["tensor"]
    if t > 1:  # the rows [b, T, D] summed over tensor; no table gathered whole
        tables = [s for s, _ in _collectives(text, "all-gather") if len(s) == 2 and s[0] == V]
        assert tables == []
        # under sequence parallelism reduce-scattered along the sequence, each device
        # keeping its tokens' rows as the split residual stream holds them
        kind = "reduce-scatter" if sequence else "all-reduce"
        summed = [s for s, g in _collectives(text, kind) if g == t and len(s) == 3]
        assert summed and all(s[-1] == D for s in summed), summed
        if sequence:
            assert not [s for s, _ in _collectives(text, "all-reduce") if len(s) == 3]
            assert all(s[1] == T // m.shape["context"] // t for s in summed), summed
            assert "tensor" in names_of(rows.sharding.spec[1])


@pytest.mark.parametrize("case", ["tensor splits the batch", "an odd batch", "bfloat16"])
def test_a_lookup_whose_tokens_cannot_split_so_is_still_exact(case):
    """Where ``tensor`` also splits the batch (each device of a group holds other
    tokens), or the batch axes do not divide the batch, the rows come from the whole
    table; a bfloat16 table's rows are summed in float32 (XLA:CPU aborts on a bfloat16
    sum) and come back in bfloat16. Each equals the lookup in the whole table."""
    m, rules, tensor = _layout("data=2,fsdp=2,tensor=2", False)
    rows_n, dtype = B, np.float32
    if case == "tensor splits the batch":
        rules = {**rules, "batch": ("data", "fsdp", "tensor")}
    elif case == "an odd batch":
        rows_n = 6
    else:
        dtype = jnp.bfloat16
    rng = np.random.default_rng(3)
    table = rng.normal(size=(V, D)).astype(dtype)
    ids = jnp.asarray(rng.integers(0, V, (rows_n, T)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(rows_n, T, D)), dtype)
    _, ((_, rows), grad) = _loss_and_grad(table, ids, weights, m, rules, tensor, lookup)
    assert rows.dtype == table.dtype
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(table)[np.asarray(ids)])
    expected = np.zeros((V, D), np.float32)
    np.add.at(expected, np.asarray(ids).ravel(), np.asarray(weights, np.float32).reshape(-1, D))
    tol = 1e-6 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(grad, np.float32), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "mesh, sequence",
    [("data=2,fsdp=2,tensor=2", False), ("data=2,fsdp=2,tensor=2", True), ("data=4,fsdp=2", False)],
)
def test_a_copy_per_batch_shard_is_read_as_the_whole_table(mesh, sequence):
    """A tied table read as one copy per batch shard, W[G, V, D] (GPT's: the lookup and
    the head add their gradient contributions on each device): batch shard g's rows come
    from copy g, whose gradient holds only its shard's tokens — where the vocabulary is
    split over ``tensor`` (no copy gathered; under sequence parallelism the rows
    reduce-scattered) and where it is not."""
    rng = np.random.default_rng(2)
    table = rng.normal(size=(V, D)).astype(np.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    m, rules, tensor = _layout(mesh, sequence)
    g = m.shape["data"] * m.shape["fsdp"]

    def loss(table_VD):
        with activation_rules(m, rules, tensor):
            copies = jnp.broadcast_to(table_VD[None], (g, V, D))
            rows = lookup(copies, ids, ("batch", *NAMES))
        return jnp.sum(rows * weights), rows

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, rows), grad = step(jnp.asarray(table))
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(ids)])
    expected = np.zeros_like(table)
    np.add.at(expected, np.asarray(ids).ravel(), np.asarray(weights).reshape(-1, D))
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-6)
    if m.shape["tensor"] > 1:  # no copy gathered over its vocabulary
        text = step.lower(jnp.asarray(table)).compile().as_text()
        assert not [s for s, _ in _collectives(text, "all-gather") if V in s[-2:-1]]
        scattered = [s for s, _ in _collectives(text, "reduce-scatter") if s[-1] == D]
        assert scattered == ([(B // g, T // m.shape["tensor"], D)] if sequence else [])


def _collectives(text: str, kind: str) -> list[tuple[tuple[int, ...], int]]:
    """Each ``kind`` collective's result shape and group size in ``text``."""
    module = hlo.parse(text)
    out = []
    for insts in module.computations.values():
        for inst in insts:
            if inst.opcode.removesuffix("-start") == kind:
                dims = hlo.arrays(inst.type)[-1][1]
                out.append((tuple(dims), hlo.group_size(inst, module.num_partitions)))
    return out


def test_an_output_layer_read_through_gathered_is_gathered_once_for_both_passes():
    """``x @ W`` with W [D, V] split (fsdp, tensor): the backward pass's input gradient
    reads the forward's gathered W; left to the partitioner, XLA 0.10 gathers it again
    (its two gathers name the same groups in different forms)."""
    m, rules, tensor = _layout("data=2,fsdp=2,tensor=2", False)
    rng = np.random.default_rng(1)
    w = rng.normal(size=(D, V)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    spec = spec_for(("embed", "vocab"), rules, m, w.shape, "head")
    w = jax.device_put(w, NamedSharding(m, spec))
    x = jax.device_put(x, NamedSharding(m, P(("data", "fsdp"))))

    def gathers(read):
        def loss(w_DV, x_BTD):
            with activation_rules(m, rules, tensor):
                y = jnp.einsum("btd,dv->btv", x_BTD, read(w_DV))
            return jnp.sum(jnp.sin(y))

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        text = step.lower(w, x).compile().as_text()
        return step(w, x), [s for s, _ in _collectives(text, "all-gather") if s == (D, V // 2)]

    (gw, gx), once = gathers(lambda w_DV: gathered(w_DV, ("embed", "vocab")))
    (gw0, gx0), _ = gathers(lambda w_DV: w_DV)
    assert len(once) == 1
    np.testing.assert_allclose(np.asarray(gw), np.asarray(gw0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx0), rtol=1e-6)
