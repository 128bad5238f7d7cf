"""Sequence parallelism (``tensor.sequence``): a layer's activation memory and the step's
collectives, with and without it, from the compiled programs.

    python benchmarks/sequence_parallel.py [--tensor 2 4] [--seq 64] [--width 64]

Memory: a GPT of ``--width`` (4 heads, MLP 4× wide) on ``--seq`` tokens, 8 rows, under
``mesh.tensor=t`` (``t`` devices); a layer's activations are the compiled gradient's
temporary bytes with 4 layers less those with 2, halved. The formula is the one
``tests/test_sequence_parallel.py`` derives, Korthikanti et al. (2022)'s count for this
block: 4·sbh·(8 + 28/t) + 8·as²b/t bytes without sequence parallelism, 4·sbh·36/t +
8·as²b/t with it (JAX 0.12 keeps one [s, b, 4h] of the MLP fewer: 24/t and 32/t).

Collectives: ``configs/gpt_tiny.yaml`` under ``data=4,tensor=2``, compiled as ``jaxpar
sweep`` does; wire bytes per device by kind, and the lab's prediction for a GPU, where the
reductions are reduce-scatters (XLA:CPU compiles each as an all-reduce and a slice).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

from jaxpar import build, load_config
from jaxpar.config import apply_overrides
from jaxpar.lab import hardware, predict, sweep

SP = "tensor.sequence=true"
ROWS, HEADS = 8, 4


def layer_bytes(t: int, sequence: bool, seq: int, width: int) -> float:
    """A layer's compiled activation bytes (4 layers less 2, halved)."""
    temps = []
    for layers in (2, 4):
        overrides = [
            f"model.d_model={width}",
            f"model.n_heads={HEADS}",
            f"model.d_ff={4 * width}",
            f"model.n_layers={layers}",
            f"model.max_seq_len={seq}",
            f"data.seq_len={seq}",
            f"train.batch_size={ROWS}",
            "model.vocab_size=256",
            "mesh.data=1",
            f"mesh.tensor={t}",
            f"run.devices={t}",
            *([SP] if sequence else []),
        ]
        run = build(load_config([], overrides))
        state = run.trainer.init()
        batch = run.trainer.shard_batch(run.data.batch(0, ROWS))
        grad = jax.jit(jax.grad(lambda p, b, loss=run.trainer.loss: loss(p, b)[0]))
        memory = grad.lower(state.params, batch).compile().memory_analysis()
        temps.append(memory.temp_size_in_bytes)
    return (temps[1] - temps[0]) / 2


#: the MLP's [s, b, 4h] arrays XLA keeps (5 on JAX 0.12, 6 before)
MLP_KEPT = 5 if tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12) else 6


def formula(t: int, sequence: bool, seq: int, width: int) -> float:
    sbh = seq * ROWS * width
    split = (4 + 4 * MLP_KEPT) * sbh + 2 * HEADS * seq * seq * ROWS
    return 4 * (8 * sbh + split) / t if sequence else 4 * (8 * sbh + split / t)


def memory_table(tensor: list[int], seq: int, width: int) -> None:
    print(f"a layer's activations, s={seq} b={ROWS} h={width} a={HEADS} (KiB per device)")
    print("| tensor | sequence parallel | compiled | formula | ratio |")
    print("|---|---|---|---|---|")
    for t in tensor:
        for sequence in (False, True):
            got, want = layer_bytes(t, sequence, seq, width), formula(t, sequence, seq, width)
            print(
                f"| {t} | {'yes' if sequence else 'no'} | {got / 1024:,.0f} | "
                f"{want / 1024:,.0f} | {got / want:.3f} |"
            )


def collectives_table() -> None:
    config = load_config(["configs/gpt_tiny.yaml"], [])
    h100 = hardware.get_profile("h100")
    print("\ngpt_tiny, data=4,tensor=2: wire bytes per device per step (MiB)")
    print("| layout | all-reduce | all-gather | GPU prediction: all-reduce | reduce-scatter |")
    print("|---|---|---|---|---|")
    for layout in ("data=4,tensor=2", f"data=4,tensor=2,{SP}"):
        row = sweep.measure(config, layout, h100)
        run = build(apply_overrides(config, sweep.layout_overrides(layout)))
        gpu = predict.predict_comm(run, "gpu").by_kind()
        mib = 2.0**20
        print(
            f"| {layout} | {row.all_reduce_bytes / mib:.2f} | {row.all_gather_bytes / mib:.2f} "
            f"| {gpu.get('all-reduce', 0) / mib:.2f} | {gpu.get('reduce-scatter', 0) / mib:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    memory_table(args.tensor, args.seq, args.width)
    collectives_table()


if __name__ == "__main__":
    main()
