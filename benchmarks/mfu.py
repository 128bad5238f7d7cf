"""Model FLOP utilization (MFU) of jaxpar's step, side by side with a hand-written ``jax.jit`` step.

    python benchmarks/mfu.py [--models gpt2_small gpt_1b] [--batch N] [--seq T]
                             [--steps 10] [--rounds 3] [--peak-tflops X]

For each model (``gpt2_small`` = configs/gpt2_small.yaml, bfloat16 compute with float32
master weights; ``gpt_1b`` = the same with d_model 2048, 18 layers, 16 heads, d_ff 8192,
1.01 B parameters) on every device of the default backend (pure data parallelism,
``data`` = device count, ``grad_accum`` 1), two steps start from the same
``trainer.init()`` state: jaxpar's ``Trainer.step`` and the plain ``jax.jit`` step of
``benchmarks/step_overhead.py`` (value_and_grad, ``tx.update``, ``apply_updates``, same
shardings, donated state). Both must give the same loss on steps 1-3 (rtol 1e-5) before
anything is timed; then ``--rounds`` rounds alternate blocks of ``--steps`` steps of each.

Model FLOPs per token are the PaLM-paper count, 6·N + 12·L·T·d, where N = L·(4d² + 2·d·d_ff)
+ V·d is the weights of every matmul (the head included, position and token lookups not)
and 12·L·T·d the attention scores and weighted sums (forward and backward, the full T×T
product as XLA computes it under the causal mask). MFU = model FLOPs per step /
(seconds per step × peak FLOP/s per device × devices); remat's recomputation is not
counted (the compiled step's own FLOPs, which include it — every dot and convolution of the
optimized HLO, loop bodies times their trip counts, as the layout lab counts them — are
printed next to it as a ratio). The peak is the device's dense bfloat16 figure from the
table below (or
``--peak-tflops``).

On the CPU (no GPU) it runs one CPU device and a small shape by default (batch 8, seq 128,
gpt2_small only)
and prints achieved FLOP/s with a note instead of an MFU: there is no meaningful bf16 peak
for simulated CPU devices, and a 1 B model does not fit the point of a CPU run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# One CPU device when there is no accelerator: gpt2_small replicated on 8 simulated devices
# would need 8 copies of its state in this machine's memory.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling step_overhead module

import jax  # noqa: E402
from step_overhead import (  # noqa: E402  (sets up the simulated CPU devices first)
    check_same_losses,
    interleaved,
    jaxpar_stepper,
    make_plain_step,
    plain_stepper,
)

from jaxpar import build, load_config  # noqa: E402
from jaxpar.hlo import program_cost  # noqa: E402

# Dense bfloat16 peak TFLOP/s per device, by the start of ``jax.Device.device_kind``.
PEAK_BF16_TFLOPS = (
    ("NVIDIA H200", 989.4),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100", 989.4),
    ("NVIDIA A100", 312.0),
    ("NVIDIA L4", 121.0),
    ("TPU v5 lite", 197.0),
    ("TPU v4", 275.0),
)
MODELS = {
    "gpt2_small": [],
    "gpt_1b": ["model.d_model=2048", "model.n_layers=18", "model.n_heads=16", "model.d_ff=8192"],
}
CONFIG = "configs/gpt2_small.yaml"


def peak_tflops(device: jax.Device) -> float | None:
    """The table's dense bf16 peak of ``device``, None when it is not listed (the CPU)."""
    return next(
        (peak for kind, peak in PEAK_BF16_TFLOPS if device.device_kind.startswith(kind)), None
    )


def model_flops_per_token(model: object, seq_len: int) -> tuple[float, int]:
    """(6·N + 12·L·T·d, N) for a GPT config: N = the weights of every matmul."""
    d, layers, d_ff, vocab = model.d_model, model.n_layers, model.d_ff, model.vocab_size
    n = layers * (4 * d * d + 2 * d * d_ff) + vocab * d
    return 6 * n + 12 * layers * seq_len * d, n


def measure(name: str, batch: int, seq: int, steps: int, rounds: int) -> dict:
    """Seconds per step of jaxpar and the plain step, model and XLA FLOPs of one step."""
    devices = jax.device_count()
    overrides = [
        *MODELS[name],
        f"mesh.data={devices}",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "mesh.stage=1",
        "train.grad_accum=1",
        f"train.batch_size={batch}",
        f"data.seq_len={seq}",
        f"model.max_seq_len={max(seq, 1024)}",
    ]
    run = build(load_config([CONFIG], overrides))
    trainer = run.trainer
    host_batch = run.data.batch(0, batch)
    sharded = trainer.shard_batch(host_batch)
    state = trainer.init()
    plain_step = make_plain_step(run.plan)
    plain = plain_stepper(plain_step, state.params, state.opt_state, sharded)
    ours = jaxpar_stepper(trainer, state, sharded)
    check_same_losses(ours, plain)
    times = interleaved(ours, plain, steps, rounds)
    per_token, n = model_flops_per_token(run.config.model, seq)
    xla_flops = program_cost(trainer.compile_step(host_batch).as_text()).flops * devices
    return {
        "name": name,
        "params": n,
        "batch": batch,
        "seq": seq,
        "devices": devices,
        "model_flops": per_token * batch * seq,
        "xla_flops": xla_flops,
        **times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    on_cpu = jax.devices()[0].platform == "cpu"
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(MODELS),
        default=["gpt2_small"] if on_cpu else ["gpt2_small", "gpt_1b"],
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=8 if on_cpu else 0,
        help="global batch (default: 8 on the CPU; 32 gpt2_small, 16 gpt_1b per device on a GPU)",
    )
    parser.add_argument("--seq", type=int, default=128 if on_cpu else 1024)
    parser.add_argument(
        "--steps", type=int, default=3 if on_cpu else 10, help="steps per timed block"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="dense bf16 peak per device (default: from the device table)",
    )
    args = parser.parse_args()
    device = jax.devices()[0]
    peak = args.peak_tflops or peak_tflops(device)
    print(
        f"{jax.device_count()} × {device.device_kind} ({device.platform}), jax "
        f"{jax.__version__}; peak bf16 per device: "
        f"{f'{peak:g} TFLOP/s' if peak else 'not known'}"
    )
    if peak is None:
        print(
            "note: no GPU/TPU here: achieved FLOP/s are shown without an MFU; run this on "
            "a GPU machine for the figure (`--peak-tflops` to set a peak by hand)"
        )
    print(
        "\n| model | params (matmul) | devices | batch × seq | jaxpar s/step | plain s/step "
        "| ratio | model TFLOP/s (jaxpar / plain) | MFU (jaxpar / plain) "
        "| compiled FLOPs / model FLOPs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        batch = args.batch or jax.device_count() * (32 if name == "gpt2_small" else 16)
        r = measure(name, batch, args.seq, args.steps, args.rounds)
        rate = [r["model_flops"] / t / 1e12 for t in (r["t"], r["t_plain"])]
        mfu = (
            " / ".join(f"{x / (peak * r['devices']):.1%}" for x in rate)
            if peak
            else "n/a (no peak)"
        )
        print(
            f"| {name} | {r['params'] / 1e6:.0f} M | {r['devices']} | {r['batch']} × "
            f"{r['seq']} | {r['t']:.4f} | {r['t_plain']:.4f} "
            f"| {statistics.median(r['ratios']):.3f} | {rate[0]:.3g} / {rate[1]:.3g} "
            f"| {mfu} | {r['xla_flops'] / r['model_flops']:.2f} |"
        )


if __name__ == "__main__":
    main()
