"""Training data: byte-level text windows and labelled images, deterministic per step.

Every batch is a pure function of (seed, split, step), so runs are
reproducible and a process can compute exactly its own rows. The built-in
text is the ``pydoc_data.topics`` module that ships with Python (≈466 kB of
English technical prose); the built-in images are synthetic and labelled as
such.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import DataConfig


def builtin_text() -> bytes:
    """The Python reference topics shipped in ``pydoc_data.topics``, as UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def _split(n: int, eval_fraction: float, what: str) -> int:
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={eval_fraction} must be in (0, 1)")
    cut = int(n * (1.0 - eval_fraction))
    if cut == 0 or cut == n:
        raise ValueError(f"{what} of {n} items is too small to split with eval_fraction={eval_fraction}")
    return cut


def _process_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's contiguous share of a global host batch."""
    count, index = jax.process_count(), jax.process_index()
    return {k: np.array_split(v, count)[index] for k, v in batch.items()}


@dataclass
class TextData:
    """Byte tokens (vocab 256) and fixed-length windows of ``seq_len + 1`` tokens."""

    VOCAB = 256

    tokens: np.ndarray
    seq_len: int
    seed: int
    eval_fraction: float
    name: str

    def __post_init__(self):
        if self.tokens.size == 0:
            raise ValueError(f"text data '{self.name}' is empty")
        self.cut = _split(self.tokens.size, self.eval_fraction, f"text '{self.name}'")
        shortest = min(self.cut, self.tokens.size - self.cut)
        if self.seq_len + 1 > shortest:
            raise ValueError(
                f"data.seq_len={self.seq_len} is longer than the {shortest}-token split of "
                f"'{self.name}'; lower data.seq_len or use more text"
            )

    def batch(self, step: int, batch_size: int, split: str = "train") -> dict[str, np.ndarray]:
        """Windows for ``step`` (this process's rows): {'tokens': int32 [B, T+1]}."""
        lo, hi = (0, self.cut) if split == "train" else (self.cut, self.tokens.size)
        rng = np.random.default_rng((self.seed, step, split == "eval"))
        starts = rng.integers(lo, hi - self.seq_len, size=batch_size)  # window [s, s+T] ⊂ [lo, hi)
        windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]
        return _process_rows({"tokens": windows.astype(np.int32)})


@dataclass
class ImageData:
    """Images [N, H, W, C] float32 and integer labels [N]."""

    images: np.ndarray
    labels: np.ndarray
    seed: int
    eval_fraction: float
    name: str

    def __post_init__(self):
        self.cut = _split(len(self.labels), self.eval_fraction, f"image set '{self.name}'")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def batch(self, step: int, batch_size: int, split: str = "train") -> dict[str, np.ndarray]:
        """Random examples for ``step`` (this process's rows)."""
        lo, hi = (0, self.cut) if split == "train" else (self.cut, len(self.labels))
        rng = np.random.default_rng((self.seed, step, split == "eval"))
        idx = rng.integers(lo, hi, size=batch_size)
        return _process_rows({"images": self.images[idx], "labels": self.labels[idx]})


def synthetic_images(n: int, size: int, num_classes: int, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """SYNTHETIC labelled images: a fixed random template per class plus noise."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(size=(num_classes, size, size, 1)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=n).astype(np.int32)
    noise = rng.normal(scale=2.0, size=(n, size, size, 1)).astype(np.float32)
    return templates[labels] + noise, labels


def load_npz(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels from an ``.npz`` with arrays ``images`` and ``labels``."""
    with np.load(path) as f:
        missing = {"images", "labels"} - set(f.files)
        if missing:
            raise ValueError(f"data.path '{path}' lacks arrays {sorted(missing)}; it has {f.files}")
        images, labels = f["images"].astype(np.float32), f["labels"].astype(np.int32)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or labels.ndim != 1 or len(images) != len(labels) or not len(labels):
        raise ValueError(f"data.path '{path}': images {images.shape} and labels {labels.shape} "
                         "must be (N,H,W[,C]) and (N,) with N > 0")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"data.path '{path}': labels span [{labels.min()}, {labels.max()}] but "
                         f"model.num_classes={num_classes}")
    return images, labels


def load_data(cfg: DataConfig, model_name: str, num_classes: int, seed: int) -> TextData | ImageData:
    """The data a config asks for (built-in when ``cfg.path`` is empty).

    Raises:
      ValueError: for a missing file or an unsupported file type, naming the path.
    """
    path = Path(cfg.path) if cfg.path else None
    if path is not None and not path.is_file():
        raise ValueError(f"data.path '{cfg.path}' does not exist or is not a file")
    if model_name == "gpt":
        if path is not None and path.suffix == ".npz":
            raise ValueError(f"data.path '{cfg.path}' is an image set; model.name=gpt needs text")
        raw = path.read_bytes() if path else builtin_text()
        name = str(path) if path else "pydoc_data.topics"
        return TextData(np.frombuffer(raw, np.uint8), cfg.seq_len, seed, cfg.eval_fraction, name)
    if path is None:
        images, labels = synthetic_images(cfg.num_examples, cfg.image_size, num_classes)
        return ImageData(images, labels, seed, cfg.eval_fraction, "synthetic images")
    if path.suffix != ".npz":
        raise ValueError(f"data.path '{cfg.path}': classifiers read an .npz with images and labels")
    images, labels = load_npz(path, num_classes)
    return ImageData(images, labels, seed, cfg.eval_fraction, str(path))
