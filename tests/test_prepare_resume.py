"""prepare-data on worker processes and resumed after a stop: the token file and its
metadata are those of one uninterrupted run in one process, byte for byte."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxpar.data import builtin_text
from jaxpar.data import partial as partial_module
from jaxpar.data import prepare as prepare_module
from jaxpar.data.partial import partial_folder
from jaxpar.data.prepare import _position, prepare_data
from jaxpar.errors import DataError, Paused
from tests.helpers import LIST_IMPORTS, imports_and_lines, train_bpe

pytest.importorskip("tokenizers")
TEXT = builtin_text().decode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[Path], Path]:
    """Three JSON Lines files of 40 documents each, a text file, and a BPE with an
    end-of-text token."""
    folder = tmp_path_factory.mktemp("corpus")
    files = []
    for f in range(3):
        path = folder / f"part{f}.jsonl"
        lines = [
            json.dumps({"text": TEXT[(40 * f + i) * 700 : (40 * f + i) * 700 + 650]})
            for i in range(40)
        ]
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    (folder / "notes.txt").write_text(TEXT[-3000:])
    files.append(folder / "notes.txt")
    tok = train_bpe([TEXT[:60_000]], folder / "tokenizer.json", special_tokens=("<|endoftext|>",))
    return files, tok


def _files(out: Path) -> tuple[bytes, dict]:
    return out.read_bytes(), json.loads(Path(f"{out}.json").read_text())


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> tuple[bytes, dict]:
    """One run in this process, on the tokenizer library's threads."""
    files, tok = corpus
    out = tmp_path_factory.mktemp("ref") / "ref.tokens"
    prepare_data(files, out, tok, workers=1)
    return _files(out)


def _stop_after(monkeypatch, count: int, signal_error: type[BaseException]) -> None:
    """Documents are read until ``count`` have been, then the stop arrives."""
    real = prepare_module.read_documents

    def reading(files, key):
        for i, doc in enumerate(real(files, key)):
            if i == count:
                raise signal_error()
            yield doc

    monkeypatch.setattr(prepare_module, "read_documents", reading)


def test_worker_processes_write_the_same_file(corpus, reference, tmp_path, monkeypatch):
    """Documents split into small batches over two worker processes: the same ids and
    metadata as one process, and a partial folder no longer there."""
    files, tok = corpus
    from jaxpar.data import encoding

    monkeypatch.setattr(encoding, "WORKER_BATCH_BYTES", 3000)  # ~5 documents a batch
    out = tmp_path / "w.tokens"
    prepare_data(files, out, tok, workers=2)
    data, meta = _files(out)
    assert data == reference[0] and meta == reference[1]
    assert len(meta["documents"]) == 121 and meta["eos"]["token"] == "<|endoftext|>"
    assert not partial_folder(out).exists()


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, 130), (None, 143)])
def test_a_stopped_run_resumes_to_the_same_file(
    corpus, reference, tmp_path, monkeypatch, stop, status
):
    """A Ctrl-C or SIGTERM in the second file keeps what was written; the same command
    then reads on from there (not the first file again) and writes the reference."""
    from jaxpar.data import encoding
    from jaxpar.errors import Terminated

    files, tok = corpus
    out = tmp_path / "r.tokens"
    monkeypatch.setattr(encoding, "WORKER_BATCH_BYTES", 3000)  # ~5 documents a batch
    _stop_after(monkeypatch, 75, stop or Terminated)
    with pytest.raises(
        Paused,
        match=r": ([\d,]+) documents \([\d,]+ tokens\) of .* are "
        r"kept in .*\.r\.tokens\.partial'; run the same",
    ) as err:
        prepare_data(files, out, tok, workers=2)
    assert err.value.exit_status == status and not out.exists()
    kept = int(str(err.value).split(": ")[1].split()[0])
    progress = json.loads((partial_folder(out) / "progress.json").read_text())
    assert progress["documents"] == kept and 40 < kept <= 75  # batches in flight are lost
    monkeypatch.undo()
    read = []
    real = prepare_module.read_documents
    monkeypatch.setattr(
        prepare_module,
        "read_documents",
        lambda fs, key: (read.append(f.name for f in fs), real(fs, key))[1],
    )
    prepare_data(files, out, tok, workers=2)
    assert [list(names) for names in read] == [["part1.jsonl", "part2.jsonl", "notes.txt"]]
    assert _files(out) == reference and not partial_folder(out).exists()


def test_writes_after_the_last_checkpoint_are_cut_off(corpus, reference, tmp_path, monkeypatch):
    """A crash between checkpoints (SIGKILL) leaves ids and entries that progress.json
    does not count: resuming cuts them off, and the file is the reference."""
    files, tok = corpus
    out = tmp_path / "k.tokens"
    _stop_after(monkeypatch, 30, KeyboardInterrupt)
    with pytest.raises(Paused):
        prepare_data(files, out, tok, workers=1)
    folder = partial_folder(out)
    with open(folder / "tokens", "ab") as f:
        f.write(b"\x07\x00" * 999)
    with open(folder / "documents.jsonl", "a") as f:
        f.write('{"source": "torn", "start": 0, "en')
    monkeypatch.undo()
    prepare_data(files, out, tok, workers=1)
    assert _files(out) == reference


def test_changed_inputs_start_over(corpus, tmp_path, monkeypatch, capsys):
    """An input changed since the stop: the kept part no longer fits, so the command
    says so and starts over; the file is that of the new inputs."""
    files, tok = corpus
    copies = []
    for path in files:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    out = tmp_path / "c.tokens"
    monkeypatch.setattr(partial_module, "CHECKPOINT_S", 0.0)
    _stop_after(monkeypatch, 20, KeyboardInterrupt)
    with pytest.raises(Paused):
        prepare_data(copies, out, tok, workers=1)
    monkeypatch.undo()
    copies[0].write_text(json.dumps({"text": "a new first document"}) + "\n")
    capsys.readouterr()
    prepare_data(copies, out, tok, workers=1)
    assert "changed since the interrupted prepare-data" in capsys.readouterr().err
    expected = tmp_path / "e.tokens"
    prepare_data(copies, expected, tok, workers=1)
    assert _files(out) == _files(expected)
    assert json.loads(Path(f"{out}.json").read_text())["documents"][0]["end"] < 20


def test_two_commands_never_write_one_out(corpus, tmp_path):
    """While one prepare-data writes an --out, another one onto it is refused in one line
    (each would remove the other's partial files); once the first ends, it runs."""
    from jaxpar.data.partial import Partial
    from jaxpar.errors import PathError

    files, tok = corpus
    out = tmp_path / "t.tokens"
    first = Partial(out, {"recipe": "the first command's"}, np.dtype("<u2"))
    with pytest.raises(
        PathError,
        match=r"^another prepare-data is writing '.*t\.tokens' "
        r"now .*; wait for it to end, or choose another --out",
    ):
        prepare_data(files, out, tok, workers=1)
    assert (partial_folder(out) / "documents.jsonl").exists()  # the first's, untouched
    first.discard()
    assert prepare_data(files, out, tok, workers=1).num_tokens > 0
    assert not partial_folder(out).exists() and not list(tmp_path.glob(".t.tokens*"))


def test_a_file_named_twice_is_resumed_in_its_second_reading():
    """The position after the done entries: a record index restarting at 0, or a text
    file's next document, begins the same file's second reading."""
    names = ["a.jsonl", "a.jsonl", "t.txt", "t.txt", "b.jsonl"]
    done = [{"source": "a.jsonl", "record": r} for r in (0, 1, 2, 0, 1)]
    assert _position(done, names) == (1, 2)
    done += [{"source": "a.jsonl", "record": 2}, {"source": "t.txt"}, {"source": "t.txt"}]
    assert _position(done, names) == (3, 1)
    assert _position([], names) == (0, 0)


def test_a_bad_document_in_a_worker_is_one_line(corpus, tmp_path):
    """A record that is not UTF-8 for the tokenizer, met in a worker process: the one
    line naming it, and no partial folder left behind (the input must change first)."""
    files, tok = corpus
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9\n")
    out = tmp_path / "b.tokens"
    with pytest.raises(DataError, match=rf"^input '{bad}' is not UTF-8 text"):
        prepare_data([files[0], bad], out, tok, workers=2)
    assert not partial_folder(out).exists() and not out.exists()


def test_ctrl_c_on_the_command_then_the_same_command(corpus, reference, tmp_path):
    """The real command on two workers: Ctrl-C while it encodes is exit 130 and one line
    saying what is kept, said without importing JAX (the failure's handling loaded it
    for a type check: 5 s under load); the same command then completes the reference
    file."""
    files, tok = corpus
    out = tmp_path / "s.tokens"
    big = tmp_path / "big.txt"  # long enough to be encoding when the signal comes
    big.write_text(TEXT * 6)
    command = [
        sys.executable,
        "-m",
        "jaxpar",
        "prepare-data",
        *map(str, files),
        str(big),
        "--out",
        str(out),
        "--tokenizer",
        str(tok),
        "--workers",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        command,
        env={**env, **LIST_IMPORTS},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (partial_folder(out) / "tokens").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    imported, lines = imports_and_lines(err)
    assert "jaxpar.data.encoding" in imported and "jax" not in imported
    assert len(lines) == 1 and lines[0].startswith("jaxpar: interrupted (Ctrl-C): ")
    assert "run the same command to continue" in lines[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = tmp_path / "e.tokens"
    prepare_data([*files, big], expected, tok, workers=1)
    assert _files(out) == _files(expected)
    assert "resuming the interrupted prepare-data" in done.stderr


def test_a_full_disk_is_exit_5_naming_the_token_file(corpus, tmp_path, capsys):
    """The ids do not fit a 64 KiB file system: exit 5 and one line naming --out (not
    numpy's "N requested and M written"), no token file or metadata left looking valid."""
    from jaxpar.cli import main
    from tests.helpers import small_file_system

    files, tok = corpus
    with small_file_system(tmp_path / "small", "64k") as small:
        out = small / "full.tokens"
        assert (
            main(
                [
                    "prepare-data",
                    *map(str, files),
                    "--out",
                    str(out),
                    "--tokenizer",
                    str(tok),
                    "--workers",
                    "1",
                ]
            )
            == 5
        )
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"'{out}'" in lines[0], lines
        assert "No space left on device" in lines[0] and "requested" not in lines[0]
        assert not out.exists() and not Path(f"{out}.json").exists()
