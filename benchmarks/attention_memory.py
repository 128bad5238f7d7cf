"""Attention memory: the train step's compiled temporaries, hand-written attention against
``jax.nn.dot_product_attention``, at long sequence lengths.

    python benchmarks/attention_memory.py [--seq 1024 2048] [--modes reference xla auto]
                                          [--config configs/gpt_tiny.yaml]
                                          [--set model.dtype=bfloat16 ...]

The model is ``--config`` (default ``configs/gpt_tiny.yaml``: 4 layers, d_model 128,
4 heads of 32) with
``model.max_seq_len`` and ``data.seq_len`` raised to each ``--seq``, a global batch of 8
rows under ``mesh.data=8`` (one row per device) and synthetic tokens. For each mode the
step is built with ``jaxpar.run.build`` and compiled with ``Trainer.compile_step`` (as
``jaxpar inspect`` does); the table gives ``memory_analysis().temp_size_in_bytes`` per
device. Modes:

* ``reference`` — the attention jaxpar had before ``model.attention``: softmax(Q·Kᵀ)
  written out (einsum, causal ``where``, float32 softmax, einsum). It lives only here:
  this script swaps it in for ``jaxpar.models.transformer.attention`` while the step is traced.
* ``xla``, ``cudnn``, ``auto`` — ``model.attention=…``. ``cudnn`` needs a GPU and
  bfloat16 compute (``--set model.dtype=bfloat16``); where it cannot run its row says why.

On the CPU ``xla`` computes what the reference computes (a [B, N, T, T] logits array per
layer): the temporaries match within a few percent, and grow with T². The saving is
cuDNN's on a GPU: no logits array at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import build, constrain, load_config
from jaxpar.models import transformer

BASE = [
    "mesh.data=8",
    "train.batch_size=8",
    "train.grad_accum=1",
    "data.dataset=synthetic",
    "data.num_examples=64",
]


def reference_attention(
    h_BTD: jax.Array,
    p: dict[str, jax.Array],
    use_rotary: bool,
    implementation: str = "xla",
    causal: bool = True,
    positions_T: np.ndarray | None = None,
) -> jax.Array:
    """jaxpar's causal attention before ``jax.nn.dot_product_attention``, for tokens in
    their natural order (``implementation`` is ignored)."""
    del implementation
    assert causal and (
        positions_T is None or np.array_equal(positions_T, np.arange(len(positions_T)))
    ), "the reference runs tokens in order"
    w_D3NH = jnp.stack([p["wq"], p["wk"], p["wv"]], axis=1)
    qkv = constrain(
        jnp.einsum("btd,dcnh->btcnh", h_BTD, w_D3NH), ("batch", "seq", None, "heads", "kv")
    )
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if use_rotary:
        q, k = transformer.rotary(q), transformer.rotary(k)
    T, H = q.shape[1], q.shape[-1]
    logits_BNTS = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) / jnp.sqrt(H)
    causal = jnp.tril(jnp.ones((T, T), bool))
    logits_BNTS = jnp.where(causal, logits_BNTS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BNTS, axis=-1).astype(v.dtype)
    o_BTNH = constrain(jnp.einsum("bnts,bsnh->btnh", probs, v), ("batch", "seq", "heads", "kv"))
    return jnp.einsum("btnh,nhd->btd", o_BTNH, p["wo"])


@contextlib.contextmanager
def attention_traced(mode: str):
    """While inside: ``jaxpar.models.transformer.attention`` is :func:`reference_attention` for
    ``mode == "reference"`` (the blocks look it up by name when they are traced), the
    model's own otherwise."""
    if mode != "reference":
        yield
        return
    saved = transformer.attention
    transformer.attention = reference_attention
    try:
        yield
    finally:
        transformer.attention = saved


def temp_bytes(config: str, seq: int, mode: str, extra: list[str]) -> tuple[int, float]:
    """(temporaries per device, compile seconds) of the train step."""
    attention = "xla" if mode == "reference" else mode
    overrides = [
        *BASE,
        f"model.max_seq_len={seq}",
        f"data.seq_len={seq}",
        f"model.attention={attention}",
        *extra,
    ]
    run = build(load_config([config], overrides))
    batch = run.data.batch(0, run.config.train.batch_size)
    start = time.perf_counter()
    with attention_traced(mode):
        compiled = run.trainer.compile_step(batch)
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["reference", "xla", "auto"],
        choices=["reference", "xla", "cudnn", "auto"],
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides, e.g. model.dtype=bfloat16",
    )
    args = parser.parse_args()
    print(
        f"backend {jax.default_backend()}, {jax.device_count()} devices; "
        f"{args.config} + {' '.join(args.set) or '(no overrides)'}"
    )
    print("| seq | " + " | ".join(f"{m} temp MiB" for m in args.modes) + " |")
    print("|---|" + "---|" * len(args.modes))
    for seq in args.seq:
        cells = []
        for mode in args.modes:
            try:
                nbytes, _ = temp_bytes(args.config, seq, mode, args.set)
                cells.append(f"{nbytes / 2**20:.2f}")
            except ValueError as err:
                cells.append(f"cannot run: {str(err).split(':')[0]}")
        print(f"| {seq} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
