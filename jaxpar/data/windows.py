"""Random-access sources of examples for the loader (:mod:`jaxpar.data.loader`): windows
of a token stream (with the segment ids of their packed documents) and labelled images.

Layouts: a window is ``tokens[T+1]`` (and ``segments[T+1]``, ``loss_mask[T+1]``); an
image example is
``images[H, W, C]``, ``labels[]``.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from jaxpar.errors import DataError


def _check_range(start: int, end: int | None, n: int, what: str) -> int:
    end = n if end is None else end
    if not 0 <= start <= end <= n:
        raise DataError(f"{what}: start={start}, end={end} must satisfy 0 <= start <= end <= {n}")
    return end


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens from a 1-D token array.

    Item ``i`` is ``{"tokens": int32[seq_len + 1]}`` (with ``with_index``, also
    ``"index": i``, a stable id of the example for per-example randomness) holding
    ``tokens[start + i*seq_len : start + (i+1)*seq_len + 1]``: consecutive windows
    share one boundary token (the last target of one is the first input of the
    next), and ``len = (end - start - 1) // seq_len``. Given the offsets where
    documents ``starts`` (packing, ``data.pack=documents``), an item also holds
    ``"segments": int32[seq_len + 1]``: :func:`window_segments`. Given a token file's
    loss ``mask`` (fine-tuning records), an item also holds ``"loss_mask":
    uint8[seq_len + 1]``, the mask of the same tokens: target ``t`` (token ``t`` of the
    window, ``t ≥ 1``) counts when ``loss_mask[t]`` is 1.

    ``tokens`` may be an ``np.memmap``; pass the whole map and choose the span
    with ``start``/``end`` — an unsliced memmap is pickled (for grain worker
    processes) as its file name, not its contents.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        start: int = 0,
        end: int | None = None,
        with_index: bool = False,
        starts: np.ndarray | None = None,
        mask: np.ndarray | None = None,
    ):
        if tokens.ndim != 1:
            raise DataError(f"tokens must be a 1-D array of token ids, got shape {tokens.shape}")
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be at least 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.start = start
        self.with_index = with_index
        self.mask = mask
        self.starts = None if starts is None else np.sort(np.asarray(starts, np.int64))
        self.end = _check_range(start, end, tokens.size, "TokenWindows")
        self._len = max(0, (self.end - start - 1) // seq_len)
        if self._len == 0:
            raise DataError(
                f"data.seq_len={seq_len} needs {seq_len + 1} tokens for one window but the span "
                f"[{start}, {self.end}) holds {self.end - start} tokens; lower data.seq_len or "
                "use more text"
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        lo = self.start + index * self.seq_len
        item = {"tokens": np.asarray(self.tokens[lo : lo + self.seq_len + 1], dtype=np.int32)}
        if self.with_index:
            item["index"] = np.int32(index)
        if self.starts is not None:
            item["segments"] = window_segments(self.starts, lo, self.seq_len + 1)
        if self.mask is not None:
            item["loss_mask"] = np.asarray(self.mask[lo : lo + self.seq_len + 1], np.uint8)
        return item

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("tokens", "mask"):
            t = state.get(key)
            # A fresh np.memmap has the mmap object itself as its base; a slice of one does
            # not, and its `offset` would be stale, so only the fresh map is pickled by
            # reference.
            if (
                isinstance(t, np.memmap)
                and t.filename is not None
                and isinstance(t.base, mmap.mmap)
            ):
                state[key] = ("memmap", t.filename, t.dtype.str, t.offset, t.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key in ("tokens", "mask"):
            t = state.get(key)
            if isinstance(t, tuple) and t[0] == "memmap":
                _, filename, dtype, offset, shape = t
                state[key] = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
        state.setdefault("mask", None)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"TokenWindows(seq_len={self.seq_len}, span=[{self.start}, {self.end}), "
            f"windows={self._len})"
        )


def window_segments(starts: np.ndarray, lo: int, n: int) -> np.ndarray:
    """Segment ids int32[n] of tokens ``lo … lo+n-1`` of a stream whose documents begin
    at the sorted offsets ``starts``: 0 for the document that holds token ``lo``, one
    more at each document that begins after it (ids within one window, not across)."""
    docs = np.searchsorted(starts, np.arange(lo, lo + n), side="right")
    return (docs - docs[0]).astype(np.int32)


def document_starts(documents: list[dict[str, Any]]) -> np.ndarray:
    """The offsets where a token file's documents begin (its metadata's ``documents``)."""
    return np.array([d["start"] for d in documents], np.int64)


class ArrayExamples:
    """Labelled images: item ``i`` is ``{"images": float32[H, W, C], "labels": int32}``.

    ``images`` is ``[N, H, W, C]`` (or ``[N, H, W]``, given one channel); items are
    ``images[start + i]`` for ``i < end - start``.
    """

    def __init__(
        self, images: np.ndarray, labels: np.ndarray, start: int = 0, end: int | None = None
    ):
        if images.ndim not in (3, 4) or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"images {images.shape} and labels {labels.shape} must be (N,H,W[,C]) and (N,)"
            )
        self.images = images
        self.labels = labels
        self.start = start
        self.end = _check_range(start, end, len(labels), "ArrayExamples")

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range for {len(self)} examples")
        image = np.asarray(self.images[self.start + index], dtype=np.float32)
        if image.ndim == 2:
            image = image[..., None]
        return {"images": image, "labels": np.int32(self.labels[self.start + index])}

    def __repr__(self) -> str:
        return f"ArrayExamples(span=[{self.start}, {self.end}), image={self.images.shape[1:]})"
