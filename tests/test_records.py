"""Records in: JSONL, Parquet, Arrow and save_to_disk folders of the same records give the
same token file (documents closed by the tokenizer's end-of-text), ``data.path`` trains on
the tokens ``prepare-data`` writes, and every bad input is one line naming the file."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import DataConfig
from jaxpar.data import builtin_text
from jaxpar.data import prepare as prepare_module
from jaxpar.data.prepare import encode_documents, prepare_data
from jaxpar.data.records import Document, read_documents
from jaxpar.data.sources import load_data
from jaxpar.data.token_file import decode, open_tokens
from jaxpar.errors import DataError
from jaxpar.models import families

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    'naïve café — ünïcödé ✓ 日本語, and a "quoted" word',
    "",  # an empty record is still a document: its span holds only the separators
    "line one\nline two\n\ttabbed line three",
    *(f"record {i}: a sentence about sorting, hashing and tokens {i * i}." for i in range(12)),
]
EOT = "<|endoftext|>"


def _table(docs: list[str] = DOCS) -> object:
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    return pa.table({"id": list(range(len(docs))), "text": docs}, schema=schema)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _jsonl_gz(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _arrow(path: Path, table: object, stream: bool) -> Path:
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)  # several record batches
    return path


def _save_to_disk(
    folder: Path, table: object, shards: int = 2, order: list[int] | None = None
) -> Path:
    """What ``datasets.Dataset.save_to_disk(folder, num_shards=shards)`` writes (datasets
    5.2): Arrow stream files ``data-0000i-of-0000n.arrow``, ``dataset_info.json`` and a
    ``state.json`` listing the files (in ``order``, default their own)."""
    folder.mkdir(parents=True)
    bounds = np.linspace(0, table.num_rows, shards + 1).astype(int)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
        _arrow(folder / name, table.slice(lo, hi - lo), stream=True)
    order = list(range(shards)) if order is None else order
    state = {
        "_data_files": [{"filename": names[i]} for i in order],
        "_fingerprint": "0" * 16,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    features = {
        "id": {"dtype": "int64", "_type": "Value"},
        "text": {"dtype": "string", "_type": "Value"},
    }
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    return folder


def _formats(tmp_path: Path) -> dict[str, Path]:
    """The same records as JSONL, .jsonl.gz, Parquet, Arrow (file and stream) and a
    save_to_disk folder."""
    records = [{"id": i, "text": d} for i, d in enumerate(DOCS)]
    table = _table()
    return {
        "jsonl": _jsonl(tmp_path / "docs.jsonl", records),
        "jsonl.gz": _jsonl_gz(tmp_path / "docs.jsonl.gz", records),
        "parquet": _write_parquet(tmp_path / "docs.parquet", table),
        "arrow-file": _arrow(tmp_path / "docs.arrow", table, stream=False),
        "arrow-stream": _arrow(tmp_path / "stream.arrow", table, stream=True),
        "save_to_disk": _save_to_disk(tmp_path / "saved", table),
    }


def _write_parquet(path: Path, table: object) -> Path:
    pq.write_table(table, path, row_group_size=5)  # several row groups
    return path


@pytest.fixture(scope="module")
def bpe_eot(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with an ``<|endoftext|>`` special token (GPT-2's kind),
    trained here on local text."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([builtin_text().decode()[:30_000], *DOCS], trainer)
    path = tmp_path_factory.mktemp("tok") / "eot.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_bos(tmp_path_factory, bpe_eot) -> Path:
    """Llama 2's kind: ``<s>`` added before each text by the post-processor, ``</s>`` the
    end-of-text token."""
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_file(str(bpe_eot))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    path = tmp_path_factory.mktemp("tok") / "bos.json"
    tok.save(str(path))
    return path


def _hf(path: Path) -> object:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _spans(tf) -> list[tuple[int, int]]:
    return [(d["start"], d["end"]) for d in tf.documents]


# ---------------------------------------------------------------- same records, same tokens


def test_every_format_gives_the_same_tokens_closed_by_end_of_text(tmp_path, bpe_eot):
    tok = _hf(bpe_eot)
    eot = tok.token_to_id(EOT)
    files = {
        k: prepare_data([p], tmp_path / f"{k}.tokens", tokenizer=str(bpe_eot))
        for k, p in _formats(tmp_path).items()
    }
    first = files["jsonl"]
    expected = [tok.encode(d, add_special_tokens=False).ids + [eot] for d in DOCS]
    assert list(first.tokens) == [i for ids in expected for i in ids]
    ends = np.cumsum([len(ids) for ids in expected]).tolist()
    assert _spans(first) == list(zip([0, *ends[:-1]], ends))
    assert decode(first) == "".join(d + EOT for d in DOCS)
    assert first.meta["eos"] == {"token": EOT, "id": eot} and first.meta["bos"] is None
    for kind, tf in files.items():
        assert tf.tokens.tobytes() == first.tokens.tobytes(), kind
        assert _spans(tf) == _spans(first), kind
        if kind != "save_to_disk":
            assert [d["record"] for d in tf.documents] == list(range(len(DOCS))), kind
    half = len(DOCS) // 2  # a record's index counts within its own Arrow file
    shards = [(Path(d["source"]).name, d["record"]) for d in files["save_to_disk"].documents]
    assert shards == (
        [("data-00000-of-00002.arrow", i) for i in range(half)]
        + [("data-00001-of-00002.arrow", i) for i in range(len(DOCS) - half)]
    )


def test_byte_tokenizer_adds_no_separator(tmp_path):
    files = {k: prepare_data([p], tmp_path / f"{k}.tokens") for k, p in _formats(tmp_path).items()}
    text = "".join(DOCS).encode()
    for kind, tf in files.items():
        assert decode(tf) == text, kind
        assert tf.meta["bos"] is None and tf.meta["eos"] is None
        assert [d["end"] - d["start"] for d in tf.documents] == [len(d.encode()) for d in DOCS]


def test_bos_from_the_post_processor_and_the_separator_settings(tmp_path, bpe_bos):
    tok = _hf(bpe_bos)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    path = _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS[:2]])
    plain = [tok.encode(d, add_special_tokens=False).ids for d in DOCS[:2]]
    # </s> and <|endoftext|> are both special: auto takes <|endoftext|>, first in END_OF_TEXT
    eot = tok.token_to_id(EOT)
    cases = {
        ("auto", "auto"): (bos, eot),
        ("none", "auto"): (None, eot),
        ("auto", "none"): (bos, None),
        ("none", "</s>"): (None, eos),
    }
    for (b, e), (want_bos, want_eos) in cases.items():
        tf = prepare_data(
            [path], tmp_path / f"{b}-{e}.tokens", tokenizer=str(bpe_bos), bos=b, eos=e
        )
        head = [] if want_bos is None else [want_bos]
        tail = [] if want_eos is None else [want_eos]
        assert list(tf.tokens) == [i for ids in plain for i in head + ids + tail], (b, e)
        assert tf.documents[1]["start"] == len(head + plain[0] + tail)


def test_a_post_processor_that_closes_texts_gives_the_eos(tmp_path, bpe_eot):
    from tokenizers import AddedToken, processors

    tok = _hf(bpe_eot)
    tok.add_special_tokens([AddedToken("<|close|>", special=True)])
    close = tok.token_to_id("<|close|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|close|>", special_tokens=[("<|close|>", close)]
    )
    path = tmp_path / "closing.json"
    tok.save(str(path))
    tokens, meta = encode_documents([("a", b"ab"), ("b", b"c")], str(path))
    plain = [tok.encode(t, add_special_tokens=False).ids for t in ("ab", "c")]
    assert list(tokens) == plain[0] + [close] + plain[1] + [close]
    assert meta["eos"] == {"token": "<|close|>", "id": close} and meta["bos"] is None
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A <|close|> {EOT}",
        special_tokens=[("<|close|>", close), (EOT, tok.token_to_id(EOT))],
    )
    tok.save(str(path))
    with pytest.raises(ValueError, match=r"adds 2 tokens \[\d+, \d+\] after each text"):
        encode_documents([("a", b"ab")], str(path))
    assert len(encode_documents([("a", b"ab")], str(path), eos="none")[0]) == len(plain[0])


def test_a_word_level_tokenizer(tmp_path):
    """WordLevel without [UNK]: the separators are still found, and a word outside the
    vocabulary is one line naming the record."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["the", "fox", "runs", "a", "dog", "sleeps"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    tok.save(str(tmp_path / "words.json"))
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "the fox runs"}, {"text": "a dog sleeps"}])
    tf = prepare_data([path], tmp_path / "w.tokens", tokenizer=str(tmp_path / "words.json"))
    assert list(tf.tokens) == [0, 1, 2, 6, 3, 4, 5, 6] and tf.meta["eos"]["id"] == 6
    assert decode(tf) == f"the fox runs {EOT} a dog sleeps {EOT}"
    _jsonl(path, [{"text": "the fox"}, {"text": "the cat"}])
    _fails(
        tmp_path,
        [path],
        rf"cannot encode '{path} \(record 1\)' \(WordLevel error",
        tokenizer=str(tmp_path / "words.json"),
    )


def test_text_files_get_the_end_of_text_too(tmp_path, bpe_eot):
    (tmp_path / "a.txt").write_text("first text file")
    tf = prepare_data([tmp_path / "a.txt"], tmp_path / "t.tokens", tokenizer=str(bpe_eot))
    assert decode(tf) == "first text file" + EOT
    assert "record" not in tf.documents[0]


def test_save_to_disk_files_are_read_in_state_json_order(tmp_path):
    folder = _save_to_disk(tmp_path / "saved", _table(), shards=2, order=[1, 0])
    tf = prepare_data([folder], tmp_path / "o.tokens")
    half = len(DOCS) // 2
    assert decode(tf) == "".join(DOCS[half:] + DOCS[:half]).encode()
    assert [d["record"] for d in tf.documents] == [*range(len(DOCS) - half), *range(half)]


def test_a_folder_written_by_datasets_itself(tmp_path):
    datasets = pytest.importorskip("datasets")
    ours = _save_to_disk(tmp_path / "ours", _table(), shards=3)
    theirs = tmp_path / "theirs"
    datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS}).save_to_disk(
        str(theirs), num_shards=3
    )
    a = prepare_data([ours], tmp_path / "a.tokens")
    b = prepare_data([theirs], tmp_path / "b.tokens")
    assert a.tokens.tobytes() == b.tokens.tobytes() and _spans(a) == _spans(b)
    assert len({d["source"] for d in b.documents}) == 3


def test_folders_and_globs(tmp_path):
    records = [{"text": d} for d in DOCS[:3]]
    folder = tmp_path / "mixed"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", records)
    (folder / "b.txt").write_text("plain text")
    _write_parquet(folder / "c.parquet", _table(DOCS[3:5]))
    _save_to_disk(folder / "d_saved", _table(DOCS[5:7]))
    tf = prepare_data([folder], tmp_path / "f.tokens")
    assert decode(tf) == "".join([*DOCS[:3], "plain text", *DOCS[3:7]]).encode()
    assert [Path(d["source"]).name for d in tf.documents] == ["a.jsonl"] * 3 + [
        "b.txt",
        "c.parquet",
        "c.parquet",
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    globbed = prepare_data([str(folder / "*.parquet"), str(folder / "a.*")], tmp_path / "g.tokens")
    assert decode(globbed) == "".join([*DOCS[3:5], *DOCS[:3]]).encode()


def test_text_key_names_the_field(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"body": "x y", "text": 3}, {"body": "z"}])
    assert decode(prepare_data([path], tmp_path / "o.tokens", text_key="body")) == b"x yz"
    assert (
        main(["prepare-data", str(path), "--out", str(tmp_path / "c.tokens"), "--text-key", "body"])
        == 0
    )


# ---------------------------------------------------------------- data.path


def _gpt() -> object:
    family = families()["gpt"]
    return family.needs(family.config())


def _cfg(path: Path | str, **kw) -> DataConfig:
    return dataclasses.replace(DataConfig(), path=str(path), seq_len=16, **kw)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk", "arrow-stream"])
def test_data_path_trains_on_the_prepared_tokens(tmp_path, kind):
    path = _formats(tmp_path)[kind]
    prepared = prepare_data([path], tmp_path / "p.tokens")
    direct = load_data(_cfg(path), _gpt(), seed=3)
    from_file = load_data(_cfg(prepared.path), _gpt(), seed=3)
    assert np.array_equal(direct.train.tokens, prepared.tokens)
    for split in ("train", "eval"):
        a, b = direct.batch(0, 4, split)["tokens"], from_file.batch(0, 4, split)["tokens"]
        assert a.shape == (4, 17) and np.array_equal(a, b), split
    assert b'{"' not in bytes(np.asarray(direct.train.tokens, np.uint8))  # never the JSON


def test_data_path_takes_a_glob_and_the_text_key(tmp_path):
    for i in range(2):
        _jsonl(tmp_path / f"s{i}.jsonl", [{"body": d} for d in DOCS[i::2]])
    data = load_data(_cfg(tmp_path / "s*.jsonl", text_key="body"), _gpt(), seed=0)
    assert (
        bytes(np.asarray(data.train.tokens, np.uint8)) == "".join(DOCS[0::2] + DOCS[1::2]).encode()
    )
    with pytest.raises(ValueError, match="has no field 'text'"):
        load_data(_cfg(tmp_path / "s*.jsonl"), _gpt(), seed=0)


def test_a_parquet_file_where_text_is_expected_is_never_read_as_bytes(tmp_path):
    disguised = _write_parquet(tmp_path / "notes.txt", _table())
    assert disguised.read_bytes()[:4] == b"PAR1"
    data = load_data(_cfg(disguised), _gpt(), seed=0)
    assert bytes(np.asarray(data.train.tokens, np.uint8)) == "".join(DOCS).encode()
    tf = prepare_data([disguised], tmp_path / "o.tokens")
    assert decode(tf) == "".join(DOCS).encode() and b"PAR1" not in decode(tf)


def test_a_token_id_beyond_the_model_vocab_is_one_line(tmp_path, bpe_eot):
    path = _formats(tmp_path)["parquet"]
    tf = prepare_data([path], tmp_path / "bpe.tokens", tokenizer=str(bpe_eot))
    assert tf.vocab_size > 256 and int(np.max(tf.tokens)) >= 256
    with pytest.raises(ValueError) as err:
        load_data(_cfg(tf.path), _gpt(), seed=0)
    message = str(err.value)
    assert "\n" not in message and str(tf.path) in message
    assert f"vocab_size {tf.vocab_size}" in message and "model.vocab_size=256" in message


# ---------------------------------------------------------------- bad input, one line each


def _fails(tmp_path: Path, inputs: list, match: str, **kw) -> str:
    with pytest.raises(ValueError, match=match) as err:
        prepare_data(inputs, tmp_path / "bad.tokens", **kw)
    message = str(err.value)
    assert "\n" not in message, message
    assert not (tmp_path / "bad.tokens").exists()
    return message


def test_a_record_without_the_field_names_the_fields_that_exist(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "b", "id": 2}])
    message = _fails(tmp_path, [path], f"{path}:2 has no field 'text'")
    assert "'body', 'id'" in message and "--text-key" in message
    parquet = _write_parquet(tmp_path / "d.parquet", _table())
    message = _fails(tmp_path, [parquet], f"'{parquet}' has no field 'body'", text_key="body")
    assert "'id', 'text'" in message


@pytest.mark.parametrize("value,what", [(3, "a number"), (None, "null"), (["a"], "an array")])
def test_a_field_that_is_not_a_string(tmp_path, value, what):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"text": value}])
    _fails(tmp_path, [path], f"{path}:2: field 'text' is {what}, not a string")


def test_a_column_that_is_not_a_string(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", _table())
    _fails(tmp_path, [path], f"'{path}': field 'id' is int64, not a string", text_key="id")
    nulls = _arrow(tmp_path / "n.arrow", pa.table({"text": ["a", None]}), stream=False)
    _fails(tmp_path, [nulls], f"'{nulls}' record 1: field 'text' is null")


def test_malformed_and_non_utf8_lines_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "no brace"\n')
    _fails(tmp_path, [bad], rf"{bad}:3 is not valid JSON \(Expecting ',' delimiter at column 20\)")
    listed = tmp_path / "list.jsonl"
    listed.write_text('["text"]\n')
    _fails(tmp_path, [listed], f"{listed}:1 is a JSON list, not an object")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"text": "café"}\n'.encode("latin-1"))
    _fails(tmp_path, [latin], f"{latin}:1 is not UTF-8 text")
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "ok"}\n{"text": "half \\ud800 a pair"}\n')
    _fails(tmp_path, [surrogate], f"{surrogate}:2: field 'text' is not valid UTF-8 text")


def test_an_arrow_string_that_is_not_utf8(tmp_path):
    offsets = np.array([0, 2, 4, 5], np.int32).tobytes()
    column = pa.Array.from_buffers(
        pa.string(), 3, [None, pa.py_buffer(offsets), pa.py_buffer(b"ok\xff\xfex")]
    )
    path = _arrow(tmp_path / "bad.arrow", pa.table({"text": column}), stream=False)
    _fails(tmp_path, [path], f"'{path}' record 1: field 'text' is not UTF-8 text")


def test_empty_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _fails(tmp_path, [empty], f"'{empty}' holds no records")
    zero = _write_parquet(tmp_path / "zero.parquet", _table([]))
    _fails(tmp_path, [zero], f"'{zero}' holds no records")
    blank = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    _fails(tmp_path, [blank], "hold zero tokens")


def test_a_document_longer_than_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "MAX_DOCUMENT_TOKENS", 20)
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "short"}, {"text": "x" * 21}])
    _fails(tmp_path, [path], rf"document '{path} \(record 1\)' holds 21 tokens, more than the 20")


@pytest.mark.parametrize(
    "name,data,match",
    [
        # mtime=0: the same bytes in every process (xdist's workers must collect the same ids)
        (
            "a.txt.gz",
            gzip.compress(b"text", mtime=0),
            "is gzip-compressed, not text nor a record format",
        ),
        ("a.zip", b"PK\x03\x04rest", "is zip-compressed"),
        ("a.bin", b"ab\x00cd", r"is binary \(it holds NUL bytes\)"),
        ("a.txt", b"BZh91AY&SYrest", "is bzip2-compressed"),
        ("a.parquet", b"not parquet at all", "is not a Parquet file"),
        ("a.jsonl.gz", b'{"text": "x"}\n', "is named like gzip-compressed JSON Lines but is not"),
        ("a.arrow", b"\xff\xff\xff\xffjunk", "is not a readable Arrow file"),
        ("b.parquet", b"PAR1 truncated", "is not a readable Parquet file"),
    ],
)
def test_binary_files_are_refused_never_tokenized(tmp_path, name, data, match):
    """Each kind of binary or broken file is one line naming it; none is tokenized."""
    path = tmp_path / name
    path.write_bytes(data)
    message = _fails(tmp_path, [path], match)
    assert str(path) in message
    with pytest.raises(ValueError, match=match):
        load_data(_cfg(path), _gpt(), seed=0)


def test_dataset_dict_folders_and_unmatched_globs(tmp_path):
    dd = tmp_path / "dd"
    for split in ("train", "test"):
        _save_to_disk(dd / split, _table())
    (dd / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    _fails(tmp_path, [dd], r"is a datasets DatasetDict \(splits: test, train\); name one")
    _fails(tmp_path, [tmp_path / "nothing*.jsonl"], "matches no files")
    saved = _save_to_disk(tmp_path / "saved", _table())
    (saved / "data-00001-of-00002.arrow").unlink()
    _fails(tmp_path, [saved], "lists 'data-00001-of-00002.arrow', which is missing")


def test_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import builtins

    path = _write_parquet(tmp_path / "d.parquet", _table())
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    _fails(tmp_path, [path], rf"reading '{path}' needs pyarrow: pip install 'jaxpar\[records\]'")


def test_a_separator_the_tokenizer_lacks(tmp_path, bpe_eot):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    _fails(
        tmp_path,
        [path],
        "--eos '<nope>' is not a token of tokenizer",
        tokenizer=str(bpe_eot),
        eos="<nope>",
    )
    _fails(tmp_path, [path], "--bos '<s>': the byte tokenizer has no special tokens", bos="<s>")


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    path = _jsonl(tmp_path / "d.jsonl", [{"body": "x"}])
    assert main(["prepare-data", str(path), "--out", str(tmp_path / "o.tokens")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}:1 has no field 'text'" in err


def test_read_documents_yields_records_with_their_index(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "bc"}])
    (tmp_path / "t.txt").write_bytes(b"\xe9 latin-1 text stays bytes")
    docs = list(read_documents([path, tmp_path / "t.txt"]))
    assert docs == [
        Document(str(path), b"a", 0),
        Document(str(path), b"bc", 1),
        Document(str(tmp_path / "t.txt"), b"\xe9 latin-1 text stays bytes"),
    ]
    assert (
        open_tokens(prepare_data([path], tmp_path / "x.tokens").path, validate=True).num_tokens == 3
    )


def test_text_key_without_records_is_reported_unused(tmp_path):
    from jaxpar.config import load_config
    from jaxpar.unused import unused_settings

    assert "data.text_key" in unused_settings(load_config([], ["data.text_key=body"]))
    path = f"data.path={tmp_path / 'd.jsonl'}"
    assert unused_settings(load_config([], ["data.text_key=body", path])) == []


def test_a_model_folder_as_the_tokenizer_gives_its_end_of_text(tmp_path):
    """`prepare-data --tokenizer FOLDER`: the folder's tokenizer.json, each document closed
    by the eos_token its tokenizer_config.json names (here not one of the usual
    end-of-text names, so nothing else would have chosen it)."""
    from tests.helpers import train_bpe

    folder = tmp_path / "model"
    folder.mkdir()
    train_bpe(
        ["hello world", "second doc"] * 20,
        folder / "tokenizer.json",
        special_tokens=("<|im_end|>", "<|endoftext|>"),
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": {"content": "<|im_end|>"}, "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "hello world"}\n{"text": "second doc"}\n')
    tf = prepare_data([src], tmp_path / "a.tokens", str(folder))
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    end = hf.token_to_id("<|im_end|>")
    expected = [*hf.encode("hello world").ids, end, *hf.encode("second doc").ids, end]
    assert np.asarray(tf.tokens).tolist() == expected
    assert tf.meta["eos"] == {"token": "<|im_end|>", "id": end}
    (folder / "tokenizer.json").unlink()
    with pytest.raises(DataError, match="holds no tokenizer.json"):
        prepare_data([src], tmp_path / "b.tokens", str(folder))
