"""Expert parallelism by all-to-all dispatch (jaxpar/models/alltoall.py,
``model.moe_dispatch=all_to_all``). XLA:CPU does not implement ``ragged_all_to_all``, so its
numbers are checked here through :func:`~jaxpar.models.alltoall.emulated` (the collective's
documented semantics by all-gather, itself checked against JAX's documented example): the
dispatch equals the all-gather dispatch (forward and gradients, skewed routing, 2/4/8
devices), training equals one device; the real program lowers to ``ragged_all_to_all``, and
on the CPU the option is refused in one line."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jaxpar
from jaxpar.errors import LayoutError
from jaxpar.models import alltoall
from jaxpar.models.moe import grouped_swiglu, swiglu_groups
from tests.helpers import assert_params_close, grid, one_device_steps, run_steps
from tests.test_moe import CAPPED, MOE, _experts


def _sharded(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, PartitionSpec("e"))) for a in arrays]


def test_the_emulation_follows_the_documented_example():
    """JAX's docstring example of ragged_all_to_all over 2 devices."""
    mesh = jax.make_mesh((2,), ("e",), devices=jax.devices()[:2])
    operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)
    args = [
        jnp.array(a, jnp.int32)
        for a in ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    ]

    def one(op, io, ss, oo, rs):
        return alltoall.emulated(op[0], jnp.zeros(4), io[0], ss[0], oo[0], rs[0], axis_name="e")[
            None
        ]

    f = jax.jit(
        jax.shard_map(one, mesh=mesh, in_specs=PartitionSpec("e"), out_specs=PartitionSpec("e"))
    )
    result = f(*_sharded(mesh, operand, *args))
    np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def _both_dispatches(e: int, n: int = 6, k: int = 2, E: int = 8, D: int = 8):
    """(all-to-all, all-gather) dispatch of skewed routing over ``e`` devices: outputs and
    the gradients of a weighted sum with respect to the tokens and the experts."""
    mesh = jax.make_mesh((e,), ("e",), devices=jax.devices()[:e])
    p, _ = _experts(3, E=E, D=D)
    w = {n_: p[n_] for n_ in ("w_gate", "w_up", "w_down")}
    x = jax.random.normal(jax.random.key(1), (e * n, D))
    # skewed: most assignments to the first two experts (on device 0), some to the last
    experts = jax.random.choice(
        jax.random.key(2), E, (e * n, k), p=jnp.array([0.4, 0.3, 0.05, 0.05, 0.05, 0.05, 0.0, 0.1])
    )
    weights = jax.nn.softmax(jax.random.normal(jax.random.key(4), (e * n, k)), -1)
    probe = jax.random.normal(jax.random.key(5), (e * n, D))
    x, experts, weights, probe = _sharded(mesh, x, experts, weights, probe)
    w = dict(zip(w, _sharded(mesh, *w.values())))

    def a2a(x, ex, wt, w):
        run = lambda rows, sizes: swiglu_groups(rows, sizes, w)  # noqa: E731
        return alltoall.dispatch(x, ex, wt, run, w["w_gate"].shape[0], ("e",))

    def gathered(x, ex, wt, w):
        g = functools.partial(jax.lax.all_gather, axis_name="e", tiled=True)
        first = jax.lax.axis_index("e") * w["w_gate"].shape[0]
        y = grouped_swiglu(g(x), g(ex), g(wt), w, first)
        return jax.lax.psum_scatter(y, "e", scatter_dimension=0, tiled=True)

    def loss_and_grads(body):
        f = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(PartitionSpec("e"),) * 3 + ({n_: PartitionSpec("e") for n_ in w},),
            out_specs=PartitionSpec("e"),
            check_vma=False,
        )

        def value_and_grads(x, w):
            # the gradients of sum(y · probe) are y's vjp of probe: one program for both
            y, vjp = jax.vjp(lambda x, w: f(x, experts, weights, w), x, w)
            return y, vjp(probe)

        return jax.jit(value_and_grads)(x, w)

    return loss_and_grads(a2a), loss_and_grads(gathered)


# the suite: 8 devices of one expert each; several experts a device (4 at e = 2, 2 at
# e = 4) are extended: the suite dispatches 2 a device in the training test below, which
# equals one device
@pytest.mark.parametrize("e", grid([pytest.param(e, id=str(e)) for e in (2, 4, 8)], {"8"}))
def test_all_to_all_dispatch_equals_the_all_gather_dispatch(e, monkeypatch):
    monkeypatch.setattr(alltoall, "RAGGED_ALL_TO_ALL", alltoall.emulated)
    (y, grads), (y_ref, grads_ref) = _both_dispatches(e)
    assert float(jnp.abs(y_ref).max()) > 0.1
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_training_with_all_to_all_dispatch_equals_one_device(monkeypatch):
    """Experts over data=4 beside fsdp=2, with a capacity factor: 3 AdamW steps equal one
    device's (the dispatch traced: both ragged_all_to_all calls of each MoE layer)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["axis_name"])
        return alltoall.emulated(*args, **kwargs)

    monkeypatch.setattr(alltoall, "RAGGED_ALL_TO_ALL", counted)
    # one device with the capacity factor: tests/test_moe.py's capacity reference, run
    # once per test process. Run here, it must not dispatch all to all; run before, it
    # could not have (the real collective, unpatched there, is refused on the CPU).
    one = one_device_steps(CAPPED)
    assert not calls
    losses, params, _ = run_steps(
        [
            *CAPPED,
            "mesh.data=4",
            "mesh.fsdp=2",
            "rules.experts=data",
            "model.moe_dispatch=all_to_all",
        ]
    )
    assert calls and set(calls) == {("data",)}
    np.testing.assert_allclose(losses, one[0], rtol=1e-5)
    assert_params_close(params, one[1], elementwise=False, rtol=1e-4)


def test_the_real_collective_lowers_and_is_refused_on_the_cpu():
    """The program with jax.lax.ragged_all_to_all lowers (for a GPU or TPU to compile); on
    the CPU a run asking for it stops in one line naming the fix."""
    mesh = jax.make_mesh((4,), ("e",), devices=jax.devices()[:4])
    p, _ = _experts(3, E=8, D=8)
    w = {n_: p[n_] for n_ in ("w_gate", "w_up", "w_down")}

    def body(x, ex, wt, w):
        run = lambda rows, sizes: swiglu_groups(rows, sizes, w)  # noqa: E731
        return alltoall.dispatch(x, ex, wt, run, w["w_gate"].shape[0], ("e",))

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(PartitionSpec("e"),) * 3 + ({n_: PartitionSpec("e") for n_ in w},),
            out_specs=PartitionSpec("e"),
            check_vma=False,
        )
    )
    x, ex, wt = _sharded(
        mesh, jnp.ones((16, 8)), jnp.zeros((16, 2), jnp.int32), jnp.full((16, 2), 0.5)
    )
    w = {n_: jax.device_put(a, NamedSharding(mesh, PartitionSpec("e"))) for n_, a in w.items()}
    text = f.lower(x, ex, wt, w).as_text()
    assert text.count("ragged_all_to_all") >= 2  # there and back
    config = jaxpar.load_config(
        [], [*MOE, "mesh.data=8", "rules.experts=data", "model.moe_dispatch=all_to_all"]
    )
    run = jaxpar.build(config)
    with pytest.raises(
        LayoutError,
        match=r"^model.moe_dispatch=all_to_all needs jax.lax."
        r"ragged_all_to_all, which XLA:CPU does not "
        r"implement; on the CPU set model.moe_dispatch="
        r"all_gather",
    ):
        # the train step traced, as its first call does (the refusal is raised in the MoE
        # layer's trace): no state initialized (a compile) for a step that never runs
        run.trainer.lower_step(run.data.batch(0, config.train.batch_size))


def test_the_lab_counts_the_routed_rows_of_the_all_to_all_dispatch():
    """Balanced routing: a device's n·top_k rows of D floats, there and back, and their
    gradients — top_k/e of the all-gather dispatch's gathered and scattered tokens."""
    from jaxpar.config import load_config
    from jaxpar.lab.predict import predict_comm
    from jaxpar.run import build

    layout = [*MOE, "mesh.data=8", "rules.experts=data"]
    by_dispatch = {
        d: predict_comm(build(load_config([], [*layout, f"model.moe_dispatch={d}"])), "cpu").terms
        for d in ("all_gather", "all_to_all")
    }
    a2a = [t for t in by_dispatch["all_to_all"] if t.what.startswith("experts:")]
    n, k, D, e, layers = 16 // 8 * 16, 2, 32, 8, 2  # tokens a device, top_k, d_model
    assert [(t.kind, t.payload_bytes, t.group, t.times) for t in a2a] == [
        ("all-to-all", n * k * D * 4, e, 2 * layers)
    ] * 2
    gathered = [
        t
        for t in by_dispatch["all_gather"]
        if t.what in ("experts: outputs reduce-scattered", "experts: output gradients gathered")
    ]
    assert sum(t.wire_bytes for t in a2a) == pytest.approx(
        k / e * 2 * sum(t.wire_bytes for t in gathered)
    )
