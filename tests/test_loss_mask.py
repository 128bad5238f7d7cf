"""Loss masks of fine-tuning records (``prepare-data --records``): the loss is the mean
over completion tokens only — on one device, with accumulation, packed documents and a
sharded layout; a chat's mask covers exactly its assistant messages; bad input is one
line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.data.finetune import Keys, prepare_records
from jaxpar.data.token_file import decode
from jaxpar.errors import DataError
from jaxpar.models.lm import lm_sequence
from jaxpar.run import build
from tests.helpers import train_bpe

T, B = 32, 8


@functools.cache
def _records(tmp: str) -> str:
    """Prompt/completion records of 3 to 20 letters each, byte-tokenized with a mask."""
    rng = np.random.default_rng(0)

    def word() -> str:
        return "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(3, 20)))

    path = Path(tmp) / "sft.jsonl"
    path.write_text(
        "".join(json.dumps({"q": word() + "?", "a": " " + word()}) + "\n" for _ in range(300))
    )
    out = Path(tmp) / "sft.tokens"
    prepare_records(
        [path], out, "byte", layout="prompt_completion", keys=Keys(prompt="q", completion="a")
    )
    return str(out)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    return _records(str(tmp_path_factory.mktemp("sft")))


def _run(path: str, extra: list[str], devices: int = 8):
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
        *extra,
        "train.steps=1",
        f"run.devices={devices}",
    ]
    return build(load_config([], overrides))


def _loss(run, params, batch) -> float:
    params = jax.device_put(params, run.plan.state_shardings.params)
    loss, _, _ = run.trainer.grads(
        params, run.trainer.shard_batch(batch), run.trainer.init().model_state
    )
    return float(loss)


def _by_hand(run, params, batch) -> float:
    """Per-token cross entropy of the model's logits, averaged over masked-in targets."""
    model = run.plan.task.build_model()
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    inputs, targets, pos = lm_sequence({"tokens": batch["tokens"]})
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(model(inputs, pos), targets))
    mask = batch["loss_mask"][:, 1:].astype(bool)
    return float(ce[mask].mean())


@functools.cache
def _one_device(path: str):
    run = _run(path, ["mesh.data=1"], devices=1)
    params = jax.tree.map(np.asarray, run.trainer.init().params)
    batch = run.data.batch(0, B)
    return run, params, batch


def test_loss_is_the_completion_only_mean(tokens):
    run, params, batch = _one_device(tokens)
    assert set(batch) == {"tokens", "loss_mask"}
    mask = batch["loss_mask"][:, 1:]
    assert 0 < mask.mean() < 1  # prompts and completions both in the windows
    want = _by_hand(run, params, batch)
    np.testing.assert_allclose(_loss(run, params, batch), want, rtol=1e-5)


# the suite: each pipeline executor (the spmd one beside context; the sub-mesh one weighs
# the batch in its own program). Accumulation — on one device, and crossed with the split —
# and the batch split over data × fsdp × tensor in the extended tier: every one-program
# step weighs the whole batch's mask once (jaxpar.gradients.Traced, before any strategy
# splits it), and test_packed_documents_keep_the_masked_mean keeps that in the suite on
# data × fsdp × tensor with train.grad_accum=2 (the split and the accumulated
# microbatches' weights over the whole batch)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ["mesh.data=1", "train.grad_accum=2"],
            id="accumulated",
            marks=pytest.mark.exhaustive,
        ),
        pytest.param(
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
            id="data2-fsdp2-tensor2",
            marks=pytest.mark.exhaustive,
        ),
        pytest.param(
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum=2"],
            id="data2-fsdp2-tensor2-accumulated",
            marks=pytest.mark.exhaustive,
        ),
        pytest.param(
            ["mesh.data=-1", "mesh.stage=2", "mesh.context=2", "pipeline.microbatches=2"],
            id="stage2-context2-spmd",
        ),
        pytest.param(  # heavy (8 s): the spmd pipeline's case keeps masks in stages
            ["mesh.data=-1", "mesh.stage=2", "pipeline.microbatches=2", "pipeline.executor=mpmd"],
            id="stage2-mpmd",
            marks=pytest.mark.heavy,
        ),
    ],
)
def test_layouts_keep_the_masked_mean(tokens, layout):
    """Microbatches and devices each hold a different share of completion tokens: the
    global weights keep the loss the one-device completion-only mean."""
    one, params, batch = _one_device(tokens)
    devices = 1 if "mesh.data=1" in layout else 8
    run = _run(tokens, layout, devices=devices)
    np.testing.assert_allclose(_loss(run, params, batch), _loss(one, params, batch), rtol=1e-5)


def test_packed_documents_keep_the_masked_mean(tokens):
    """With ``data.pack=documents`` the batch holds ``segments`` and ``loss_mask``; one
    device and accumulation under a sharded layout agree."""
    one = _run(tokens, ["mesh.data=1", "data.pack=documents"], devices=1)
    params = jax.tree.map(np.asarray, one.trainer.init().params)
    batch = one.data.batch(0, B)
    assert set(batch) == {"tokens", "segments", "loss_mask"}
    want = _loss(one, params, batch)
    run = _run(
        tokens,
        [
            "data.pack=documents",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "train.grad_accum=2",
        ],
    )
    np.testing.assert_allclose(_loss(run, params, batch), want, rtol=1e-5)


def test_masked_windows_align_with_the_token_file(tokens):
    """Window ``i``'s ``loss_mask`` is the file's mask of the window's tokens; completion
    tokens decode to the completions (each a space then letters)."""
    _, _, batch = _one_device(tokens)
    tf_mask = np.fromfile(tokens + ".mask", np.uint8)
    all_tokens = np.fromfile(tokens, "<u2")
    meta = json.loads(Path(tokens + ".json").read_text())
    assert meta["records"] == "prompt_completion"
    assert meta["mask"]["targets"] == int(tf_mask.sum())
    text = all_tokens[tf_mask == 1].astype(np.uint8).tobytes().decode()
    assert "?" not in text and text.startswith(" ")
    for row, mask in zip(batch["tokens"], batch["loss_mask"]):
        hits = [
            i for i in range(len(all_tokens) - T) if np.array_equal(all_tokens[i : i + T + 1], row)
        ]
        assert any(np.array_equal(tf_mask[i : i + T + 1], mask) for i in hits)


_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    train_bpe(
        ["hello there, how are you?", "fine thanks; and you?", "the sky is blue"] * 20,
        folder / "tokenizer.json",
        special_tokens=_ROLES,
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": _TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return folder


def test_chat_mask_covers_exactly_the_assistant_messages(chat_folder, tmp_path):
    chats = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "fine thanks"},
            {"role": "user", "content": "how are you?"},
            {"role": "assistant", "content": "the sky is blue"},
        ],
        [
            {"role": "user", "content": "and you?"},
            {"role": "assistant", "content": "hello, how are you"},
            {"role": "user", "content": "blue"},
        ],
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    tf = prepare_records(
        [path], tmp_path / "chat.tokens", str(chat_folder / "tokenizer.json"), layout="chat"
    )
    mask = np.fromfile(str(tf.path) + ".mask", np.uint8)
    for doc, chat in zip(tf.documents, chats):
        lo, hi = doc["start"], doc["end"]
        picked = [i for i in range(lo, hi) if mask[i]]
        eos = tf.meta["eos"]["id"]
        # the first chat ends with the assistant: its EOS counts; the second's does not
        assert (tf.tokens[hi - 1] == eos) and mask[hi - 1] == (chat[-1]["role"] == "assistant")
        text = "".join(decode(tf, i, i + 1) for i in picked if tf.tokens[i] != eos)
        assert text == "".join(m["content"] for m in chat if m["role"] == "assistant")


@pytest.mark.parametrize(
    "records,layout,match",
    [
        (
            [{"question": "a", "completion": "b"}],
            "prompt_completion",
            r"record 0 has no field 'prompt' \(its fields: 'question', 'completion'\); "
            r"set --prompt-key",
        ),
        (
            [{"prompt": "a", "completion": 3}],
            "prompt_completion",
            "field 'completion' is a number, not a string",
        ),
        (
            [{"prompt": "a", "completion": ""}],
            "prompt_completion",
            "has no completion tokens .* drop the record",
        ),
        ([{"msgs": []}], "chat", r"has no field 'messages' \(its fields: 'msgs'\)"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "chat", "has no completion tokens"),
    ],
)
def test_bad_records_are_one_line(chat_folder, tmp_path, records, layout, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = str(chat_folder / "tokenizer.json") if layout == "chat" else "byte"
    with pytest.raises(DataError, match=match) as err:
        prepare_records([path], tmp_path / "bad.tokens", tok, layout=layout)
    assert "\n" not in str(err.value)


def test_chat_needs_a_template(tmp_path, chat_folder):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match="needs a chat template: pass --tokenizer"):
        prepare_records([path], tmp_path / "c.tokens", "byte", layout="chat")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((chat_folder / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="has no chat template .* --records prompt_completion"):
        prepare_records([path], tmp_path / "c.tokens", str(bare / "tokenizer.json"), layout="chat")


def test_a_model_without_masks_refuses_them(tokens):
    with pytest.raises(DataError, match="loss mask, which this model does not train on"):
        _run(tokens, ["model.name=bert", "mesh.data=1"], devices=1)


def test_a_users_task_that_names_loss_mask_trains_on_the_masked_mean(tokens):
    """A user's task whose batch entries name ``loss_mask`` reads a masked token file as
    jaxpar's GPT does: its loss (GPT's own loss function, in a task of the user's) is the
    completion-only mean on the same batch; without ``loss_mask`` it is refused as other
    models are, and a file without masks is refused for a task that names it."""
    import dataclasses

    from jaxpar.errors import TaskError
    from jaxpar.models import gpt

    gpt_run, params, batch = _one_device(tokens)
    config = gpt_run.config
    cfg = config.model
    own = dataclasses.replace(
        gpt.task(cfg, T, loss_mask=True), name="mine", family="", tokens_per_example=0
    )
    assert "loss_mask" in own.batch_axes
    mine = build(config, own)
    assert np.array_equal(mine.data.batch(0, B)["loss_mask"], batch["loss_mask"])
    assert _loss(mine, params, batch) == pytest.approx(_by_hand(gpt_run, params, batch), rel=1e-5)
    unmasked = dataclasses.replace(own, batch_axes={"tokens": ("batch", None)})
    with pytest.raises(DataError, match="loss mask, which this model does not train on"):
        build(config, unmasked)
    plain = load_config([], [f"data.seq_len={T}", f"train.batch_size={B}", "mesh.data=1"])
    with pytest.raises(TaskError, match="names 'loss_mask' among its batch entries, but"):
        build(dataclasses.replace(plain, run=dataclasses.replace(plain.run, devices=1)), own)
