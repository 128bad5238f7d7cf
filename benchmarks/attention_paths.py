"""The Llama family's attention paths side by side on one device: XLA's and cuDNN's
``jax.nn.dot_product_attention``, with and without a sliding window.

    python benchmarks/attention_paths.py [--window 128] [--seq 1024]

A bfloat16 Llama (Mistral-like: sliding window, grouped-query heads, head dim 128) gives
logits through ``model.attention=xla`` and ``model.attention=cudnn``; the script prints
their largest difference relative to the logits' scale and the forward time of each
(median of 10). cuDNN needs a GPU: on the CPU it prints the XLA row only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxpar import build, load_config, logits


def logits_and_time(overrides: list[str], tokens: jax.Array) -> tuple[np.ndarray, float]:
    """The logits of a one-device Llama built from ``overrides``, and its forward time."""
    run = build(
        load_config(
            [],
            [
                "model.name=llama",
                "run.devices=1",
                "mesh.data=1",
                "data.dataset=synthetic",
                *overrides,
            ],
        )
    )
    state = run.trainer.init()
    out = logits(run, tokens, state)
    times = []
    for _ in range(10):  # each call includes the host copy of the logits
        start = time.perf_counter()
        logits(run, tokens, state)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| window | attention | forward ms | max |Δ| / max |logits| vs xla |")
    print("|---|---|---|---|")
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 32000)
    for window in (0, args.window):
        cfg = [
            "model.vocab_size=32000",
            "model.d_model=1024",
            "model.n_layers=4",
            "model.n_heads=8",
            "model.n_kv_heads=2",
            "model.d_ff=2816",
            f"model.max_seq_len={args.seq}",
            f"data.seq_len={args.seq}",
            "model.dtype=bfloat16",
            f"model.sliding_window={window}",
        ]
        reference, t_xla = logits_and_time([*cfg, "model.attention=xla"], tokens)
        print(f"| {window} | xla | {t_xla * 1e3:.2f} | 0 |")
        if on_gpu:
            out, t = logits_and_time([*cfg, "model.attention=cudnn"], tokens)
            err = np.abs(out - reference).max() / np.abs(reference).max()
            print(f"| {window} | cudnn | {t * 1e3:.2f} | {err:.2e} |")


if __name__ == "__main__":
    main()
