"""Any Optax transformation: optimizer-state shardings follow the state's structure (each
per-parameter statistic gets its parameter's sharding, everything else is replicated),
and ``lr`` is logged when it can be read and left out otherwise — never NaN."""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.config import load_config
from jaxpar.run import build
from jaxpar.sharding import path_str
from tests.helpers import grid


class TwoOfAShape(nnx.Module):
    """Two parameters of one shape, sharded differently: shapes cannot tell them apart."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.1)
        self.a = nnx.Param(init(rngs.params(), (16, 16)), out_sharding=("embed", "mlp"))
        self.b = nnx.Param(init(rngs.params(), (16, 16)), out_sharding=("mlp", "embed"))
        self.bias = nnx.Param(np.zeros(16, np.float32), out_sharding=("mlp",))

    def __call__(self, x):
        return (x @ self.a[...]) @ self.b[...] + self.bias[...]


def _data(step, n):
    rng = np.random.default_rng(step)
    return {
        "x": rng.normal(size=(n, 16)).astype(np.float32),
        "y": rng.normal(size=(n, 16)).astype(np.float32),
    }


TASK = jaxpar.Task(
    TwoOfAShape,
    lambda m, b: (((m(b["x"]) - b["y"]) ** 2).mean(), {}),
    {"x": ("batch", None), "y": ("batch", None)},
    data=_data,
    name="two",
)
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.batch_size=16"]


def _param_of(opt_path, params):
    """The test's own oracle: the parameter an optimizer-state leaf belongs to, by the
    longest suffix of its key path that names a parameter (not what jaxpar uses)."""
    keys = path_str(opt_path).split("/")
    flat = {path_str(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
    for start in range(len(keys)):
        name = "/".join(keys[start:])
        if name in flat:
            return name, flat[name]
    return None, None


def check_leaf_by_leaf(run):
    """Every optimizer-state leaf has its parameter's sharding when it has its parameter's
    shape, and is replicated otherwise. Returns (sharded, replicated) leaf counts."""
    trainer, plan = run.trainer, run.plan
    params, param_sh = plan.model.params, plan.state_shardings.params
    specs = {path_str(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(param_sh)}
    sharded = replicated = 0
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract_state.opt_state)
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(plan.state_shardings.opt_state)):
        name, param = _param_of(path, params)
        where = path_str(path)
        if param is not None and leaf.shape == param.shape:
            assert sharding.spec == specs[name], where
            sharded += 1
        else:
            assert sharding.is_fully_replicated, where
            replicated += 1
    state = trainer.init()  # and the state really is born with those shardings
    for leaf, sharding in zip(
        jax.tree.leaves(state.opt_state), jax.tree.leaves(plan.state_shardings.opt_state)
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    return sharded, replicated


@pytest.mark.parametrize(
    "name,moments",
    grid(
        [
            pytest.param("adamw", 2, id="adamw-2"),
            pytest.param("lamb", 2, id="lamb-2"),
            pytest.param("adafactor", None, id="adafactor-None"),
        ],
        # the suite: AdamW's two parameter-shaped moments and Adafactor's factored,
        # replicated ones; LAMB's state is the same two moments as AdamW's, placed by the
        # same leaf-by-leaf rule: extended
        {"adamw-2", "adafactor-None"},
    ),
)
def test_builtin_optimizers_state_follows_parameters(name, moments):
    """gpt_tiny's dims (128, 512) are large enough for Adafactor to factor its second
    moments (it factors dims ≥ 128)."""
    run = build(load_config(["configs/gpt_tiny.yaml"], [*LAYOUT[:3], f"optim.name={name}"]))
    n_params = len(jax.tree.leaves(run.plan.model.params))
    sharded, replicated = check_leaf_by_leaf(run)
    if moments:
        assert sharded == moments * n_params and run.plan.opt_replicated == []
    else:  # Adafactor: factored rows/columns are not parameter-shaped → replicated, noted
        assert sharded >= 1 and run.plan.opt_replicated
        assert all(
            "v_row" in p or "v_col" in p or "v" in p.split("/") for p, _ in run.plan.opt_replicated
        )


def test_user_chain_with_masked_and_multisteps():
    """optax.MultiSteps(chain(clip, masked(adamw), masked(sgd momentum))): accumulated
    gradients, both masks' moments and momenta follow their parameters; two parameters of
    one shape keep their own shardings; the chain trains."""
    is_matrix = lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
    is_vector = lambda p: jax.tree.map(lambda x: x.ndim == 1, p)
    tx = optax.MultiSteps(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.masked(optax.adamw(1e-2), is_matrix),
            optax.masked(optax.sgd(1e-2, momentum=0.9), is_vector),
        ),
        every_k_schedule=2,
    )
    run = build(load_config([], LAYOUT), TASK, tx)
    sharded, _ = check_leaf_by_leaf(run)
    # acc_grads (3) + adamw mu, nu (2 × 2 matrices) + sgd trace (1 vector)
    assert sharded == 3 + 4 + 1
    mu = run.plan.state_shardings.opt_state.inner_opt_state[1].inner_state[0].mu
    assert mu["a"].spec == P("fsdp", "tensor") and mu["b"].spec == P("tensor", "fsdp")
    state = run.trainer.init()
    losses = []
    for step in range(4):
        state, metrics = run.trainer.step(state, run.trainer.shard_batch(_data(step, 16)))
        losses.append(float(metrics["loss"]))
        assert "lr" not in metrics  # no schedule jaxpar knows, nothing injected
    assert losses[3] < losses[0]


def _logged_lrs(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r.get("lr") for r in rows if "loss" in r]


def test_lr_is_logged_when_readable_and_never_nan(tmp_path):
    # a schedule with a distinct rate at every count: 0, 2.5e-3, 5e-3, 7.5e-3, then 1e-2
    warmup = ["optim.lr=1e-2", "optim.warmup_steps=4", "optim.schedule=constant"]
    jaxpar_tx, schedule = jaxpar.optim.make_optimizer(load_config([], warmup).optim, 6)
    injected = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(0.0, 1e-2, 4)
    )
    at = lambda counts: [float(schedule(c)) for c in counts]
    expected = {  # the rate each step's update applied (the last applied one in between)
        "injected": at(range(6)),
        "config": at(range(6)),
        "plain": [None] * 6,
        # MultiSteps updates every second step: counts 0, 1, 2 on steps 2, 4, 6; the
        # accumulating steps log the rate of the last update (step 1: the initial one)
        "multisteps": at([0, 0, 0, 1, 1, 2]),
    }
    for name, tx in (
        ("injected", injected),
        ("plain", optax.adam(1e-2)),
        ("config", None),
        ("multisteps", optax.MultiSteps(jaxpar_tx, every_k_schedule=2)),
    ):
        run_dir = tmp_path / name
        own = warmup if tx is None else []  # the config's optim section builds None
        jaxpar.train(
            load_config(
                [],
                [
                    *LAYOUT,
                    *own,
                    "train.steps=6",
                    "train.log_every=1",
                    "train.progress=false",
                    f"run.dir={run_dir}",
                ],
            ),
            task=TASK,
            optimizer=tx,
            echo=False,
        )
        lrs = _logged_lrs(run_dir)
        if name == "plain":
            assert lrs == expected[name]
        else:
            np.testing.assert_allclose(lrs, expected[name], rtol=1e-6, err_msg=name)


def test_logged_lr_skips_a_non_finite_step(tmp_path):
    """A step the guard skips leaves the optimizer's count where it was: the next step
    applies (and logs) the rate the skipped one would have."""

    def data(step, n):
        batch = _data(step, n)
        return {**batch, "x": batch["x"] * np.nan} if step == 1 else batch

    task = jaxpar.Task(TwoOfAShape, TASK.loss_fn, TASK.batch_axes, name="two", data=data)
    run_dir = tmp_path / "skip"
    jaxpar.train(
        load_config(
            [],
            [
                *LAYOUT,
                "optim.lr=1e-2",
                "optim.warmup_steps=4",
                "optim.schedule=constant",
                "train.steps=4",
                "train.nonfinite=skip",
                "train.log_every=1",
                "train.progress=false",
                f"run.dir={run_dir}",
            ],
        ),
        task=task,
        echo=False,
    )
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert [r["skipped"] for r in rows] == [0, 1, 1, 1]
    # counts 0, 1 (attempted, skipped), 1, 2
    np.testing.assert_allclose([r["lr"] for r in rows], [0.0, 2.5e-3, 2.5e-3, 5e-3], rtol=1e-6)


def test_inspect_notes_replicated_optimizer_state(capsys):
    from jaxpar.cli import main

    assert (
        main(
            [
                "inspect",
                "configs/gpt_tiny.yaml",
                "mesh.data=1",
                "mesh.fsdp=8",
                "optim.name=adafactor",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "optimizer-state arrays are not parameter-shaped and are replicated" in out
    assert "v_row" in out or "v_col" in out
