"""Data: deterministic text windows and image batches, and clear errors for bad inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpar.config import DataConfig
from jaxpar.data import ImageData, TextData, builtin_text, load_data, synthetic_images


def _cfg(**kw) -> DataConfig:
    return dataclasses.replace(DataConfig(), **kw)


@pytest.fixture(scope="module")
def gpt_data() -> TextData:
    return load_data(DataConfig(), "gpt", 10, seed=0)


# ---------------------------------------------------------------- text


def test_text_batches_are_deterministic(gpt_data):
    a = gpt_data.batch(3, 8)["tokens"]
    b = load_data(DataConfig(), "gpt", 10, seed=0).batch(3, 8)["tokens"]
    assert a.shape == (8, DataConfig().seq_len + 1)
    assert a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, gpt_data.batch(3, 8)["tokens"])


def test_text_batches_differ_by_seed_step_and_split(gpt_data):
    a = gpt_data.batch(3, 8)["tokens"]
    other_seed = load_data(DataConfig(), "gpt", 10, seed=1).batch(3, 8)["tokens"]
    assert not np.array_equal(a, other_seed)
    assert not np.array_equal(a, gpt_data.batch(4, 8)["tokens"])
    assert not np.array_equal(a, gpt_data.batch(3, 8, "eval")["tokens"])


def test_windows_are_contiguous_slices_of_the_text(gpt_data):
    text = builtin_text()
    assert len(text) > 100_000
    assert gpt_data.tokens.size == len(text)
    cut = gpt_data.cut
    assert 0 < cut < len(text)
    for split, (lo, hi) in (("train", (0, cut)), ("eval", (cut, len(text)))):
        windows = gpt_data.batch(5, 4, split)["tokens"]
        for row in windows:
            assert row.min() >= 0 and row.max() < 256
            chunk = bytes(row.astype(np.uint8).tolist())
            # the window occurs, whole, inside its own split of the source text
            assert text.find(chunk, lo, hi) >= 0, f"{split} window not found in its split"


def test_train_and_eval_ranges_are_disjoint():
    # tokens equal to their position reveal where every window starts and ends
    n, seq_len = 1000, 16
    data = TextData(np.arange(n), seq_len, seed=0, eval_fraction=0.25, name="positions")
    cut = data.cut
    assert cut == 750
    train = np.concatenate([data.batch(s, 64)["tokens"] for s in range(20)])
    evals = np.concatenate([data.batch(s, 64, "eval")["tokens"] for s in range(20)])
    for windows in (train, evals):  # every window is a run of consecutive positions
        np.testing.assert_array_equal(np.diff(windows, axis=1), 1)
    assert train[:, -1].max() < cut  # whole train windows lie before the cut
    assert evals[:, 0].min() >= cut  # all eval windows start at or after it
    assert evals[:, -1].max() < n
    # the whole of each split is reachable, including its last token
    assert train[:, 0].min() == 0 and train[:, -1].max() == cut - 1
    assert evals[:, 0].min() == cut and evals[:, -1].max() == n - 1


def test_seq_len_equal_to_split_works():
    # seq_len + 1 tokens per window: a split of exactly that size has one window
    data = TextData(np.arange(18), seq_len=8, seed=0, eval_fraction=0.5, name="tiny")
    np.testing.assert_array_equal(data.batch(0, 2)["tokens"], np.tile(np.arange(9), (2, 1)))
    np.testing.assert_array_equal(data.batch(0, 2, "eval")["tokens"], np.tile(np.arange(9, 18), (2, 1)))


def test_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    text = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
    path.write_bytes(text)
    data = load_data(_cfg(path=str(path), seq_len=16), "gpt", 10, seed=0)
    assert isinstance(data, TextData)
    assert str(path) in data.name
    for row in data.batch(0, 4)["tokens"]:
        assert bytes(row.astype(np.uint8).tolist()) in text


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    missing = tmp_path / "missing.txt"
    for model in ("gpt", "convnet"):
        with pytest.raises(ValueError) as err:
            load_data(_cfg(path=str(missing)), model, 10, seed=0)
        assert str(missing) in str(err.value) and "data.path" in str(err.value)


def test_empty_text_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="empty") as err:
        load_data(_cfg(path=str(path)), "gpt", 10, seed=0)
    assert str(path) in str(err.value)


def test_seq_len_longer_than_split(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"x" * 200)  # 180 train / 20 eval tokens
    with pytest.raises(ValueError) as err:
        load_data(_cfg(path=str(path), seq_len=32), "gpt", 10, seed=0)
    msg = str(err.value)
    assert "data.seq_len" in msg and str(path) in msg
    # a window that fits the smaller split is fine
    data = load_data(_cfg(path=str(path), seq_len=16), "gpt", 10, seed=0)
    assert data.batch(0, 2, "eval")["tokens"].shape == (2, 17)


def test_npz_without_labels(tmp_path):
    path = tmp_path / "nolabels.npz"
    np.savez(path, images=np.zeros((8, 4, 4, 1), np.float32))
    with pytest.raises(ValueError) as err:
        load_data(_cfg(path=str(path)), "convnet", 10, seed=0)
    assert "labels" in str(err.value) and str(path) in str(err.value)


def test_npz_label_out_of_range(tmp_path):
    path = tmp_path / "labels.npz"
    labels = np.arange(20) % 4
    labels[7] = 10
    np.savez(path, images=np.zeros((20, 4, 4, 1), np.float32), labels=labels)
    with pytest.raises(ValueError) as err:
        load_data(_cfg(path=str(path)), "convnet", 10, seed=0)
    assert "model.num_classes" in str(err.value) and str(path) in str(err.value)
    labels[7] = -1
    np.savez(path, images=np.zeros((20, 4, 4, 1), np.float32), labels=labels)
    with pytest.raises(ValueError, match="model.num_classes"):
        load_data(_cfg(path=str(path)), "convnet", 10, seed=0)


@pytest.mark.parametrize("images, labels", [
    (np.zeros((20, 4), np.float32), np.zeros(20, np.int64)),  # no H, W
    (np.zeros((20, 4, 4, 1), np.float32), np.zeros(19, np.int64)),  # count mismatch
    (np.zeros((20, 4, 4, 1), np.float32), np.zeros((20, 1), np.int64)),  # labels not (N,)
    (np.zeros((0, 4, 4, 1), np.float32), np.zeros(0, np.int64)),  # no examples
])
def test_npz_bad_shapes(tmp_path, images, labels):
    path = tmp_path / "bad.npz"
    np.savez(path, images=images, labels=labels)
    with pytest.raises(ValueError) as err:
        load_data(_cfg(path=str(path)), "mlp", 10, seed=0)
    assert str(path) in str(err.value)


def test_gpt_rejects_npz(tmp_path):
    path = tmp_path / "images.npz"
    np.savez(path, images=np.zeros((20, 4, 4), np.float32), labels=np.zeros(20, np.int64))
    with pytest.raises(ValueError) as err:
        load_data(_cfg(path=str(path)), "gpt", 10, seed=0)
    assert str(path) in str(err.value) and "gpt" in str(err.value)


@pytest.mark.parametrize("model", ["convnet", "mlp"])
def test_classifier_rejects_text(tmp_path, model):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world " * 100)
    with pytest.raises(ValueError) as err:
        load_data(_cfg(path=str(path)), model, 10, seed=0)
    assert str(path) in str(err.value) and ".npz" in str(err.value)


@pytest.mark.parametrize("model", ["gpt", "convnet"])
@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_bad_eval_fraction(model, fraction):
    with pytest.raises(ValueError, match="data.eval_fraction"):
        load_data(_cfg(eval_fraction=fraction, num_examples=64), model, 10, seed=0)


# ---------------------------------------------------------------- images


def test_synthetic_images_shape_and_labels():
    cfg = _cfg(image_size=6, num_examples=300)
    data = load_data(cfg, "convnet", 7, seed=0)
    assert isinstance(data, ImageData)
    assert data.images.shape == (300, 6, 6, 1) and data.images.dtype == np.float32
    assert data.image_shape == (6, 6, 1)
    assert data.labels.shape == (300,)
    assert data.labels.min() >= 0 and data.labels.max() < 7
    assert len(np.unique(data.labels)) == 7  # 300 draws cover all 7 classes
    batch = data.batch(0, 16)
    assert batch["images"].shape == (16, 6, 6, 1)
    assert batch["labels"].shape == (16,)
    assert 0 < data.cut < 300


def test_synthetic_images_are_learnable():
    # same-class images are closer to each other than to other classes (template + noise)
    images, labels = synthetic_images(400, 8, 4, seed=0)
    flat = images.reshape(len(images), -1)
    means = np.stack([flat[labels == c].mean(0) for c in range(4)])
    nearest = np.argmin(((flat[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (nearest == labels).mean() > 0.9


def test_npz_adds_channel_dim(tmp_path):
    path = tmp_path / "gray.npz"
    rng = np.random.default_rng(0)
    images = rng.normal(size=(40, 5, 5)).astype(np.float32)
    labels = rng.integers(0, 3, size=40)
    np.savez(path, images=images, labels=labels)
    data = load_data(_cfg(path=str(path)), "mlp", 3, seed=0)
    assert data.images.shape == (40, 5, 5, 1)
    assert data.image_shape == (5, 5, 1)
    np.testing.assert_array_equal(data.images[..., 0], images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.labels.dtype == np.int32


def test_npz_keeps_channels(tmp_path):
    path = tmp_path / "rgb.npz"
    np.savez(path, images=np.ones((30, 4, 4, 3), np.uint8), labels=np.zeros(30, np.int64))
    data = load_data(_cfg(path=str(path)), "convnet", 2, seed=0)
    assert data.image_shape == (4, 4, 3) and data.images.dtype == np.float32


def test_image_batches_are_deterministic():
    cfg = _cfg(num_examples=512)
    a = load_data(cfg, "convnet", 10, seed=0)
    b = load_data(cfg, "convnet", 10, seed=0)
    for step in (0, 5):
        for split in ("train", "eval"):
            x, y = a.batch(step, 16, split), b.batch(step, 16, split)
            np.testing.assert_array_equal(x["images"], y["images"])
            np.testing.assert_array_equal(x["labels"], y["labels"])
    assert not np.array_equal(a.batch(0, 16)["images"], a.batch(1, 16)["images"])
    other = load_data(cfg, "convnet", 10, seed=1)
    assert not np.array_equal(a.batch(0, 16)["images"], other.batch(0, 16)["images"])


def test_image_train_eval_disjoint():
    # images equal to their index reveal which examples each split draws
    n = 100
    images = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None, None, None], (n, 2, 2, 1))
    data = ImageData(np.array(images), np.zeros(n, np.int32), seed=0, eval_fraction=0.2, name="idx")
    train = np.concatenate([data.batch(s, 32)["images"][:, 0, 0, 0] for s in range(10)])
    evals = np.concatenate([data.batch(s, 32, "eval")["images"][:, 0, 0, 0] for s in range(10)])
    assert data.cut == 80
    assert train.max() < 80 and train.min() >= 0
    assert evals.min() >= 80 and evals.max() < n
