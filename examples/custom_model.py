"""Bring your own model: train any Flax NNX module with jaxpar's machinery.

Run:  python examples/custom_model.py  (8 simulated CPU devices, ~10 s)

The module below carries no logical-axis annotations (plain ``nnx.Linear``), so
regex *path rules* name its parameters' dims; a module that annotates its own
parameters (``nnx.Param(value, axes=("embed", "mlp"))``) needs none. The same
code runs under any mesh: change ``MeshConfig`` below.
"""

import jaxpar

jaxpar.setup_devices(8)  # before JAX starts: 8 simulated CPU devices when there is no GPU
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar import MeshConfig, OptimConfig, RulesConfig  # noqa: E402


class Regressor(nnx.Module):
    """y = W2 · relu(W1 · x): a two-layer MLP written with stock Flax layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        h = jaxpar.constrain(jax.nn.relu(self.hidden(x)), ("batch", "mlp"))
        return self.out(h)[:, 0]


def mse(model, batch):
    """Loss: mean over examples (so gradient accumulation is exact)."""
    err = model(batch["x"]) - batch["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


TASK = jaxpar.Task(
    model_fn=Regressor,
    loss_fn=mse,
    batch_axes={"x": ("batch", None), "y": ("batch",)},
    path_rules=(  # regex on parameter paths → logical axes
        (r"hidden/kernel", ("embed", "mlp")),
        (r"hidden/bias", ("mlp",)),
        (r"out/kernel", ("mlp", "classes")),
        (r"out/bias", ("classes",)),
    ),
)


def make_batch(step: int, batch_size: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(batch_size, 16)).astype(np.float32)
    y = np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
    return {"x": x, "y": y.astype(np.float32)}


def main(steps: int = 100, mesh_cfg: MeshConfig = MeshConfig(data=4, tensor=2),
         devices: int = 0) -> list[float]:
    """Trains for ``steps`` on the first ``devices`` devices (0: all); returns the losses."""
    mesh = jaxpar.make_mesh(mesh_cfg, jax.devices()[:devices] if devices else None)
    rules = jaxpar.resolve_rules(RulesConfig(preset="auto"))
    params, axes = jaxpar.abstract_params_and_axes(TASK)
    tx, schedule = jaxpar.make_optimizer(
        OptimConfig(name="adamw", lr=1e-2, warmup_steps=10, weight_decay=1e-4), steps,
        jaxpar.decay_mask(params, axes))
    trainer = jaxpar.Trainer(TASK, tx, mesh, rules, schedule=schedule)
    state = trainer.init()
    losses = []
    for step in range(steps):
        state, metrics = trainer.step(state, trainer.shard_batch(make_batch(step)))
        losses.append(float(metrics["loss"]))
    print(f"mesh {dict(mesh.shape)}: loss {losses[0]:.3f} → {losses[-1]:.3f}")
    print("hidden/kernel sharding:", state.params["hidden"]["kernel"].sharding.spec)
    return losses


if __name__ == "__main__":
    main()
