"""Train-step overhead: jaxpar's step against a plain hand-written ``jax.jit`` step.

    python benchmarks/step_overhead.py [--layouts data=8 fsdp=8 data=2,fsdp=2,tensor=2]
                                       [--steps 5] [--rounds 20]
                                       [--config configs/gpt_tiny.yaml] [--breakdown]

For each layout (by default ``data=8``, ``fsdp=8`` and ``data=2,fsdp=2,tensor=2``) of
``--config`` on 8 simulated CPU devices, two steps of the same model, mesh and
shardings start from the same ``trainer.init()`` state:

* jaxpar: ``Trainer.step`` (``TrainState``, grad norm, the non-finite guard as
  ``train.nonfinite_guard=auto`` picks it — ``cond`` on the CPU — lr);
* plain: ``jax.jit`` of value_and_grad of the task loss (traced under the same
  activation rules as ``Trainer.loss``), ``tx.update``, ``optax.apply_updates``,
  with the plan's param/opt shardings as in/out shardings, params and
  optimizer state donated, returning the loss only.

Both must give the same loss on steps 1-3 (rtol 1e-5; step 1 runs at lr 0 under
the warm-up, so step 3 is the first loss after a real update) before anything
is timed. Then, on one pre-sharded batch, ``--rounds`` rounds alternate a block
of ``--steps`` steps of each (the order flips every round; each block ends with
``block_until_ready``). A row gives the median per-step wall time of each over
the rounds and the ratio jaxpar/plain: the median of the per-round ratios, their
range in brackets. The CPU-time ratio is the same from this process's CPU time
per step, which other work on a shared machine disturbs much less.

Host time per step outside the compiled program: the CPU time of the calling
thread until the step call returns (asynchronous dispatch, the device idle
before each call; mean of 20 calls), and the mean time of
``trainer.shard_batch`` of one host batch until the global arrays are ready.
The call's *wall* time (printed under the table) is much longer on a 2-core
machine: once the program is launched, XLA's compute threads take the cores
and the returning Python thread waits its turn.

``--breakdown`` adds rows for the plain step plus each of jaxpar's extras in
turn, timed interleaved with the plain step: the grad norm as an output; grad
norm + each of ``jaxpar/guard.py``'s non-finite guards (``where``: a
``jnp.where`` over params and optimizer state; ``cond``: the update again
inside a ``lax.cond``), checking the loss, the grad norm and the new
parameters as ``Trainer`` does. Next to the timings, XLA's own cost analysis
of each compiled program (flops, bytes accessed, per device) relative to the
plain step's: deterministic, so it shows small costs that timing noise hides.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from jaxpar import setup_devices

setup_devices()  # 8 simulated CPU devices, before JAX starts its backend

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar import Plan, build, guard, load_config
from jaxpar.axes import MESH_AXES
from jaxpar.logical import activation_rules
from jaxpar.run import Run

DISPATCH_CALLS = 20


def layout_overrides(layout: str) -> list[str]:
    """``"data=2,fsdp=2,tensor=2"`` → mesh overrides, every axis not named set to 1."""
    named = dict(item.split("=") for item in layout.split(","))
    return [f"mesh.{axis}={named.get(axis, 1)}" for axis in MESH_AXES]


def make_plain_step(
    plan: Plan, *, grad_norm: bool = False, keep: guard.Keep | None = None
) -> Callable[..., Any]:
    """The hand-written step ``(params, opt_state, batch) → (params, opt_state, out)``.

    ``out`` is the loss; with ``grad_norm`` or a guard ``keep`` also the global grad
    norm. ``keep`` (``guard.keep_where`` or ``guard.keep_cond``) keeps the update only
    when the loss, the grad norm and the new parameters are finite, as ``Trainer`` does.
    """
    task, graphdef, mesh, rules, tx = (
        plan.task,
        plan.model.graphdef,
        plan.mesh,
        plan.rules,
        plan.optimizer,
    )

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        with activation_rules(mesh, rules):  # the activation layout is part of the model's
            return task.loss_fn(nnx.merge(graphdef, params), batch)[0]

    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        updates, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        new_params, new_opt = update(params, opt_state, grads)
        if not (grad_norm or keep):
            return new_params, new_opt, loss
        norm = optax.tree.norm(grads)
        if keep is not None:
            finite = jnp.isfinite(loss) & jnp.isfinite(norm) & guard.all_finite(new_params)
            new_params, new_opt = keep(
                finite,
                (new_params, new_opt),
                lambda: update(params, opt_state, grads),
                (params, opt_state),
            )
        return new_params, new_opt, (loss, norm)

    sh = plan.state_shardings
    return jax.jit(
        step,
        in_shardings=(sh.params, sh.opt_state, None),
        out_shardings=(sh.params, sh.opt_state, None),
        donate_argnums=(0, 1),
    )


class Stepper:
    """One step implementation on a fixed batch, carrying its own (donated) state."""

    def __init__(self, step: Callable[[Any, Any], tuple[Any, Any]], carry: Any, batch: Any):
        self.step, self.carry, self.batch = step, carry, batch

    def __call__(self) -> Any:
        self.carry, out = self.step(self.carry, self.batch)
        return out

    def block(self, k: int) -> tuple[float, float]:
        """Wall and process-CPU seconds per step over ``k`` steps dispatched back to back,
        then waited for."""
        start_cpu, start = time.process_time(), time.perf_counter()
        for _ in range(k):
            out = self()
        jax.block_until_ready((self.carry, out))
        return (time.perf_counter() - start) / k, (time.process_time() - start_cpu) / k

    def dispatch(self, calls: int) -> tuple[float, float]:
        """Host cost of a step call, the device idle before each call: the calling thread's
        mean CPU seconds until the call returns, and the median wall seconds of the call.

        The wall time is mostly not the host's work: once the program is launched, XLA's
        compute threads take the (few) cores and the returning Python thread waits its turn.
        """
        cpu, wall = [], []
        for _ in range(calls):
            jax.block_until_ready(self.carry)
            start_cpu, start = time.thread_time(), time.perf_counter()
            out = self()
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        jax.block_until_ready((self.carry, out))
        return statistics.mean(cpu), statistics.median(wall)


def copy_tree(tree: Any) -> Any:
    """Fresh device buffers with the same shardings (the steps donate their inputs)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def jaxpar_stepper(trainer: Any, state: Any, batch: Any) -> Stepper:
    return Stepper(lambda s, b: trainer.step(s, b), state, batch)


def plain_stepper(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any) -> Stepper:
    """A plain step carrying copies of ``params`` and ``opt_state``."""

    def call(carry: tuple, b: Any) -> tuple:
        params, opt_state, out = step(*carry, b)
        return (params, opt_state), out

    return Stepper(call, (copy_tree(params), copy_tree(opt_state)), batch)


def first_loss(out: Any) -> float:
    loss = out["loss"] if isinstance(out, dict) else (out[0] if isinstance(out, tuple) else out)
    return float(loss)


def check_same_losses(a: Stepper, b: Stepper, steps: int = 3) -> list[float]:
    """Both implementations give the same loss on the first ``steps`` steps."""
    losses = []
    for i in range(steps):
        la, lb = first_loss(a()), first_loss(b())
        np.testing.assert_allclose(la, lb, rtol=1e-5, err_msg=f"loss differs at step {i + 1}")
        losses.append(la)
    return losses


def interleaved(a: Stepper, b: Stepper, steps: int, rounds: int) -> dict[str, Any]:
    """Seconds per step of ``a`` and ``b`` over alternating blocks of ``steps`` steps.

    Each round times one block of each, back to back (a, b then b, a), so a slow spell
    of a shared machine hits both; ``ratios`` are the per-round a/b of wall time,
    ``cpu_ratios`` of this process's CPU time.
    """
    for s in (a, b):  # warm-up: compiled already; settles caches and thread pools
        s.block(3)
    times: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            times[i].append((a, b)[i].block(steps))
    return {
        "t": statistics.median(t for t, _ in times[0]),
        "t_plain": statistics.median(t for t, _ in times[1]),
        "ratios": [x[0] / y[0] for x, y in zip(times[0], times[1], strict=True)],
        "cpu_ratios": [x[1] / y[1] for x, y in zip(times[0], times[1], strict=True)],
    }


def shard_batch_time(run: Run, calls: int) -> float:
    """Mean seconds of ``trainer.shard_batch`` of one host batch, until the arrays are ready."""
    hosts = [run.data.batch(i, run.config.train.batch_size) for i in range(calls)]
    jax.block_until_ready(run.trainer.shard_batch(hosts[0]))
    times = []
    for host in hosts:
        start = time.perf_counter()
        jax.block_until_ready(run.trainer.shard_batch(host))
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def xla_cost(compiled: jax.stages.Compiled) -> tuple[float, float]:
    """XLA's flops and bytes accessed of a compiled program (per device)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], cost["bytes accessed"]


BREAKDOWN = (
    ("plain + grad norm", {"grad_norm": True}),
    ("plain + grad norm + where guard", {"keep": guard.keep_where}),
    ("plain + grad norm + cond guard", {"keep": guard.keep_cond}),
)


def measure(config: str, layout: str, steps: int, rounds: int, breakdown: bool) -> list[dict]:
    """Rows for one layout: jaxpar vs plain, then (optionally) plain + each extra."""
    run = build(load_config([config], [*layout_overrides(layout), "train.grad_accum=1"]))
    trainer = run.trainer
    host_batch = run.data.batch(0, run.config.train.batch_size)
    batch = trainer.shard_batch(host_batch)
    state = trainer.init()
    plain_step = make_plain_step(run.plan)
    plain = plain_stepper(plain_step, state.params, state.opt_state, batch)
    ours = jaxpar_stepper(trainer, state, batch)
    losses = check_same_losses(ours, plain)
    rows = [
        {
            "layout": layout,
            "name": "jaxpar",
            **interleaved(ours, plain, steps, rounds),
            "dispatch": ours.dispatch(DISPATCH_CALLS),
            "dispatch_plain": plain.dispatch(DISPATCH_CALLS),
            "shard_batch": shard_batch_time(run, DISPATCH_CALLS),
            "losses": losses,
        }
    ]
    if not breakdown:
        return rows
    cost = lambda step: xla_cost(step.lower(*plain.carry, batch).compile())
    base = cost(plain_step)
    rows[0]["cost"] = [
        x / y for x, y in zip(xla_cost(trainer.compile_step(host_batch)), base, strict=True)
    ]
    for name, kw in BREAKDOWN:
        step = make_plain_step(run.plan, **kw)
        extra = plain_stepper(step, *plain.carry, batch)
        check_same_losses(extra, plain, steps=1)
        rows.append(
            {
                "layout": layout,
                "name": name,
                **interleaved(extra, plain, steps, rounds),
                "dispatch": extra.dispatch(DISPATCH_CALLS),
                "dispatch_plain": plain.dispatch(DISPATCH_CALLS),
                "cost": [x / y for x, y in zip(cost(step), base, strict=True)],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2"],
        help="mesh degrees per layout, e.g. data=2,fsdp=2,tensor=2",
    )
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="alternating blocks of each (many short blocks: a slow spell "
        "of a shared machine spoils few of them)",
    )
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the plain step plus each of jaxpar's extras",
    )
    args = parser.parse_args()
    print(
        f"{args.config}, {jax.device_count()} × {jax.devices()[0].platform} devices, "
        f"{args.rounds} rounds × {args.steps} steps of each, interleaved; medians\n"
    )
    rows = [
        row
        for layout in args.layouts
        for row in measure(args.config, layout, args.steps, args.rounds, args.breakdown)
    ]
    print(
        "| layout | jaxpar s/step | plain jax.jit s/step | ratio | host dispatch per step "
        "(jaxpar / plain) | shard_batch per step | CPU-time ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in (r for r in rows if r["name"] == "jaxpar"):
        print(
            f"| {r['layout']} | {r['t']:.4f} | {r['t_plain']:.4f} | {ratio(r['ratios'])} "
            f"| {ms(r['dispatch'][0])} / {ms(r['dispatch_plain'][0])} "
            f"| {ms(r['shard_batch'])} | {ratio(r['cpu_ratios'])} |"
        )
    print(
        "\nhost dispatch = CPU time of the calling thread until the step call returns; its "
        "wall time (median) is longer, the Python thread waiting for a core while the step "
        "runs: "
        + "; ".join(
            f"{r['layout']}: {ms(r['dispatch'][1])} / {ms(r['dispatch_plain'][1])}"
            for r in rows
            if r["name"] == "jaxpar"
        )
    )
    print(
        "losses at steps 1-3 (jaxpar = plain, rtol 1e-5): "
        + "; ".join(
            f"{r['layout']}: " + ", ".join(f"{x:.5f}" for x in r["losses"])
            for r in rows
            if r["name"] == "jaxpar"
        )
    )
    if args.breakdown:
        print(
            "\n| layout | variant | s/step | plain s/step (same rounds) | ratio "
            "| CPU-time ratio | XLA flops / plain | XLA bytes accessed / plain "
            "| host dispatch (variant / plain) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['layout']} | {r['name']} | {r['t']:.4f} | {r['t_plain']:.4f} "
                f"| {ratio(r['ratios'])} | {ratio(r['cpu_ratios'])} | {r['cost'][0]:.4f} "
                f"| {r['cost'][1]:.4f} | {ms(r['dispatch'][0])} / "
                f"{ms(r['dispatch_plain'][0])} |"
            )


def ratio(ratios: list[float]) -> str:
    """Median of the per-round ratios, and their range."""
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
