"""Token files: local text → memory-mapped ids + metadata, round trips, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data import builtin_text
from jaxpar.data.prepare import builtin_corpus, encode_documents, prepare_data
from jaxpar.data.token_file import check_vocab, decode, open_tokens, token_dtype

FILES = {
    "a.txt": b"plain ascii text\nsecond line\n",
    "b.txt": "naïve café — ünïcödé ✓ 日本語\n".encode(),
    "sub/c.md": b"# a heading in a subfolder\n",
}


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    return _write(tmp_path / "corpus", FILES)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer trained here on local text (nothing downloaded)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([builtin_text().decode()[:50_000]], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


# ---------------------------------------------------------------- round trips


def test_byte_round_trip_and_metadata(corpus, tmp_path):
    out = tmp_path / "corpus.tokens"
    tf = prepare_data([corpus], out)
    sources = [str((corpus / rel).absolute()) for rel in ("a.txt", "b.txt", "sub/c.md")]
    assert [d["source"] for d in tf.documents] == sources
    for doc, rel in zip(tf.documents, ("a.txt", "b.txt", "sub/c.md")):
        assert decode(tf, doc["start"], doc["end"]) == FILES[rel]
    total = sum(len(v) for v in FILES.values())
    assert tf.num_tokens == total and out.stat().st_size == 2 * total
    assert isinstance(tf.tokens, np.memmap) and tf.tokens.dtype == np.dtype("<u2")
    assert np.array_equal(
        np.fromfile(out, "<u2"),
        np.frombuffer(b"".join(FILES[r] for r in ("a.txt", "b.txt", "sub/c.md")), np.uint8),
    )
    meta = json.loads((tmp_path / "corpus.tokens.json").read_text())
    assert meta == tf.meta
    assert {
        k: meta[k] for k in ("format", "version", "dtype", "vocab_size", "num_tokens", "tokenizer")
    } == {
        "format": "jaxpar-tokens",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": 256,
        "num_tokens": total,
        "tokenizer": "byte",
    }
    ends = [0] + [d["end"] for d in meta["documents"]]
    assert [d["start"] for d in meta["documents"]] == ends[:-1] and ends[-1] == total
    assert open_tokens(out, validate=True).num_tokens == total


def test_hf_tokenizer_round_trip(corpus, tmp_path, bpe_file):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_file))
    tf = prepare_data([corpus], tmp_path / "bpe.tokens", tokenizer=str(bpe_file))
    assert tf.vocab_size == tok.get_vocab_size() > 256
    assert tf.meta["dtype"] == "uint16"
    assert tf.meta["tokenizer"]["file"] == str(bpe_file.absolute())
    assert len(tf.meta["tokenizer"]["sha256"]) == 64
    for doc, rel in zip(tf.documents, ("a.txt", "b.txt", "sub/c.md")):
        text = FILES[rel].decode()
        ids = tok.encode(text).ids
        assert list(tf.tokens[doc["start"] : doc["end"]]) == ids
        assert len(ids) < len(FILES[rel])  # merges happened: not just bytes
        assert decode(tf, doc["start"], doc["end"]) == text
    assert tf.num_tokens == tf.documents[-1]["end"]


def test_hf_decode_refuses_a_changed_tokenizer(corpus, tmp_path, bpe_file):
    copy = tmp_path / "tok.json"
    copy.write_bytes(bpe_file.read_bytes())
    tf = prepare_data([corpus], tmp_path / "bpe.tokens", tokenizer=str(copy))
    copy.write_text(copy.read_text() + "\n")
    with pytest.raises(ValueError, match="changed since"):
        decode(tf, 0, 3)


def test_encode_documents_is_pure_and_matches_prepare(corpus, tmp_path):
    docs = [("x", b"hello"), ("empty", b""), ("y", "é".encode())]
    tokens, meta = encode_documents(docs, "byte")
    assert tokens.dtype == np.dtype("<u2") and list(tokens) == list(b"hello\xc3\xa9")
    assert meta["documents"] == [
        {"source": "x", "start": 0, "end": 5},
        {"source": "empty", "start": 5, "end": 5},
        {"source": "y", "start": 5, "end": 7},
    ]
    tf = prepare_data([corpus], tmp_path / "c.tokens")
    files = [(d["source"], Path(d["source"]).read_bytes()) for d in tf.documents]
    tokens, meta = encode_documents(files, "byte")
    assert np.array_equal(tokens, tf.tokens) and meta == tf.meta


def test_dtype_choice():
    assert token_dtype(256) == np.dtype("<u2")
    assert token_dtype(65536) == np.dtype("<u2")  # ids up to 65535 fit
    assert token_dtype(65537) == np.dtype("<u4")
    assert token_dtype(200_000).name == "uint32"
    with pytest.raises(ValueError, match="vocab_size 0"):
        token_dtype(0)


def test_uint32_file_is_read_back(tmp_path):
    class Wide:  # a stand-in tokenizer with a vocabulary too large for uint16
        vocab_size = 70_000

        def encode(self, data, source):
            return np.array([69_999, 0, 65_536], np.int64)

        def describe(self):
            return "wide-test"

    src = tmp_path / "x.txt"
    src.write_text("anything")
    tf = prepare_data([src], tmp_path / "w.tokens", tokenizer=Wide())
    assert tf.meta["dtype"] == "uint32" and tf.tokens.dtype == np.dtype("<u4")
    assert list(open_tokens(tf.path, validate=True).tokens) == [69_999, 0, 65_536]


def test_glob_order_and_hidden_files(tmp_path):
    folder = _write(
        tmp_path / "in",
        {
            "z.txt": b"z",
            "a.txt": b"a",
            "m/b.txt": b"b",
            "m-c.txt": b"c",
            "n.md": b"n",
            ".hidden.txt": b"H",
            ".git/x.txt": b"G",
            "m/.secret.txt": b"S",
        },
    )
    tf = prepare_data([folder], tmp_path / "o.tokens", glob="*.txt")
    names = [str(Path(d["source"]).relative_to(folder)) for d in tf.documents]
    assert names == ["a.txt", "m/b.txt", "m-c.txt", "z.txt"]  # sorted by path parts
    assert decode(tf) == b"abcz"
    everything = prepare_data([folder], tmp_path / "all.tokens")
    assert decode(everything) == b"abcnz"
    # A hidden file named explicitly is used; inputs keep their order.
    both = prepare_data([folder / ".hidden.txt", folder / "n.md"], tmp_path / "b.tokens")
    assert decode(both) == b"Hn"


def test_output_inside_input_folder_is_not_read_back(corpus):
    out = corpus / "corpus.tokens"
    first = prepare_data([corpus], out)
    second = prepare_data([corpus], out, overwrite=True)
    assert second.num_tokens == first.num_tokens == sum(len(v) for v in FILES.values())


@pytest.mark.parametrize("existing", ["out", "metadata"])
def test_an_existing_token_file_is_kept_unless_overwrite(corpus, tmp_path, capsys, existing):
    """An existing --out (or its metadata alone) is refused in one line, every byte kept;
    --overwrite replaces it. A run's own file is refused even with --overwrite."""
    out = tmp_path / "c.tokens"
    kept = Path(f"{out}.json") if existing == "metadata" else out
    kept.write_bytes(b"someone's file\n")
    assert main(["prepare-data", str(corpus), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0 and f"'{kept}' exists; choose another path, or pass --overwrite" in err
    )
    assert kept.read_bytes() == b"someone's file\n"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--overwrite"]) == 0
    assert open_tokens(out).num_tokens == sum(len(v) for v in FILES.values())
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text("{}\n")
    config = (run / "config.yaml").read_bytes()
    assert (
        main(["prepare-data", str(corpus), "--out", str(run / "config.yaml"), "--overwrite"]) == 2
    )
    assert "of the run in" in capsys.readouterr().err
    assert (run / "config.yaml").read_bytes() == config


def test_builtin_corpus():
    tf = builtin_corpus()
    text = builtin_text()
    assert tf.vocab_size == 256 and tf.num_tokens == len(text) > 100_000
    assert tf.name == "pydoc_data.topics" and tf.path is None
    assert tf.documents == [{"source": "pydoc_data.topics", "start": 0, "end": len(text)}]
    assert decode(tf) == text


def test_check_vocab(corpus, tmp_path):
    tf = prepare_data([corpus], tmp_path / "c.tokens")
    check_vocab(tf, 256)
    check_vocab(tf, 1000)
    with pytest.raises(ValueError) as err:
        check_vocab(tf, 100)
    for part in ("model.vocab_size=100", "256", "data.path", str(tf.path)):
        assert part in str(err.value)


# ---------------------------------------------------------------- errors


def test_missing_input(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"input '{missing}' does not exist"):
        prepare_data([missing], tmp_path / "o.tokens")


def test_empty_folder_and_unmatched_glob(corpus, tmp_path):
    empty = tmp_path / "empty"
    (empty / ".only-hidden").mkdir(parents=True)
    (empty / ".only-hidden" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match=f"folder '{empty}' holds no files"):
        prepare_data([empty], tmp_path / "o.tokens")
    with pytest.raises(ValueError, match=r"matching --glob '\*.rst'"):
        prepare_data([corpus], tmp_path / "o.tokens", glob="*.rst")


def test_empty_corpus(tmp_path):
    (tmp_path / "e1.txt").write_bytes(b"")
    (tmp_path / "e2.txt").write_bytes(b"")
    out = tmp_path / "o.tokens"
    with pytest.raises(ValueError, match="zero tokens") as err:
        prepare_data([tmp_path / "e1.txt", tmp_path / "e2.txt"], out)
    assert "e1.txt" in str(err.value)
    assert not out.exists() and not (tmp_path / "o.tokens.json").exists()
    assert not (tmp_path / "o.tokens.tmp").exists()
    with pytest.raises(ValueError, match="zero tokens"):
        encode_documents([("nothing", b"")], "byte")


def test_non_utf8_with_hf_tokenizer(tmp_path, bpe_file):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=f"input '{bad}' is not UTF-8"):
        prepare_data([bad], tmp_path / "o.tokens", tokenizer=str(bpe_file))
    assert decode(prepare_data([bad], tmp_path / "b.tokens")) == "café".encode("latin-1")


def test_bad_tokenizer_spec(corpus, tmp_path):
    with pytest.raises(ValueError, match="'nonexistent.json' is neither 'byte'"):
        prepare_data([corpus], tmp_path / "o.tokens", tokenizer="nonexistent.json")
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=f"tokenizer '{junk}' is not a valid"):
        prepare_data([corpus], tmp_path / "o.tokens", tokenizer=str(junk))


def test_missing_tokenizers_package_names_the_extra(monkeypatch, tmp_path, corpus):
    import builtins

    from jaxpar.data import tokenizers

    real_import = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("no tokenizers")
        return real_import(name, *args, **kwargs)

    tokenizers.load_hf.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    tok = tmp_path / "t.json"
    tok.write_text("{}")
    with pytest.raises(ValueError, match=r"pip install 'jaxpar\[text\]'"):
        prepare_data([corpus], tmp_path / "o.tokens", tokenizer=str(tok))


@pytest.fixture
def written(corpus, tmp_path) -> Path:
    out = tmp_path / "c.tokens"
    prepare_data([corpus], out)
    return out


def _edit_meta(out: Path, **changes) -> Path:
    meta_path = out.with_name(out.name + ".json")
    meta = json.loads(meta_path.read_text())
    meta.update(changes)
    meta_path.write_text(json.dumps(meta))
    return meta_path


def test_missing_token_file(tmp_path):
    missing = tmp_path / "nope.tokens"
    with pytest.raises(ValueError, match=f"token file '{missing}' does not exist"):
        open_tokens(missing)


def test_missing_metadata(written):
    written.with_name(written.name + ".json").unlink()
    with pytest.raises(ValueError, match=f"metadata file '{written}.json' .* is missing"):
        open_tokens(written)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": "something-else"}, "is not a jaxpar-tokens file"),
        ({"version": 2}, "unknown version 2"),
        ({"dtype": "int64"}, "dtype 'int64' must be one of"),
        ({"vocab_size": 70_000}, "vocab_size=70000 does not fit dtype uint16"),
        ({"num_tokens": -1}, "num_tokens=-1 must be an integer"),
    ],
)
def test_bad_metadata(written, changes, message):
    meta_path = _edit_meta(written, **changes)
    with pytest.raises(ValueError, match=message) as err:
        open_tokens(written)
    assert str(meta_path) in str(err.value)


def test_metadata_not_json(written):
    meta_path = written.with_name(written.name + ".json")
    meta_path.write_text("{truncated")
    with pytest.raises(ValueError, match=f"'{meta_path}' is not valid JSON"):
        open_tokens(written)


def test_truncated_token_file(written):
    data = written.read_bytes()
    written.write_bytes(data[:-2])
    with pytest.raises(ValueError, match=": it is truncated; re-create it") as err:
        open_tokens(written)
    assert str(written) in str(err.value) and f"{len(data) - 2} bytes" in str(err.value)


def test_validate_finds_out_of_range_ids(written):
    ids = np.fromfile(written, "<u2")
    ids[3] = 300
    ids.tofile(written)
    open_tokens(written)  # cheap open: no scan
    with pytest.raises(ValueError, match=f"'{written}' holds token id 300 but its vocab_size is"):
        open_tokens(written, validate=True)


def test_validate_checks_document_boundaries(written):
    meta = json.loads(written.with_name(written.name + ".json").read_text())
    meta["documents"][1]["start"] += 1
    _edit_meta(written, documents=meta["documents"])
    with pytest.raises(ValueError, match="do not tile"):
        open_tokens(written, validate=True)


def test_decode_range_is_checked(written):
    tf = open_tokens(written)
    with pytest.raises(ValueError, match=r"range \[0, 10000\) is outside"):
        decode(tf, 0, 10_000)


# ---------------------------------------------------------------- CLI


def test_cli_prepare_data(corpus, tmp_path, capsys):
    out = tmp_path / "cli.tokens"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--glob", "*.txt"]) == 0
    stdout = capsys.readouterr().out
    tf = open_tokens(out, validate=True)
    assert len(tf.documents) == 2 and tf.num_tokens == len(FILES["a.txt"]) + len(FILES["b.txt"])
    assert stdout.count("\n") == 1
    for part in (
        f"{tf.num_tokens:,} tokens",
        "2 documents",
        "vocab 256",
        "uint16",
        f"{2 * tf.num_tokens:,} bytes",
        str(out),
    ):
        assert part in stdout


def test_cli_missing_input_exits_2(tmp_path, capsys):
    missing = tmp_path / "absent"
    assert main(["prepare-data", str(missing), "--out", str(tmp_path / "o.tokens")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error:") and str(missing) in err


# ---------------------------------------------------------------- never onto an input


@pytest.mark.parametrize(
    "name,out",
    [("ok.txt", "ok.txt"), ("ok.txt", "link.txt"), ("ok.txt", "hard.txt"), ("notes.json", "notes")],
)
def test_cli_prepare_data_onto_its_own_input_is_refused(tmp_path, capsys, monkeypatch, name, out):
    """The same file, through a symlink or a hard link, or as the metadata written beside
    ``--out``: refused in one line naming both paths, the input unchanged."""
    monkeypatch.chdir(tmp_path)
    text = Path(name)
    text.write_bytes(b"the only copy of my notes\n")
    Path("link.txt").symlink_to(text)
    Path("hard.txt").hardlink_to(text)
    assert main(["prepare-data", name, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error:") and err.count("\n") == 1
    assert f"is the input file '{tmp_path / name}'" in err and "choose an --out" in err
    assert text.read_bytes() == b"the only copy of my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "link.txt", "hard.txt"])


def test_cli_out_inside_input_folder_onto_one_of_its_texts_is_refused(corpus, capsys):
    before = {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()}
    assert main(["prepare-data", str(corpus), "--out", str(corpus / "a.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out '{corpus / 'a.txt'}' is the input file" in err
    assert {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()} == before
    # a file the --glob leaves out is no input, but it exists: kept unless --overwrite
    command = [
        "prepare-data",
        str(corpus),
        "--out",
        str(corpus / "sub" / "c.md"),
        "--glob",
        "*.txt",
    ]
    assert main(command) == 2 and "exists; choose another path" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()} == before
    assert main([*command, "--overwrite"]) == 0


def test_folder_holding_an_earlier_output_is_tokenized_without_it(corpus, tmp_path):
    clean = prepare_data([corpus], tmp_path / "clean.tokens")
    prepare_data([corpus / "a.txt"], corpus / "earlier.bin")  # token ids + earlier.bin.json
    (corpus / "sub" / "old.tokens").write_bytes(b"\x01\x00\x02\x00")  # metadata lost
    (corpus / "new.tokens.tmp").write_bytes(b"\x01\x00")  # an interrupted run's leftover
    with pytest.warns(
        UserWarning,
        match=r"skipped 4 jaxpar token file\(s\) in the input "
        r"folders \(earlier prepare-data outputs, not text\)",
    ):
        again = prepare_data([corpus], tmp_path / "again.tokens")
    assert again.num_tokens == clean.num_tokens and again.documents == clean.documents
    assert np.array_equal(again.tokens, clean.tokens)


@pytest.mark.parametrize("named", ["x.tokens", "x.tokens.json"])
def test_a_token_file_named_as_an_input_is_refused(corpus, tmp_path, capsys, named):
    prepare_data([corpus], tmp_path / "x.tokens")
    assert main(["prepare-data", str(tmp_path / named), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"input '{tmp_path / named}' is a jaxpar token file" in err
    assert not (tmp_path / "y").exists()


def test_workers_with_fine_tuning_records_is_refused_not_ignored(tmp_path, capsys):
    """--workers does not apply to --records prompt_completion: one line, nothing written."""
    records = tmp_path / "r.jsonl"
    records.write_text('{"prompt": "a", "completion": "b"}\n')
    out = tmp_path / "r.tokens"
    assert (
        main(
            [
                "prepare-data",
                str(records),
                "--out",
                str(out),
                "--records",
                "prompt_completion",
                "--workers",
                "2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        "jaxpar: error: --workers 2 applies to --records text; fine-tuning records "
        "are encoded in this process: drop --workers"
    )
    assert not out.exists()


def test_the_command_prepares_data_without_loading_jax(corpus, tmp_path):
    """``jaxpar prepare-data`` imports neither JAX nor grain (its start is the tokenizer's,
    not theirs), and writes the same file as the Python call."""
    import subprocess
    import sys

    out = tmp_path / "cmd.tokens"
    code = (
        "import sys\nfrom jaxpar.cli import console\nsys.argv = ['jaxpar', 'prepare-data', "
        f"'--out', {str(out)!r}, {str(corpus)!r}]\n"
        "try:\n    console()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in ('jax', 'grain', 'flax', 'optax') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    prepare_data([corpus], tmp_path / "api.tokens")
    assert out.read_bytes() == (tmp_path / "api.tokens").read_bytes()
