"""Packing with document attention (``data.pack=documents``) for the Gemma family and BERT,
as tests/test_packing.py checks it for the GPT and the Llama: the loss and gradients of a
packed batch equal the token-weighted mean of each document run alone — Gemma 3's
sliding-window and full layers through ``attend``, Gemma 2's soft-capped attention written
out, BERT's bidirectional masked LM with its learned positions and type halves — on one
device, under context parallelism (both strategies; Gemma balanced) and a pipeline;
``concat`` and ``documents`` differ where documents meet; Gemma trains on loss masks."""

from __future__ import annotations

import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import export

from jaxpar.config import load_config
from jaxpar.models.lm import lm_documents, lm_sequence
from jaxpar.run import build
from tests.helpers import assert_params_close, grid
from tests.test_loss_mask import tokens  # noqa: F401  (fixture: masked fine-tuning records)
from tests.test_packing import (  # noqa: F401  (records: a fixture)
    B,
    T,
    _grads,
    _load,
    _reference,
    check_concat_and_documents_differ,
    records,
)

GEMMA = [
    "model.name=gemma",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_size=8",
    "model.d_ff=32",
    "model.n_layers=4",
    "model.sliding_window=4",
    "model.sliding_window_pattern=2",
]
FAMILIES = {
    # Gemma 3: q/k norms, two rotary bases, its own attention scale; attention by attend
    "gemma3": [
        *GEMMA,
        "model.qk_norm=true",
        "model.rope_theta=1e6",
        "model.query_pre_attn_scalar=12",
    ],
    # Gemma 2: soft-capped attention (written out in jnp) and output logits
    "gemma2": [*GEMMA, "model.attn_softcap=2", "model.final_softcap=5"],
    "bert": [
        "model.name=bert",
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "model.n_layers=2",
        "model.dropout=0",
    ],
}


def _run(path: str, family: str, extra: list[str], devices: int = 8):
    overrides = [
        f"model.max_seq_len={T}",
        f"data.seq_len={T}",
        f"train.batch_size={B}",
        f"data.path={path}",
        "optim.warmup_steps=0",
        *FAMILIES[family],
        *extra,
        "train.steps=1",
        f"run.devices={devices}",
    ]
    return build(load_config([], overrides))


# ---- BERT's reference: each document piece alone, at its own length ------------------------
def _bert_model(run, params):
    """The run's BERT with ``params`` and the step's initial model state (its RNG key)."""
    model = run.plan.task.build_model()
    _load(model, params)
    rest = nnx.state(model, nnx.Not(nnx.Param))
    nnx.replace_by_pure_dict(rest, run.trainer.init().model_state)
    nnx.update(model, rest)
    return model


def _bert_masks(model, batch, microbatches: int):
    """Example keys, masked inputs and chosen positions as the step draws them: microbatch
    j (rows j, j + k, …) at RNG count c + j (a pipeline's microbatches; one device: k=1)."""
    count = model.noise.dropout.count[...]
    inputs, index = jnp.asarray(batch["tokens"][:, :-1]), jnp.asarray(batch["index"])
    keys = jnp.zeros_like(model.example_keys(index))
    for j in range(microbatches):
        model.noise.dropout.count[...] = count + j
        keys = keys.at[j::microbatches].set(model.example_keys(index[j::microbatches]))
    model.noise.dropout.count[...] = count
    return (keys, *model.mask(inputs, keys, model.data_vocab))


def _bert_reference(run, params, batch) -> dict[int, tuple[float, dict]]:
    """The masked-LM loss and gradients with each document piece of each window run
    alone, unpadded, with the window's masking (the chosen positions' cross entropy summed
    over the pieces, over the batch's chosen count): for the masks of one program (1) and
    of two pipeline microbatches (2)."""
    model = _bert_model(run, params)
    draws = [_bert_masks(model, batch, k) for k in (1, 2)]
    originals = jnp.asarray(batch["tokens"][:, :-1])  # the targets
    pieces = defaultdict(list)  # by length: (row, positions)
    for b, segments in enumerate(batch["segments"][:, :-1]):
        for s in np.unique(segments):
            at = np.flatnonzero(segments == s)
            pieces[len(at)].append((b, at))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)

    def piece_sum(p, keys, inputs, chosen, rows, at):
        """The chosen positions' cross entropy summed over n pieces of one length L: row
        ``rows[i]`` of the window, its positions ``at[i]`` ([n] and [n, L])."""
        nnx.replace_by_pure_dict(state, p)
        m = nnx.merge(graphdef, state, rest)
        at = (rows[:, None], at)
        x = m.run_blocks(m.embed_tokens(inputs[at], keys[rows]), keys[rows])
        ce = optax.softmax_cross_entropy_with_integer_labels(m.logits(x), originals[at])
        return jnp.sum(ce * chosen[at])

    # a program per length (XLA compiles several small programs faster than their sum),
    # each compiled once for both draws; the sums and their gradients add up. Traced once,
    # for any number n of pieces of any length L (the model's own code at each: a length
    # is a shape), and compiled for each length as it is called
    n, length = export.symbolic_shape("n, L", constraints=[f"L <= {T}"])

    def spec(x):
        return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype)

    traced = export.export(jax.jit(jax.value_and_grad(piece_sum)))(
        jax.tree.map(spec, params),
        *map(spec, draws[0]),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n, length), jnp.int32),
    )
    step = jax.jit(traced.call)
    members = [
        (np.array([b for b, _ in m], np.int32), np.stack([a for _, a in m]).astype(np.int32))
        for m in pieces.values()
    ]
    out = {}
    for k, (keys, inputs, chosen) in zip((1, 2), draws):
        parts = [step(params, keys, inputs, chosen, rows, at) for rows, at in members]
        count = float(chosen.sum())
        total = sum(float(v) for v, _ in parts) / count
        grads = jax.tree.map(
            lambda *g, n=count: sum(map(np.asarray, g)) / n, *[g for _, g in parts]
        )
        out[k] = (total, grads)
    return out


@functools.cache
def _one_device(path: str, family: str):
    run = _run(path, family, ["data.pack=documents", "mesh.data=1"], devices=1)
    params = jax.tree.map(np.asarray, run.trainer.init().params)
    batch = run.data.batch(0, B)
    if family == "bert":  # its masks depend on the microbatch (see _bert_masks)
        return run, params, batch, _bert_reference(run, params, batch)
    return run, params, batch, {1: _reference(run, params, batch)}


LAYOUTS = [  # (family, layout)
    ("gemma3", "one device"),
    ("gemma3", "mesh.context=2,context.attention=all_gather"),
    ("gemma3", "mesh.context=4,context.attention=ring"),
    ("gemma3", "mesh.context=4,context.attention=all_gather"),
    ("gemma3", "mesh.context=2,context.attention=ring,mesh.tensor=2"),
    ("gemma3", "mesh.stage=2,mesh.context=2,pipeline.microbatches=2"),
    (
        "gemma3",
        (
            "mesh.stage=2,mesh.context=2,pipeline.microbatches=2,pipeline.executor=mpmd,"
            "context.attention=ring"
        ),
    ),
    ("gemma2", "one device"),
    ("gemma2", "mesh.context=2,context.attention=all_gather"),
    ("gemma2", "mesh.context=4,context.attention=ring"),
    ("gemma2", "mesh.stage=2,pipeline.microbatches=2,pipeline.executor=mpmd"),
    ("bert", "one device"),
    ("bert", "mesh.context=2,context.attention=all_gather"),
    ("bert", "mesh.context=4,context.attention=ring"),
    ("bert", "mesh.context=2,context.attention=ring,mesh.tensor=2"),
    ("bert", "mesh.stage=2,pipeline.microbatches=2"),
    ("bert", "mesh.stage=2,mesh.context=2,pipeline.microbatches=2,pipeline.executor=mpmd"),
]


# every suite: Gemma 3 round a balanced ring (its grouped key/value heads). Heavy (46 s, 28
# of them BERT's references, each document at its own length): Gemma 3 under all_gather in
# its spmd pipeline (14–17 s: the pipelined gradients compiled; tests/test_packing.py keeps
# the GPT's in the suite, through the same `jaxpar.attend`), Gemma 2 and BERT under context
# (all_gather), BERT in a pipeline. Each family on one device is extended: the same model
# code as under context, its documents' mask the same jaxpar.ring_attention.visible of
# positions and segment ids (Gemma 3's windowed and full layers in its all_gather pipeline,
# BERT's bidirectional mask under context=2, Gemma 2's soft-capped attention written out
# under context=2, where XLA gathers the keys), which attend's one-device branch builds in
# every suite in tests/test_packing.py's gpt-one device; the rest exhaustive. (The spmd
# executor with context.attention=ring deadlocks on XLA:CPU whatever data.pack says;
# docs/context.md.)
@pytest.mark.parametrize(
    "family,layout",
    grid(
        [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in LAYOUTS],
        {"gemma3-mesh.context=4,context.attention=ring"},
        heavy={
            "gemma3-mesh.stage=2,mesh.context=2,pipeline.microbatches=2",
            "gemma2-mesh.context=2,context.attention=all_gather",
            "bert-mesh.context=2,context.attention=all_gather",
            "bert-mesh.stage=2,pipeline.microbatches=2",
        },
    ),
)
def test_packed_loss_is_the_mean_of_each_document_alone(records, family, layout):  # noqa: F811
    """Loss and every gradient of a packed batch equal those of the batch's documents each
    run alone (Gemma: the token-weighted mean of their next-token losses, padded causally;
    BERT: the window's masked positions, each piece at its own length)."""
    one, params, batch, references = _one_device(records, family)
    if layout == "one device":
        run = one
    else:
        run = _run(records, family, ["data.pack=documents", "mesh.data=-1", *layout.split(",")])
        if family != "bert":
            assert run.config.context.balance
    assert "segments" in batch and batch["segments"].max() >= 2
    microbatches = 2 if family == "bert" and "pipeline.microbatches=2" in layout else 1
    want_loss, want_grads = references[microbatches]
    loss, grads = _grads(run, params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_params_close(grads, want_grads, elementwise=False, rtol=1e-4)


@pytest.mark.parametrize(
    "family",
    # both extended: a family whose packed loss equals each document alone (above, every
    # suite) reads differently under concat wherever a document follows another (its
    # attention sees the ones before it); the check itself runs in every suite on the GPT
    # (tests/test_packing.py::test_concat_and_documents_differ_where_documents_meet[gpt])
    grid([pytest.param("gemma2", id="gemma2"), pytest.param("gemma3", id="gemma3")], set()),
)
def test_gemma_concat_and_documents_differ_where_documents_meet(records, family):  # noqa: F811
    """Per-token losses: each window's first document reads the same under both; the later
    ones differ (concat's full layers see the documents before them), and so do the batch
    losses."""
    run, params, batch, _ = _one_device(records, family)
    check_concat_and_documents_differ(
        run, _run(records, family, ["mesh.data=1"], devices=1), params, batch
    )


# Extended tier: BERT's concat is its plain forward, no mask (every suite trains BERT so:
# tests/test_families.py::test_bert_layouts_and_pipelines_match_one_device), its documents'
# mask the one the packed loss above checks against each document alone in every suite;
# concat and documents told apart where documents meet: every suite on the GPT
# (tests/test_packing.py::test_concat_and_documents_differ_where_documents_meet[gpt])
@pytest.mark.exhaustive
def test_bert_concat_and_documents_differ_where_documents_meet(records):  # noqa: F811
    """Bidirectional: every token of a window of several documents reads differently under
    the two (each sees the others' tokens under concat), a window of one document the
    same (its positions and halves are the window's); the batch losses differ."""
    run, params, batch, _ = _one_device(records, "bert")
    model = _bert_model(run, params)
    keys, inputs, _ = _bert_masks(model, batch, 1)
    segments = batch["segments"].copy()
    segments[0] = 0  # window 0 read as one document
    docs = lm_documents({"tokens": batch["tokens"], "segments": segments}, np.arange(T))
    logits = {
        pack: np.asarray(
            model.logits(
                model.run_blocks(model.embed_tokens(jnp.asarray(inputs), keys, d), keys, 0, d)
            )
        )
        for pack, d in (("concat", None), ("documents", docs))
    }
    np.testing.assert_allclose(logits["documents"][0], logits["concat"][0], rtol=1e-5, atol=1e-5)
    gap = np.abs(logits["documents"][1:] - logits["concat"][1:]).max(-1)
    assert (gap > 1e-4).mean() > 0.95
    concat = _run(records, "bert", ["mesh.data=1"], devices=1)
    plain = concat.data.batch(0, B)
    assert set(plain) == {"tokens", "index"}
    np.testing.assert_array_equal(plain["tokens"], batch["tokens"])
    losses = _grads(concat, params, plain)[0], _grads(run, params, batch)[0]
    assert abs(losses[0] - losses[1]) > 1e-5


# Extended tier: Gemma's loss is the language models' shared next-token loss, weighed by the
# loss mask whatever the attention (jaxpar/models/lm.py: lm_weights, next_token_loss). Every
# suite checks that loss against the masked mean by hand on the GPT
# (tests/test_loss_mask.py::test_loss_is_the_completion_only_mean), packed and masked across
# layouts (…::test_packed_documents_keep_the_masked_mean), and Gemma's packed attention above
@pytest.mark.exhaustive
def test_gemma_packed_and_masked_is_the_completion_only_mean(tokens):  # noqa: F811
    """A fine-tuning token file, packed: the loss is the mean over the completion targets
    of the per-token losses of the packed forward pass (not the mean over all)."""
    run = _run(tokens, "gemma3", ["data.pack=documents", "mesh.data=1"], devices=1)
    batch = run.data.batch(0, B)
    assert {"segments", "loss_mask"} <= set(batch) and batch["segments"].max() >= 2
    params = jax.tree.map(np.asarray, run.trainer.init().params)
    model = run.plan.task.build_model()
    _load(model, params)
    inputs, targets, pos = lm_sequence(batch)
    ce = np.asarray(
        optax.softmax_cross_entropy_with_integer_labels(
            model(inputs, pos, lm_documents(batch, pos)), targets
        )
    )
    mask = batch["loss_mask"][:, 1:].astype(bool)
    assert 0.1 < mask.mean() < 0.9
    loss = _grads(run, params, batch)[0]
    np.testing.assert_allclose(loss, ce[mask].mean(), rtol=1e-5)
    assert abs(ce[mask].mean() - ce.mean()) > 1e-3
