"""State is born sharded (never whole on one device) and donated to the step."""

import math

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxpar import sharding as shd
from jaxpar.config import load_config
from jaxpar.run import build
from tests.helpers import GPT_SMALL


def test_init_creates_sharded_params_and_opt_state():
    run = build(load_config([], [*GPT_SMALL, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]))
    state = run.trainer.init()
    w_in = state.params["blocks"]["w_in"]  # [L=2, D=32, F=64] → W[L, D_fsdp, F_tensor]
    assert w_in.sharding.spec == P(None, "fsdp", "tensor")
    assert {s.data.shape for s in w_in.addressable_shards} == {(2, 8, 32)}
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")["blocks"]["w_in"]  # adamw's
    assert mu.sharding.spec == P(None, "fsdp", "tensor")
    assert {s.data.shape for s in mu.addressable_shards} == {(2, 8, 32)}


def test_init_program_never_holds_a_whole_parameter():
    """Per device, the compiled init program's outputs and temporaries together stay far
    below the whole state: random values are generated shard by shard."""
    run = build(load_config(["configs/gpt_tiny.yaml"], ["mesh.data=1", "mesh.fsdp=8"]))
    trainer, plan = run.trainer, run.plan
    whole = shd.total_bytes(plan.abstract_state)
    per_device = shd.bytes_per_device(plan.abstract_state, plan.state_shardings)
    mem = trainer.compile_init().memory_analysis()
    assert per_device <= mem.output_size_in_bytes <= per_device + 1024  # + tuple tables
    biggest = max(math.prod(x.shape) * 4 for x in jax.tree.leaves(plan.model.params))
    assert mem.temp_size_in_bytes < biggest, "a whole parameter was materialized"
    assert per_device < 0.15 * whole
    state = trainer.init()
    device0 = plan.mesh.devices.flat[0]
    on_device0 = sum(
        s.data.nbytes
        for x in jax.tree.leaves(state)
        for s in x.addressable_shards
        if s.device == device0
    )
    assert on_device0 == per_device


def test_step_donates_the_state():
    run = build(load_config([], [*GPT_SMALL, "mesh.data=8"]))
    state = run.trainer.init()
    old = state.params["embed"]
    new, _ = run.trainer.step(state, run.trainer.shard_batch(run.data.batch(0, 16)))
    assert old.is_deleted()
    assert np.isfinite(np.asarray(new.params["embed"])).all()
