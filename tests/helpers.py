"""Shared test helpers: run a few steps of a config on a given number of devices; decode
the PNGs jaxpar writes."""

from __future__ import annotations

import struct
import zlib

import jax
import numpy as np

from jaxpar.config import load_config
from jaxpar.run import build

GPT_SMALL = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "train.batch_size=16", "optim.warmup_steps=0",
]
CONVNET_SMALL = ["model.name=convnet", "model.channels=4", "model.hidden=8",
                 "data.image_size=8", "data.num_examples=256", "train.batch_size=16",
                 "optim.warmup_steps=0"]


def run_steps(overrides: list[str], steps: int = 3, devices: int = 8):
    """Losses of each step and the final params (as numpy) for a config."""
    cfg = load_config([], [*overrides, f"train.steps={steps}", f"run.devices={devices}"])
    run = build(cfg)
    state = run.trainer.init()
    run.init_params = jax.tree.map(np.asarray, state.params)
    losses = []
    for step in range(steps):
        batch = run.trainer.shard_batch(run.data.batch(step, cfg.train.batch_size))
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), run


def assert_params_close(actual, expected, elementwise: bool = True, rtol: float = 1e-5):
    """Parameters agree to f32 summation-order noise.

    ``elementwise``: every element within rtol 1e-5 (atol 1e-6) — right for
    SGD, whose update is linear in the gradient. For Adam-family optimizers
    use the per-tensor relative error ||a − b|| / ||b|| ≤ rtol: Adam divides
    each gradient element by its own magnitude, so an element whose gradient
    is ~0 turns a 1e-7 summation difference into a much larger update
    difference while the tensor as a whole still agrees closely.
    """
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        name = jax.tree_util.keystr(path)
        if elementwise:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-6, err_msg=name)
        else:
            rel = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
            assert rel <= rtol, f"{name}: relative error {rel:.2e} > {rtol:.0e}"


# ---- a tiny PNG decoder (RGB8, filter type 0 only) -------------------------------------------


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks.append((tag, body))
        pos += 12 + n
    assert pos == len(data)
    return chunks


def decode_png(data: bytes) -> np.ndarray:
    """An RGB8 PNG (filter type 0 rows, as jaxpar.png writes) → [H, W, 3] uint8."""
    chunks = _png_chunks(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any()  # encode_png writes filter type 0 (None) on every row
    return rows[:, 1:].reshape(height, width, 3)
