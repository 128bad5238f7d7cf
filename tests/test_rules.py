"""Rules presets give exactly the documented PartitionSpecs; bad rules are errors."""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.config import load_config
from jaxpar.run import build
from tests.helpers import GPT_SMALL

FSDP_TP = {  # the auto / fsdp_tp layout of every GPT parameter
    "embed": P("tensor", "fsdp"),
    "pos": P(None, "fsdp"),
    "head": P("fsdp", "tensor"),
    "ln_f_scale": P("fsdp"),
    "ln_f_bias": P("fsdp"),
    "blocks": {
        "ln1_scale": P(None, "fsdp"),
        "ln1_bias": P(None, "fsdp"),
        "ln2_scale": P(None, "fsdp"),
        "ln2_bias": P(None, "fsdp"),
        "wq": P(None, "fsdp", "tensor", None),
        "wk": P(None, "fsdp", "tensor", None),
        "wv": P(None, "fsdp", "tensor", None),
        "wo": P(None, "tensor", None, "fsdp"),
        "w_in": P(None, "fsdp", "tensor"),
        "b_in": P(None, "tensor"),
        "w_out": P(None, "tensor", "fsdp"),
        "b_out": P(None, "fsdp"),
    },
}


def _drop(tree, axis):
    """FSDP_TP with one mesh axis removed from every spec."""

    def strip(spec):
        return P(*(None if e == axis else e for e in spec))

    return jax.tree.map(strip, tree, is_leaf=lambda x: isinstance(x, P))


def _normalize(tree):
    """Trailing Nones do not change a PartitionSpec's meaning."""

    def norm(spec):
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return jax.tree.map(norm, tree, is_leaf=lambda x: isinstance(x, P))


EXPECTED = {
    ("dp", "mesh.data=8"): jax.tree.map(lambda s: P(), FSDP_TP, is_leaf=lambda x: isinstance(x, P)),
    ("fsdp", "mesh.data=2,mesh.fsdp=4"): _drop(FSDP_TP, "tensor"),
    ("tp", "mesh.data=4,mesh.tensor=2"): _drop(FSDP_TP, "fsdp"),
    ("fsdp_tp", "mesh.data=2,mesh.fsdp=2,mesh.tensor=2"): FSDP_TP,
    ("auto", "mesh.data=2,mesh.fsdp=2,mesh.tensor=2"): FSDP_TP,
}
BATCH = {
    "dp": P("data"),
    "fsdp": P(("data", "fsdp")),
    "tp": P("data"),
    "fsdp_tp": P(("data", "fsdp")),
    "auto": P(("data", "fsdp")),
}


def _run(*overrides):
    return build(load_config([], [*GPT_SMALL, *overrides]))


@pytest.mark.parametrize("preset,mesh", list(EXPECTED))
def test_preset_partition_specs(preset, mesh):
    run = _run(f"rules.preset={preset}", *mesh.split(","))
    assert _normalize(run.plan.param_specs) == _normalize(EXPECTED[(preset, mesh)])
    batch = run.data.batch(0, 16)
    assert _normalize(run.plan.batch_shardings(batch)["tokens"].spec) == BATCH[preset]


def test_fsdp_shards_optimizer_state_like_params():
    run = _run("mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp")
    mu = optax.tree_utils.tree_get(run.plan.state_shardings.opt_state, "mu")  # adamw's
    assert mu["blocks"]["w_in"].spec == run.plan.state_shardings.params["blocks"]["w_in"].spec
    assert mu["blocks"]["w_in"].spec == P(None, "fsdp", None)


def test_override_single_rule_from_command_line():
    run = _run("mesh.data=4", "mesh.tensor=2", "rules.preset=tp", "rules.mlp=null")
    assert run.plan.param_specs["blocks"]["w_in"] == P(None, None, None)
    assert run.plan.param_specs["blocks"]["wq"] == P(None, None, "tensor", None)


@pytest.mark.parametrize(
    "mesh,w_in,batch",
    [
        (["mesh.fsdp=8"], P(None, "fsdp"), P("fsdp")),
        (["mesh.tensor=2"], P(None, None, "tensor"), P("data")),
        (
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
            P(None, "fsdp", "tensor"),
            P(("data", "fsdp")),
        ),
    ],
)
def test_default_rules_work_for_any_degrees(mesh, w_in, batch):
    """With no preset chosen, any degrees give the fsdp_tp layout restricted to the
    axes larger than 1."""
    run = _run(*mesh)
    assert _normalize(run.plan.param_specs["blocks"]["w_in"]) == w_in
    assert _normalize(run.plan.batch_shardings(run.data.batch(0, 16))["tokens"].spec) == batch


def test_unmapped_logical_axis_is_an_error():
    from jaxpar.config import MeshConfig, RulesConfig
    from jaxpar.logical import spec_for
    from jaxpar.mesh import make_mesh
    from jaxpar.rules import resolve_rules

    rules = resolve_rules(RulesConfig())
    mesh = make_mesh(MeshConfig(data=8))
    # "lora_rank" (a LoRA adapter's rank dim) is a name no preset maps
    with pytest.raises(
        ValueError, match="logical axis 'lora_rank' of parameter 'lora/a'.*rules.lora_rank"
    ):
        spec_for(("lora_rank", "embed"), rules, mesh, (8, 16), "parameter 'lora/a'")


def test_indivisible_dim_names_parameter_shape_and_axis_size():
    with pytest.raises(ValueError, match=r"parameter 'blocks/w.*\(2, 32, 4, 8\).*size 8"):
        _run("mesh.data=1", "mesh.tensor=8")


def test_a_batch_the_devices_do_not_divide_names_train_batch_size():
    """A batch entry's rows name the setting that sets them, not the model's size."""
    from jaxpar.config import MeshConfig, RulesConfig
    from jaxpar.logical import spec_for
    from jaxpar.mesh import make_mesh
    from jaxpar.rules import resolve_rules

    rules, mesh = resolve_rules(RulesConfig()), make_mesh(MeshConfig(data=8))
    with pytest.raises(ValueError) as err:
        spec_for(("batch", None), rules, mesh, (12, 20), "batch 'x'")
    assert str(err.value).endswith(
        "of size 8; make train.batch_size a multiple of 8 (each microbatch's, under "
        "accumulation or a pipeline), or change the mesh degrees, or the rule rules.batch"
    )


def test_indivisible_heads_error():
    with pytest.raises(ValueError, match=r"'heads', size 4.*not divisible.*size 8"):
        _run("mesh.data=1", "mesh.tensor=8", "rules.embed=null")


def test_mesh_axis_used_twice_is_an_error():
    with pytest.raises(ValueError, match="mesh axis 'tensor' shards both"):
        _run("mesh.data=4", "mesh.tensor=2", "rules.embed=tensor")


def test_unused_mesh_axis_is_an_error():
    with pytest.raises(ValueError, match="mesh axis 'tensor' has size 2 but no rule"):
        _run("mesh.data=4", "mesh.tensor=2", "rules.preset=dp")


def test_unknown_rule_name_suggests_closest():
    with pytest.raises(
        ValueError, match="rules.mpl' names no logical axis.*did you mean 'rules.mlp'"
    ):
        _run("mesh.data=4", "mesh.tensor=2", "rules.mpl=null")


def test_batch_not_split_over_fsdp_is_an_error():
    with pytest.raises(ValueError, match="batch 'tokens' is not split over mesh axis 'fsdp'"):
        _run("mesh.data=1", "mesh.fsdp=8", "rules.batch=data")


def test_unknown_preset_and_unknown_mesh_axis():
    with pytest.raises(ValueError, match="unknown rules.preset 'zero3'.*fsdp"):
        _run("rules.preset=zero3")
    with pytest.raises(ValueError, match="rules.mlp=model: 'model' is not a mesh axis"):
        _run("rules.mlp=model")


@pytest.mark.parametrize(
    "preset,mesh,expected",
    [
        (
            "tp",
            ["mesh.data=4", "mesh.tensor=2"],
            {
                "residual": P("data"),
                "mlp": P("data", None, "tensor"),
                "logits": P("data", None, "tensor"),
            },
        ),
        (
            "fsdp",
            ["mesh.data=2", "mesh.fsdp=4"],
            {
                "residual": P(("data", "fsdp")),
                "mlp": P(("data", "fsdp")),
                "logits": P(("data", "fsdp")),
            },
        ),
    ],
)
def test_activation_layouts(preset, mesh, expected):
    """constrain() pins activations to the preset's documented layout, e.g. under tp
    X[B_data, T, D] and H[B_data, T, F_tensor]."""
    from jaxpar.logical import activation_rules, constrain

    run = _run(f"rules.preset={preset}", *mesh)
    names = {
        "residual": ("batch", "seq", "act_embed"),
        "mlp": ("batch", "seq", "mlp"),
        "logits": ("batch", "seq", "vocab"),
    }
    x = jax.numpy.zeros((16, 8, 64))

    def pin(x):
        with activation_rules(run.plan.mesh, run.plan.rules):
            return {k: constrain(x, v) for k, v in names.items()}

    out = jax.jit(pin)(x)
    assert {k: _normalize(v.sharding.spec) for k, v in out.items()} == expected


@pytest.mark.parametrize("optim", ["sgd", "adam", "adamw", "lamb", "adafactor"])
def test_optimizer_state_sharded_like_params_under_fsdp(optim):
    """Under fsdp=8 every optimizer keeps about 1/8 of its state per device."""
    from jaxpar import sharding as shd

    run = _run(
        "mesh.data=1",
        "mesh.fsdp=8",
        f"optim.name={optim}",
        "optim.weight_decay=0",
        "model.d_model=64",
        "model.d_ff=128",
    )
    opt = run.plan.abstract_state.opt_state
    per_device = shd.bytes_per_device(opt, run.plan.state_shardings.opt_state)
    total = shd.total_bytes(opt)
    assert total > 0
    assert per_device <= 0.2 * total, f"{optim}: {per_device} of {total} bytes per device"
