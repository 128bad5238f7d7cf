"""Your own model through jaxpar: a stock Flax NNX CNN (Conv, BatchNorm, Dropout, Linear)
annotated the way Flax documents it (``nnx.with_partitioning``), its own data function and
its own Optax chain — trained by jaxpar's whole loop (run dir, metrics, eval, checkpoints,
resume, any layout).

    python examples/research_cnn.py                       # 8 simulated CPU devices, ~15 s
    jaxpar train --task examples/research_cnn.py:TASK mesh.fsdp=4 mesh.tensor=2
    jaxpar inspect --task examples/research_cnn.py:TASK mesh.fsdp=8

Expect: eval accuracy ≈ 0.97 from step 50 on (4 classes: which quadrant of the noisy 8×8 image
is brighter); the same losses under every layout.
"""

import numpy as np
import optax
from flax import nnx

import jaxpar

#: the default initializer of :func:`named`
LECUN_NORMAL = nnx.initializers.lecun_normal()


def named(*names, init=LECUN_NORMAL):
    """An initializer that tags the parameter's dims with logical names for the rules."""
    return nnx.with_partitioning(init, names)


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        ones, zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()
        self.conv = nnx.Conv(
            1,
            16,
            (3, 3),
            kernel_init=named(None, None, "conv_in", "conv_out"),
            bias_init=named("conv_out", init=zeros),
            rngs=rngs,
        )
        self.bn = nnx.BatchNorm(
            16,
            scale_init=named("conv_out", init=ones),
            bias_init=named("conv_out", init=zeros),
            rngs=rngs,
        )
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.hidden = nnx.Linear(
            16 * 8 * 8,
            64,
            kernel_init=named("embed", "mlp"),
            bias_init=named("mlp", init=zeros),
            rngs=rngs,
        )
        self.out = nnx.Linear(
            64,
            4,
            kernel_init=named("mlp", "classes"),
            bias_init=named("classes", init=zeros),
            rngs=rngs,
        )

    def __call__(self, images):
        x = self.drop(nnx.relu(self.bn(self.conv(images))))
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


QUADRANTS = np.zeros((4, 8, 8, 1), np.float32)
for q in range(4):
    QUADRANTS[q, 4 * (q // 2) : 4 * (q // 2) + 4, 4 * (q % 2) : 4 * (q % 2) + 4] = 1.0


def batch(step, batch_size):
    """Batch of step ``step``: noisy images, one quadrant brighter; the label says which."""
    rng = np.random.default_rng(step)
    labels = rng.integers(0, 4, batch_size)
    images = rng.normal(size=(batch_size, 8, 8, 1)).astype(np.float32) + QUADRANTS[labels]
    return {"images": images, "labels": labels.astype(np.int32)}


def loss(model, b):
    logits = model(b["images"])
    accuracy = (logits.argmax(-1) == b["labels"]).mean()
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean(), {
        "accuracy": accuracy
    }


TASK = jaxpar.Task(
    model_fn=CNN,
    loss_fn=loss,
    batch_axes={"images": ("batch", None, None, None), "labels": ("batch",)},
    data=batch,
    eval_data=lambda step, n: batch(10**6 + step, n),  # held out: other seeds
    optimizer=optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(
            learning_rate=optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 200), weight_decay=1e-4
        ),
    ),
    name="research_cnn",
)

if __name__ == "__main__":
    with jaxpar.cli.as_command():  # a failure: one line and the command's status (4: resume)
        jaxpar.train(
            jaxpar.load_config([], ["mesh.fsdp=4", "mesh.tensor=2", "train.steps=200"]), task=TASK
        )
