"""Labelled images as arrays: an ``.npz`` of images and labels, scikit-learn's digits, or
SYNTHETIC template images; labels checked against the model's classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.errors import DataError


def synthetic_images(
    n: int, size: int, num_classes: int, seed: int = 1234, channels: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """SYNTHETIC labelled images: a fixed random template per class plus noise. A class's
    template comes from its own seed, drawn only where a label needs it (1,000 classes of
    224×224×3 templates would be 600 MB drawn for 64 images)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=n).astype(np.int32)
    noise = rng.normal(scale=2.0, size=(n, size, size, channels)).astype(np.float32)
    shape = (size, size, channels)
    templates = {
        c: np.random.default_rng([seed, c]).normal(size=shape).astype(np.float32)
        for c in np.unique(labels).tolist()
    }
    return np.stack([templates[c] for c in labels.tolist()]) + noise, labels


def _check_labels(labels: np.ndarray, num_classes: int | None, where: str) -> None:
    too_big = num_classes is not None and labels.max() >= num_classes
    if labels.min() < 0 or too_big:
        bound = "" if num_classes is None else f" with model.num_classes={num_classes}"
        fix = (
            f"; set model.num_classes ≥ {labels.max() + 1}" if too_big and labels.min() >= 0 else ""
        )
        raise DataError(
            f"{where}: labels span [{labels.min()}, {labels.max()}] but class "
            f"labels must be 0, 1, …{bound}{fix}"
        )


def load_npz(path: Path, num_classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels from an ``.npz`` with arrays ``images`` and ``labels``."""
    try:
        with np.load(path) as f:
            files = list(f.files)
            if {"images", "labels"} <= set(files):
                images, labels = f["images"].astype(np.float32), f["labels"].astype(np.int32)
    except Exception as err:
        raise DataError(
            f"data.path '{path}' is not a readable .npz file "
            f"({type(err).__name__}: {str(err).split('. ')[0]}); re-create it "
            "with numpy.savez(path, images=..., labels=...)"
        ) from err
    missing = {"images", "labels"} - set(files)
    if missing:
        raise DataError(f"data.path '{path}' lacks arrays {sorted(missing)}; it has {files}")
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or labels.ndim != 1 or len(images) != len(labels) or not len(labels):
        raise DataError(
            f"data.path '{path}': images {images.shape} and labels {labels.shape} "
            "must be (N,H,W[,C]) and (N,) with N > 0"
        )
    _check_labels(labels, num_classes, f"data.path '{path}'")
    return images, labels


def load_digits(num_classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits: 1,797 images 8×8×1 scaled to [0, 1], labels 0–9."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:
        raise DataError(
            "data.dataset=digits needs scikit-learn: pip install 'jaxpar[digits]'"
        ) from err
    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    _check_labels(labels, num_classes, "data.dataset=digits")
    return images, labels
