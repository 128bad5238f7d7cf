"""XLA's involuntary-rematerialization warning, raised by a user's own embedding under
data × fsdp × tensor, becomes one jaxpar line saying what is gathered and the fix; the
fix it names (a lookup where the table's rows lie) compiles without it (the extended tier; the
suite checks that lookup's compiled step in tests/test_lookup.py); other lines pass through."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxpar import compiler_notes
from tests.helpers import ROOT, child_env

LM = """
import jax.numpy as jnp, numpy as np, optax
from flax import nnx
import jaxpar

class LM(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(256, 64, rngs=rngs,
                               embedding_init=nnx.with_partitioning(init, ("vocab", "embed")))
        self.out = nnx.Linear(64, 256, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")),
                              bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("vocab",)),
                              rngs=rngs)

    def __call__(self, tokens):
        return self.out(LOOKUP)

def loss(model, batch):
    logits = model(batch["tokens"][:, :-1])
    labels = batch["tokens"][:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}

def data(step, n):
    return {"tokens": np.random.default_rng(step).integers(0, 256, (n, 17)).astype(np.int32)}

TASK = jaxpar.Task(LM, loss, {"tokens": ("batch", None)}, data=data, name="lm")
"""


def _train(tmp_path, lookup: str) -> str:
    path = tmp_path / f"lm{len(lookup)}.py"
    path.write_text(LM.replace("LOOKUP", lookup))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            "--task",
            f"{path}:TASK",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "train.steps=1",
            "train.progress=false",
            "optim.warmup_steps=0",
            f"run.dir={tmp_path / path.stem}",
        ],
        env={k: v for k, v in child_env(None).items() if k != "JAXPAR_DEBUG"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_an_embeddings_involuntary_rematerialization_is_one_line_with_the_fix(tmp_path):
    err = _train(tmp_path, "self.embed(tokens)")
    notes = [line for line in err.splitlines() if "involuntary full rematerialization" in line]
    assert notes == [
        "jaxpar: warning: XLA gathers all of an activation f32[8,16,64] to change its sharding "
        "(its dims split 4×1×1 → 1×1×2): an involuntary full rematerialization, every device "
        "briefly holding it whole; if it is an embedding lookup's, look the tokens up with "
        'jaxpar.tensor_parallel.lookup(table, tokens, ("vocab", "embed")), as jaxpar\'s '
        "models do (with the names the table's dims carry); else pin the activation's "
        "layout where the model makes it (jaxpar.constrain) or change the rule that splits "
        "its dims"
    ], err
    assert "Involuntary" not in err and "spmd_partitioner" not in err


# Extended tier (a second `jaxpar train` process): the suite checks the fix's mechanism in
# tests/test_lookup.py — under data × fsdp × tensor the lookup's compiled step gathers no
# table and its rows come out summed where they lie, equal to a lookup in the whole table
@pytest.mark.exhaustive
def test_the_fix_the_note_names_compiles_without_it(tmp_path):
    """The same model looking its tokens up with ``jaxpar.tensor_parallel.lookup``, as the
    note says: XLA warns of no rematerialization."""
    fixed = _train(
        tmp_path,
        'jaxpar.tensor_parallel.lookup(self.embed.embedding[...], tokens, ("vocab", "embed"))',
    )
    assert "rematerialization" not in fixed.lower(), fixed


def test_other_lines_pass_through_and_a_parameter_is_named(capfd):
    line = (
        "W1126 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The "
        "compiler cannot go from sharding {devices=[2,1,4]<=[8] last_tile_dim_replicate} "
        "to {replicated} efficiently for HLO operation %p = f32[64,256]{1,0} parameter(1)"
    )
    with compiler_notes.explained({(64, 256): "out/kernel"}):
        import os

        os.write(2, b"a line of its own\n" + line.encode() + b"\n" + line.encode() + b"\n")
    err = capfd.readouterr().err
    assert err == (
        "a line of its own\njaxpar: warning: XLA gathers all of parameter "
        "'out/kernel' f32[64,256] to change its sharding (its dims split 2×1 → "
        "1×1): an involuntary full rematerialization, every device briefly holding "
        "it whole; give its dims logical names whose rules split it as the "
        "activations it meets are split\n"
    )
