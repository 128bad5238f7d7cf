"""Token files and the model: ``model.vocab_size`` taken from the data when not given."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.data import prepare_data
from jaxpar.run import build
from tests.helpers import GPT_SMALL, train_bpe

PROSE = (
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump "
    "quickly; pack my box with five dozen liquor jugs. "
) * 60


@pytest.fixture(scope="module")
def bpe_tokens(tmp_path_factory) -> Path:
    """A token file of a byte-level BPE with 300 ids (> the default model.vocab_size)."""
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe([PROSE], folder / "tokenizer.json")
    (folder / "prose.txt").write_text(PROSE * 4)
    tf = prepare_data(
        [folder / "prose.txt"], folder / "bpe.tokens", tokenizer=str(folder / "tokenizer.json")
    )
    assert tf.vocab_size == 300
    return tf.path


@pytest.mark.parametrize(
    "model, expected",
    [
        ([], 300),  # taken from the token file
        (["model.vocab_size=512"], 512),  # given: kept
        (["model.name=bert", "model.max_seq_len=16"], 301),  # BERT keeps its mask token
        (["model.name=llama", "model.max_seq_len=16"], 300),
    ],
)
def test_the_vocab_is_the_token_files_unless_given(bpe_tokens, model, expected):
    run = build(load_config([], [*GPT_SMALL, *model, f"data.path={bpe_tokens}"]))
    assert run.config.model.vocab_size == expected
    assert run.data.vocab_size == 300
    shapes = [x.shape for x in jax.tree.leaves(run.plan.abstract_state.params)]
    assert any(expected in shape for shape in shapes)  # the embedding table


def test_a_given_vocab_smaller_than_the_data_is_one_line(bpe_tokens):
    with pytest.raises(ValueError) as err:
        build(load_config([], [*GPT_SMALL, "model.vocab_size=256", f"data.path={bpe_tokens}"]))
    assert "\n" not in str(err.value)
    assert "has vocab_size 300 but model.vocab_size=256; set model.vocab_size" in str(err.value)
    # a folder's model (model.init_from) cannot take that fix: the other one is named
    assert "give data.path a token file made with its tokenizer" in str(err.value)


def test_the_built_in_text_keeps_the_default(tmp_path):
    """Byte data fits the default: nothing changes (the family's default is sized for it)."""
    (tmp_path / "a.txt").write_text(PROSE)
    run = build(load_config([], [*GPT_SMALL, f"data.path={tmp_path / 'a.txt'}"]))
    assert run.config.model.vocab_size == 256


def test_batched_encoding_gives_each_documents_own_ids(bpe_tokens, monkeypatch, tmp_path):
    """Documents encoded a few at a time (``encode_batch``) get the ids ``encode`` gives
    each alone; a non-UTF-8 document in a batch is still one line naming it."""
    from jaxpar.data import encoding
    from jaxpar.data import tokenizers as toks
    from jaxpar.data.records import Document

    monkeypatch.setattr(encoding, "BATCH_BYTES", 300)
    tok = toks.load_tokenizer(str(bpe_tokens.with_name("tokenizer.json")))
    docs = [Document(f"d{i}", PROSE[i * 97 : i * 97 + 150].encode()) for i in range(9)]
    seps = toks.Separators(bos=7, eos=9)
    got = list(encoding.encode_batches(docs, tok, seps, np.dtype("<u2")))
    assert len(got) > 2 and [d for batch in got for d in batch.docs] == docs
    ids = [a for b in got for a in np.split(b.ids, np.cumsum(b.lengths)[:-1])]
    for doc, each in zip(docs, ids, strict=True):
        assert each.dtype == np.dtype("<u2")
        assert each.tolist() == [7, *tok.encode(doc.data, doc.name).tolist(), 9]
    with pytest.raises(ValueError, match="^input 'bad' is not UTF-8 text"):
        list(
            encoding.encode_batches(
                [*docs[:2], Document("bad", b"\xff\xfe")], tok, seps, np.dtype("<u2")
            )
        )
