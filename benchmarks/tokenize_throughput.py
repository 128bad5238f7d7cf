"""prepare-data's tokenization throughput against the ``tokenizers`` library's own
``encode_batch`` on the same files.

    python benchmarks/tokenize_throughput.py [--mb 32] [--files 8] [--vocab 8000]

Writes ``--files`` JSON Lines files of ``--mb`` MB of text in all (documents of 1–8 KB
cut from Python's ``pydoc_data.topics``), trains a byte-level BPE of ``--vocab`` ids on
them (``tokenizers``' trainer; nothing is downloaded), then times, best of 3:

* reference: ``Tokenizer.encode_batch(texts, add_special_tokens=False)`` over every
  document's text, already in memory (reading and parsing the files not counted), and
  ``encode_batch_fast`` (the same ids without character offsets; prepare-data calls it);
* jaxpar: ``jaxpar prepare-data FILES --out OUT --tokenizer T --workers N`` end to end, as
  a user runs it — the process's start, reading and parsing the records, encoding, wrapping
  in end-of-text, writing the token file and its metadata — with one process (``N=1``, the
  library's threads) and one worker process per CPU core.

It prints MB/s of text for both and their ratio (the goal: ≥ 0.9), also without the
process's start (``jaxpar prepare-data --help``, timed alike), and checks that both give
the same ids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def cores() -> int:
    """The CPU cores this process may use (prepare-data's default --workers)."""
    return len(os.sched_getaffinity(0))


def write_corpus(folder: Path, mb: int, files: int) -> list[Path]:
    """``files`` JSONL files holding ``mb`` MB of text in documents of 1–8 KB."""
    text = "\n\n".join(topics[k] for k in sorted(topics))
    rng = np.random.default_rng(0)
    per_file = mb * 2**20 // files
    paths = []
    for i in range(files):
        path, size = folder / f"part{i}.jsonl", 0
        with open(path, "w") as f:
            while size < per_file:
                length = int(rng.integers(1024, 8192))
                start = int(rng.integers(0, len(text) - length))
                doc = text[start : start + length]
                f.write(json.dumps({"text": doc}) + "\n")
                size += len(doc.encode())
        paths.append(path)
    return paths


def train_tokenizer(paths: list[Path], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        show_progress=False,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(read_texts(paths[:1]), trainer)
    tok.save(str(out))
    return out


def read_texts(paths: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for p in paths for line in p.read_text().splitlines()]


def prepare(paths: list[Path], tok_file: Path, out: Path, workers: int) -> np.ndarray:
    """``jaxpar prepare-data`` in a fresh process; the ids it wrote."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "prepare-data",
            *map(str, paths),
            "--out",
            str(out),
            "--tokenizer",
            str(tok_file),
            "--workers",
            str(workers),
            "--overwrite",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    meta = json.loads(Path(f"{out}.json").read_text())
    return np.fromfile(out, dtype=meta["dtype"])


def start_up() -> None:
    """``jaxpar prepare-data --help``: the process's start alone."""
    subprocess.run(
        [sys.executable, "-m", "jaxpar", "prepare-data", "--help"],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
    )


def best_of(n: int, fn) -> tuple[float, object]:
    times, result = [], None
    for _ in range(n):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    folder = Path(tempfile.mkdtemp(prefix="tokenize_throughput"))
    try:
        paths = write_corpus(folder, args.mb, args.files)
        tok_file = train_tokenizer(paths, args.vocab, folder / "tokenizer.json")
        texts = read_texts(paths)
        mb = sum(len(t.encode()) for t in texts) / 2**20
        hf = Tokenizer.from_file(str(tok_file))
        ref_s, encodings = best_of(
            args.repeats, lambda: hf.encode_batch(texts, add_special_tokens=False)
        )
        fast_s, _ = best_of(
            args.repeats, lambda: hf.encode_batch_fast(texts, add_special_tokens=False)
        )
        start_s, _ = best_of(args.repeats, start_up)
        eot = hf.token_to_id("<|endoftext|>")
        expected = np.concatenate([np.append(e.ids, eot) for e in encodings])
        print(
            f"{mb:.1f} MB of text in {len(texts):,} documents, {args.files} files, "
            f"BPE of {args.vocab} ids, {cores()} CPU cores"
        )
        print(
            f"  tokenizers encode_batch (in memory): {mb / ref_s:6.2f} MB/s; "
            f"encode_batch_fast (no offsets, what prepare-data calls): {mb / fast_s:.2f} MB/s"
        )
        for workers in (1, cores()):
            ours_s, ids = best_of(
                args.repeats,
                lambda workers=workers: prepare(paths, tok_file, folder / "out.tokens", workers),
            )
            assert np.array_equal(ids, expected), "the ids differ"
            print(
                f"  jaxpar prepare-data --workers {workers} (end to end): "
                f"{mb / ours_s:6.2f} MB/s, ratio {ref_s / ours_s:.2f}; without the "
                f"process's start ({start_s:.1f} s): {ref_s / (ours_s - start_s):.2f}"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
