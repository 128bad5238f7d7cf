"""Packing with document attention (``data.pack=documents``): the loss and gradients of a
packed batch equal the token-weighted mean of each document run alone as its own sequence
— on one device, under context parallelism (both strategies, balanced), sequence
parallelism and pipelines (both executors); ``concat`` and ``documents`` differ where
documents meet and agree inside one; windows carry their documents' segment ids; bad input
is one line."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.config import load_config
from jaxpar.data.windows import TokenWindows, window_segments
from jaxpar.errors import DataError
from jaxpar.models import gpt
from jaxpar.models.lm import lm_documents, lm_sequence
from jaxpar.run import build
from tests.helpers import assert_params_close, grid

T, B = 32, 8
FAMILIES = {
    "gpt": [],
    "rotary": ["model.positions=rotary"],
    "llama": ["model.name=llama", "model.n_kv_heads=1"],
}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> str:
    """Documents of 3 to 29 letters, one a record: a window of 32 holds several."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("packing") / "docs.jsonl"
    lines = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(3, 30))) for _ in range(400)
    ]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return str(path)


def _run(path: str, family: str, extra: list[str], devices: int = 8):
    overrides = [
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "model.n_layers=2",
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


def _grads(run, params, batch):
    """Loss and gradients (host arrays) of ``batch`` at ``params`` through the run's step.
    Only a model with state besides its parameters (BERT's RNG streams) is initialized for
    it: for the others an init would compile the layout's init program only to hand over
    an empty state (``Trainer.grads`` takes None for it)."""
    state = run.trainer.init().model_state if run.plan.model.stateful else None
    params = jax.device_put(params, run.plan.state_shardings.params)
    loss, _, grads = run.trainer.grads(params, run.trainer.shard_batch(batch), state)
    return float(loss), jax.tree.map(np.asarray, grads)


def _alone(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every document piece of the batch's windows as its own sequence, padded to T:
    inputs, targets (the stream's next tokens) and which targets are the document's."""
    rows = []
    for tokens, segments in zip(batch["tokens"], batch["segments"]):
        for s in np.unique(segments[:-1]):
            at = np.flatnonzero(segments[:-1] == s)
            rows.append((tokens[at], tokens[at + 1]))
    inputs, targets = np.zeros((2, len(rows), T), np.int32)
    weights = np.zeros((len(rows), T), np.float32)
    for i, (x, y) in enumerate(rows):
        inputs[i, : len(x)], targets[i, : len(y)], weights[i, : len(x)] = x, y, 1.0
    return inputs, targets, weights


def _reference(run, params, batch):
    """The token-weighted mean of each document's own loss (each alone, on one device,
    positions from 0, no segment ids: causal attention keeps padding out of it)."""
    inputs, targets, weights = _alone(batch)
    graphdef, state, rest = nnx.split(nnx.eval_shape(run.plan.task.build_model), nnx.Param, ...)

    def loss(p):
        nnx.replace_by_pure_dict(state, p)
        logits = nnx.merge(graphdef, state, rest)(jnp.asarray(inputs))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(targets))
        return jnp.sum(ce * weights) / (B * T)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.tree.map(np.asarray, grads)


@functools.cache
def _one_device(path: str, family: str):
    run = _run(path, family, ["data.pack=documents", "mesh.data=1"], devices=1)
    params = jax.tree.map(np.asarray, run.trainer.init().params)
    batch = run.data.batch(0, B)
    return run, params, batch, _reference(run, params, batch)


LAYOUTS = [  # (family, layout)
    ("gpt", "one device"),
    ("gpt", "mesh.context=2,context.attention=all_gather"),
    ("gpt", "mesh.context=4,context.attention=ring"),
    ("gpt", "mesh.context=4,context.attention=all_gather"),
    ("gpt", "mesh.context=2,context.attention=ring,mesh.tensor=2"),
    ("gpt", "mesh.stage=2,mesh.context=2,pipeline.microbatches=2"),
    ("gpt", "mesh.stage=2,pipeline.microbatches=2,pipeline.executor=mpmd"),
    ("gpt", "mesh.context=2,context.attention=all_gather,mesh.tensor=2,tensor.sequence=true"),
    ("rotary", "one device"),
    ("rotary", "mesh.context=4,context.attention=ring"),
    ("rotary", "mesh.context=2,context.attention=all_gather"),
    ("llama", "one device"),
    ("llama", "mesh.context=2,context.attention=all_gather"),
    ("llama", "mesh.context=4,context.attention=ring"),
    ("llama", "mesh.stage=2,mesh.context=2,pipeline.microbatches=2"),
    ("llama", "mesh.tensor=2,tensor.sequence=true"),
    (
        "llama",
        (
            "mesh.stage=2,mesh.context=2,pipeline.microbatches=2,pipeline.executor=mpmd,"
            "context.attention=ring"
        ),
    ),
]


# every suite: the GPT on one device and under context=2 (balanced, all_gather) in a
# pipeline (spmd), the Llama (its own attention: rotary, grouped key/value heads) under
# sequence parallelism. Exhaustive: the GPT's other context layouts (its learned positions
# are looked up per token whatever the strategy; packed documents round a balanced ring at
# context=4: Gemma 3's in tests/test_pack_families.py, every suite, through the same
# `jaxpar.attend`), mpmd, the rotary GPT, SP beside context, and the Llama's other layouts
# (the same document attention as the GPT's and Gemma 3's). (The spmd executor with
# context.attention=ring deadlocks at run time on XLA:CPU whatever data.pack says — its
# ring's sends run inside one stage's branch; docs/context.md.)
@pytest.mark.parametrize(
    "family,layout",
    grid(
        [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in LAYOUTS],
        {
            "gpt-one device",
            "gpt-mesh.stage=2,mesh.context=2,pipeline.microbatches=2",
            "llama-mesh.tensor=2,tensor.sequence=true",
        },
    ),
)
def test_packed_loss_is_the_mean_of_each_document_alone(records, family, layout):
    """Loss and every gradient of a packed batch equal the token-weighted mean of the
    batch's documents each run alone (balanced order under context parallelism)."""
    one, params, batch, (want_loss, want_grads) = _one_device(records, family)
    if layout == "one device":
        run = one
    else:
        extra = ["mesh.data=-1", *layout.split(",")]
        run = _run(records, family, ["data.pack=documents", *extra])
        assert run.config.context.balance
        assert ("tensor" in run.plan.rules["act_seq"]) == ("sequence=true" in layout)
    assert set(batch) == {"tokens", "segments"} and batch["segments"].max() >= 2
    loss, grads = _grads(run, params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_params_close(grads, want_grads, elementwise=False, rtol=1e-4)


@pytest.mark.parametrize(
    "family",
    # the Llama's is extended: its packed loss equals each document alone in every suite
    # (above), so its concat twin, which lets a document see the ones before it, differs
    grid([pytest.param("gpt", id="gpt"), pytest.param("llama", id="llama")], {"gpt"}),
)
def test_concat_and_documents_differ_where_documents_meet(records, family):
    """Per-token losses: the window's first document reads the same under both (its
    positions start at 0 either way); every later one differs (concat lets it see the
    documents before it, at their positions), and so do the batch losses."""
    run, params, batch, _ = _one_device(records, family)
    check_concat_and_documents_differ(
        run, _run(records, family, ["mesh.data=1"], devices=1), params, batch
    )


def check_concat_and_documents_differ(run, concat, params, batch) -> None:
    """A causal model's packed ``run`` and its ``concat`` twin: equal per-token losses in
    each window's first document, > 90% of the later tokens' differing, and the batch
    losses differing."""
    model = run.plan.task.build_model()
    _load(model, params)
    inputs, targets, pos = lm_sequence(batch)
    ce = {
        pack: np.asarray(
            optax.softmax_cross_entropy_with_integer_labels(model(inputs, pos, docs), targets)
        )
        for pack, docs in (("concat", None), ("documents", lm_documents(batch, pos)))
    }
    first = batch["segments"][:, :-1] == 0
    np.testing.assert_allclose(ce["documents"][first], ce["concat"][first], rtol=1e-5)
    assert (np.abs(ce["documents"] - ce["concat"])[~first] > 1e-4).mean() > 0.9
    assert "segments" not in concat.data.batch(0, B)
    losses = _grads(concat, params, {"tokens": batch["tokens"]})[0], _grads(run, params, batch)[0]
    assert abs(losses[0] - losses[1]) > 1e-5


def _load(model: nnx.Module, params) -> None:
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)


def test_one_document_packs_as_concat():
    """The built-in corpus is one document: ``documents`` trains concat's numbers."""
    common = [
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "model.n_layers=1",
        "model.max_seq_len=16",
        "data.seq_len=16",
        "train.batch_size=4",
        "mesh.data=1",
        "run.devices=1",
        "train.steps=1",
        "optim.warmup_steps=0",
    ]
    runs = [build(load_config([], [*common, f"data.pack={p}"])) for p in ("concat", "documents")]
    params = jax.tree.map(np.asarray, runs[0].trainer.init().params)
    losses = [_grads(r, params, r.data.batch(0, 4))[0] for r in runs]
    assert losses[0] == losses[1]


def test_windows_carry_their_documents_segment_ids():
    """Ids restart at 0 in every window, one more at each document that begins in it; a
    window that begins inside a document gives that document id 0."""
    starts = np.array([0, 5, 6, 12])
    np.testing.assert_array_equal(window_segments(starts, 3, 6), [0, 0, 1, 2, 2, 2])
    np.testing.assert_array_equal(window_segments(starts, 12, 3), [0, 0, 0])
    windows = TokenWindows(np.arange(20), 4, starts=starts)
    np.testing.assert_array_equal(windows[1]["segments"], [0, 1, 2, 2, 2])
    assert "segments" not in TokenWindows(np.arange(20), 4)[1]


def test_document_positions_and_attend_with_segments():
    """``jaxpar.context.document_positions`` restarts at each segment; ``jaxpar.attend`` with
    segments equals attention over each segment alone."""
    segments = jnp.array([[0, 0, 0, 1, 1, 2]])
    np.testing.assert_array_equal(jaxpar.context.document_positions(segments), [[0, 1, 2, 0, 1, 0]])
    q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 6, 2, 4))
    out = jaxpar.attend(q, k, v, segments=segments)
    for lo, hi in ((0, 3), (3, 5), (5, 6)):
        alone = jax.nn.dot_product_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], is_causal=True)
        np.testing.assert_allclose(out[:, lo:hi], alone, rtol=1e-6, atol=1e-6)


def test_a_model_that_cannot_pack_is_one_line(records):
    """A task whose batch entries hold no ``segments`` (here the GPT's task built without
    documents, as a user's task may be) refuses ``data.pack=documents``. (Every built-in
    text family packs: Gemma and BERT in tests/test_pack_families.py.)"""
    plain = gpt.task(gpt.GPTConfig(max_seq_len=16), 16)
    with pytest.raises(DataError, match=r"^data.pack=documents: .* set data.pack=concat$"):
        build(
            load_config(
                [],
                [
                    f"data.path={records}",
                    "data.pack=documents",
                    "data.seq_len=16",
                    "run.devices=1",
                    "mesh.data=1",
                ],
            ),
            plain,
        )
