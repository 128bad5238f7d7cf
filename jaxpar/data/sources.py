"""The data a config asks for: a train and an eval source plus what the model must match.

``data.dataset=auto`` reads ``data.path`` — a token file made by ``jaxpar
prepare-data``; records (JSON Lines, Parquet, Arrow, a ``save_to_disk`` folder) or text
files, named as a file, a folder or a glob, tokenized in memory as ``prepare-data``
would with the byte tokenizer; or an ``.npz`` of images and labels — or, without a
path, the built-in data: Python's own ``pydoc_data.topics`` text for language models and
SYNTHETIC labelled images for classifiers. ``digits`` is scikit-learn's handwritten
digits (8×8, 10 classes; ``pip install 'jaxpar[digits]'``); ``synthetic`` is random
tokens or template images, for benchmarks, labelled as such wherever the run names its
data.

Text splits by position (the last ``eval_fraction`` of the tokens is held out);
images split by index after one fixed shuffle (seed 0, the same for every run).
"""

from __future__ import annotations

import dataclasses
import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data import mixture as mix
from jaxpar.data.data_config import DataConfig
from jaxpar.data.finetune import open_mask
from jaxpar.data.images import load_digits, load_npz, synthetic_images
from jaxpar.data.inputs import find_inputs
from jaxpar.data.loader import ArrayExamples, Loader, RowShare, TokenWindows, fixed_batches
from jaxpar.data.prepare import builtin_corpus, encode_documents
from jaxpar.data.records import read_documents
from jaxpar.data.token_file import TokenFile, check_vocab, open_tokens, tokenizer_of
from jaxpar.data.tokenizers import ByteTokenizer, Tokenizer
from jaxpar.data.windows import document_starts
from jaxpar.errors import DataError
from jaxpar.task import DataNeeds


@dataclass
class Data(RowShare):
    """Train and eval sources and the settings that turn them into batches.

    ``batch(i, B)`` is global batch ``i`` (0-based) of the training stream
    (this process's rows) by random access — exactly what the ``i + 1``-th
    batch of :meth:`loader` is; ``batch(i, B, "eval")`` is the ``i``-th fixed
    held-out batch.
    """

    name: str
    train: TokenWindows | ArrayExamples | mix.Mixed
    eval: TokenWindows | ArrayExamples | mix.Mixed
    seed: int
    vocab_size: int | None = None
    image_shape: tuple[int, int, int] | None = None
    seq_len: int = 0
    pack: str = "concat"
    #: examples carry ``loss_mask`` (a token file of fine-tuning records)
    loss_mask: bool = False
    _streams: dict[int, Loader] = field(default_factory=dict, repr=False)
    has_eval = True
    _eval: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict, repr=False)

    def _forget(self) -> None:
        self._streams, self._eval = {}, {}

    def loader(self, batch_size: int, cfg: DataConfig | None = None) -> Loader:
        """A fresh training stream of global batches of ``batch_size`` rows (this process's)."""
        cfg = cfg or DataConfig()
        make = mix.MixtureLoader if isinstance(self.train, mix.Mixed) else Loader
        return make(
            self.train,
            global_batch_size=batch_size,
            seed=self.seed,
            process_index=self.share[0],
            process_count=self.share[1],
            threads=cfg.threads,
            prefetch=cfg.prefetch,
            workers=cfg.workers,
        )

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, np.ndarray]:
        if split == "eval":
            if len(self.eval) < batch_size:
                raise DataError(
                    f"the held-out split of '{self.name}' has {len(self.eval)} examples, fewer "
                    f"than one batch of train.batch_size={batch_size}; raise "
                    f"data.eval_fraction, lower train.batch_size, or set train.eval_every=0 "
                    f"to train without evaluating"
                )
            cached = self._eval.get(batch_size, [])
            if len(cached) <= index:
                cached = self._eval[batch_size] = fixed_batches(
                    self.eval, batch_size, index + 1, *self.share
                )
            return cached[index]
        if batch_size not in self._streams:
            self._streams[batch_size] = self.loader(batch_size, DataConfig(threads=0, prefetch=0))
        return self._streams[batch_size].batch_at(index)


def _cut(n: int, eval_fraction: float, what: str) -> int:
    cut = int(n * (1.0 - eval_fraction))
    if cut == 0 or cut == n:
        raise DataError(
            f"{what} of {n} items is too small to split with data.eval_fraction={eval_fraction}"
        )
    return cut


def text_data(
    tf: TokenFile, cfg: DataConfig, vocab_size: int | None, seed: int, example_ids: bool = False
) -> Data:
    """Windows of ``data.seq_len + 1`` tokens; the last ``eval_fraction`` held out (the
    vocabulary checked against ``vocab_size`` unless it is None; ``example_ids``: each
    window also carries its ``index``)."""
    check_vocab(tf, vocab_size)  # also the ids a token file holds, when it is opened
    starts = document_starts(tf.documents) if cfg.pack == "documents" else None
    mask = open_mask(tf)
    n = tf.num_tokens
    cut = _cut(n, cfg.eval_fraction, f"text '{tf.name}'")
    shortest = min(cut, n - cut)
    if cfg.seq_len + 1 > shortest:
        raise DataError(
            f"data.seq_len={cfg.seq_len} is longer than the {shortest}-token split "
            f"of '{tf.name}'; lower data.seq_len or use more text"
        )
    return Data(
        tf.name,
        TokenWindows(tf.tokens, cfg.seq_len, 0, cut, example_ids, starts, mask),
        TokenWindows(tf.tokens, cfg.seq_len, cut, n, example_ids, starts, mask),
        seed,
        vocab_size=tf.vocab_size,
        seq_len=cfg.seq_len,
        pack=cfg.pack,
        loss_mask=mask is not None,
    )


def image_data(
    images: np.ndarray, labels: np.ndarray, cfg: DataConfig, seed: int, name: str
) -> Data:
    """Examples split by index after a fixed shuffle (the same split for every seed)."""
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    cut = _cut(len(labels), cfg.eval_fraction, f"image set '{name}'")
    return Data(
        name,
        ArrayExamples(images, labels, 0, cut),
        ArrayExamples(images, labels, cut, len(labels)),
        seed,
        image_shape=tuple(images.shape[1:]),
    )


def synthetic_tokens(n: int, vocab_size: int, seed: int = 1234) -> TokenFile:
    """SYNTHETIC text: ``n`` uniformly random token ids (nothing to learn; for benchmarks),
    drawn as 32-bit ids: gpt_long.yaml's 134 M took 0.5 s here, where drawing 64-bit ids and
    converting them took 16 s and three times the memory."""
    tokens = np.random.default_rng(seed).integers(0, vocab_size, n, dtype=np.uint32)
    meta = {
        "vocab_size": vocab_size,
        "num_tokens": n,
        "tokenizer": "synthetic",
        "documents": [{"source": "synthetic", "start": 0, "end": n}],
    }
    return TokenFile(tokens, vocab_size, meta, "SYNTHETIC random tokens")


def _is_token_file(path: Path) -> bool:
    return Path(f"{path}.json").exists() or path.suffix == ".tokens"


def _text_file(cfg: DataConfig) -> TokenFile:
    """A prepared token file (it has ``PATH.json``, or is named ``*.tokens``), else the
    documents of the files ``data.path`` names, byte-tokenized as ``prepare-data`` does."""
    path = Path(cfg.path)
    if _is_token_file(path):
        return open_tokens(path)  # a .tokens file without its metadata is an error there
    docs = read_documents(find_inputs([cfg.path]), cfg.text_key)
    tokens, meta = encode_documents(docs, "byte")
    return TokenFile(tokens, meta["vocab_size"], meta, cfg.path, path)


def _check_path(cfg: DataConfig, is_text: bool) -> None:
    """Raise unless ``data.path`` is a file or (for text) a folder or a glob of files."""
    path = Path(cfg.path)
    many = is_text and (
        (path.is_dir() and any(path.iterdir())) or (not path.exists() and glob.has_magic(cfg.path))
    )
    if not (path.is_file() or many):
        also = " (nor a folder or glob of data files)" if is_text else ""
        raise DataError(f"data.path '{cfg.path}' does not exist or is not a file{also}")


def text_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of the text ``cfg`` names (what turns a prompt into the ids a model
    trained on it reads): a token file's own, else bytes.

    Raises:
      DataError: for synthetic data (ids without text) or a token file whose tokenizer
        file is missing or changed.
    """
    if cfg.dataset == "synthetic":
        raise DataError(
            "the run trained on data.dataset=synthetic: random token ids "
            "without text; train on text (data.path=… or the built-in corpus)"
        )
    path = text_path(cfg)
    if path and _is_token_file(Path(path)):
        return tokenizer_of(open_tokens(path))
    return ByteTokenizer()


def text_path(cfg: DataConfig) -> str | None:
    """The file the text ``cfg`` names is read from (a mixture's sources share one
    tokenizer: its first's)."""
    return cfg.mixture[0][0] if cfg.mixture else cfg.path


def text_end(cfg: DataConfig) -> int | None:
    """The id that closes each document of the text ``cfg`` names (a token file's ``eos``
    separator), where its model learned to end a text; None for bytes and built-in text."""
    path = text_path(cfg)
    if cfg.dataset == "synthetic" or not path or not _is_token_file(Path(path)):
        return None
    eos = open_tokens(path).meta.get("eos")
    return int(eos["id"]) if isinstance(eos, dict) else None


def needs_of_batch(batch_keys: Any) -> DataNeeds | None:
    """The data a task's batch entries ask for, or None when they are neither jaxpar's
    text batches (``tokens``; ``segments`` of packed documents, ``index`` the examples'
    ids, ``loss_mask`` the targets of fine-tuning records that count) nor its image
    batches (``images``, ``labels``)."""
    keys = set(batch_keys)
    ids, mask = "index" in keys, "loss_mask" in keys
    text = keys - {"index", "loss_mask"}
    if text == {"tokens"}:
        return DataNeeds("text", example_ids=ids, loss_mask=mask)
    if text == {"tokens", "segments"}:
        return DataNeeds("text", documents=True, example_ids=ids, loss_mask=mask)
    if keys == {"images", "labels"}:
        return DataNeeds("images")
    return None


def _masks_fit(data: Data, needs: DataNeeds) -> Data:
    if data.loss_mask and not needs.loss_mask:
        raise DataError(
            f"'{data.name}' holds fine-tuning records with a loss mask, which "
            "this model does not train on (a causal language model such as "
            "gpt, llama or gemma does, and a task of your own whose batch_axes name "
            "'loss_mask'); use one, or prepare the data without --records"
        )
    return data


def _mixture_source(cfg: DataConfig, index: int, path: str) -> TokenFile:
    """Source ``index`` of ``data.mixture``, read as ``data.path`` reads a path."""
    if not (Path(path).exists() or glob.has_magic(path)):
        raise DataError(
            f"data.mixture entry {index + 1} '{path}' does not exist; fix the "
            "path or drop the entry"
        )
    one = dataclasses.replace(cfg, path=path, mixture=None)
    _check_path(one, True)
    return _text_file(one)


def mixture_data(cfg: DataConfig, needs: DataNeeds, seed: int) -> Data:
    """``data.mixture``: each source split as :func:`text_data` splits one, and the splits
    mixed by weight (:mod:`jaxpar.data.mixture`).

    Raises:
      DataError: a mixture for a classifier or beside ``data.path``/``data.dataset``, a
        missing source, sources of different tokenizers — one line naming the entry.
    """
    if needs.kind != "text" or cfg.path or cfg.dataset != "auto":
        raise DataError(
            "data.mixture mixes text sources for a language model; unset "
            "data.path and data.dataset (or unset data.mixture)"
        )
    paths = [path for path, _ in cfg.mixture]
    files = [_mixture_source(cfg, i, path) for i, path in enumerate(paths)]
    mix.check_tokenizers(paths, [tf.meta.get("tokenizer") for tf in files])
    parts = [
        _masks_fit(text_data(tf, cfg, needs.vocab_size, seed, needs.example_ids), needs)
        for tf in files
    ]
    if len({p.loss_mask for p in parts}) > 1:
        raise DataError(
            "data.mixture mixes token files with and without a loss mask "
            "(prepare-data --records); prepare every source the same way"
        )
    train, held_out = mix.mix_splits(
        cfg.mixture, [p.train for p in parts], [p.eval for p in parts], seed
    )
    return dataclasses.replace(
        parts[0],
        name=" + ".join(train.names),
        train=train,
        eval=held_out,
        vocab_size=max(tf.vocab_size for tf in files),
    )


def load_data(cfg: DataConfig, needs: DataNeeds, seed: int) -> Data:
    """The data ``cfg`` asks for, checked against what the model needs.

    Raises:
      DataError: a missing or unreadable file, a file of the wrong kind for the model, an
        empty corpus, a sequence longer than the text, a vocabulary larger than the model's
        or labels outside ``model.num_classes`` — each naming the file or key.
    """
    if cfg.mixture:
        return mixture_data(cfg, needs, seed)
    is_text = needs.kind == "text"
    vocab, classes = needs.vocab_size, needs.num_classes
    if is_text and cfg.pack == "documents" and not needs.documents:
        raise DataError(
            "data.pack=documents: this model does not keep attention within "
            "documents; set data.pack=concat"
        )
    path = Path(cfg.path) if cfg.path else None
    if cfg.dataset != "auto" and path is not None:
        raise DataError(
            f"data.path '{cfg.path}' and data.dataset={cfg.dataset} both name "
            "the data; set one of them"
        )
    if path is not None:
        _check_path(cfg, is_text)
    if cfg.dataset == "synthetic":
        if is_text:
            tf = synthetic_tokens(cfg.num_examples * cfg.seq_len + 1, vocab or 256)
            return text_data(tf, cfg, vocab, seed, needs.example_ids)
        images, labels = synthetic_images(
            cfg.num_examples, cfg.image_size, classes or 10, channels=cfg.channels
        )
        return image_data(images, labels, cfg, seed, "SYNTHETIC images")
    if cfg.dataset == "digits":
        if is_text:
            raise DataError("data.dataset=digits is an image set; a language model needs text")
        return image_data(*load_digits(classes), cfg, seed, "scikit-learn digits")
    if is_text:
        if path is not None and path.suffix == ".npz":
            raise DataError(f"data.path '{cfg.path}' is an image set; a language model needs text")
        tf = _text_file(cfg) if path else builtin_corpus()
        return _masks_fit(text_data(tf, cfg, vocab, seed, needs.example_ids), needs)
    if path is None:
        images, labels = synthetic_images(
            cfg.num_examples, cfg.image_size, classes or 10, channels=cfg.channels
        )
        return image_data(images, labels, cfg, seed, "SYNTHETIC images")
    if path.suffix != ".npz":
        raise DataError(
            f"data.path '{cfg.path}': classifiers read an .npz with images and "
            "labels (or set data.dataset=digits)"
        )
    return image_data(*load_npz(path, classes), cfg, seed, str(path))
