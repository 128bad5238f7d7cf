"""The texts' model-parallel example: Dense(784→512) + ReLU on one device, Dense(512→10) on
the other (TensorFlow placed each layer with ``tf.device``). In jaxpar the model is an
``nnx.Sequential`` of its layers; ``mesh.stage=2`` cuts it by layer over two sub-meshes,
and the pipeline schedule keeps both devices busy with microbatches. Adam, sparse
cross-entropy; the data are noisy 28×28 images of 10 fixed patterns (nothing downloaded).

    python examples/two_device_mlp.py                     # 2 simulated CPU devices, ~10 s
    jaxpar train --task examples/two_device_mlp.py:TASK mesh.stage=2 run.devices=2
    jaxpar train --task examples/two_device_mlp.py:TASK mesh.stage=2 mesh.data=4 \
        pipeline.schedule=zb_h1                           # 8 devices: 2 stages × 4-way data

Expect: "layer 0 (Linear 784→512) on devices [0]", "layer 2 (Linear 512→10) on devices [1]",
then eval accuracy 1.00 at step 50 — the same numbers as one device accumulating the
pipeline's microbatches (``train.grad_accum=4``).
"""

import numpy as np
import optax
from flax import nnx

import jaxpar

#: the default initializer of :func:`named`
LECUN_NORMAL = nnx.initializers.lecun_normal()


def named(*names, init=LECUN_NORMAL):
    """An initializer that tags the parameter's dims with logical names (so ``mesh.tensor``
    or ``mesh.fsdp`` can split a layer inside its stage)."""
    return nnx.with_partitioning(init, names)


def model(rngs: nnx.Rngs) -> nnx.Sequential:
    zeros = nnx.initializers.zeros_init()
    return nnx.Sequential(
        nnx.Linear(
            784,
            512,
            kernel_init=named("embed", "mlp"),
            bias_init=named("mlp", init=zeros),
            rngs=rngs,
        ),
        nnx.relu,
        nnx.Linear(
            512,
            10,
            kernel_init=named("mlp", "classes"),
            bias_init=named("classes", init=zeros),
            rngs=rngs,
        ),
    )


PATTERNS = np.random.default_rng(0).normal(size=(10, 784)).astype(np.float32)


def batch(step: int, batch_size: int) -> dict[str, np.ndarray]:
    """Batch ``step``: each image a pattern plus twice its size of noise; the label its
    pattern."""
    rng = np.random.default_rng(step)
    labels = rng.integers(0, 10, batch_size)
    x = PATTERNS[labels] + 2.0 * rng.normal(size=(batch_size, 784)).astype(np.float32)
    return {"x": x, "y": labels.astype(np.int32)}


def sparse_cross_entropy(logits, b):
    accuracy = (logits.argmax(-1) == b["y"]).mean()
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), {
        "accuracy": accuracy
    }


TASK = jaxpar.Task(
    model_fn=model,
    batch_axes={"x": ("batch", None), "y": ("batch",)},
    layers=jaxpar.Layers(inputs="x", loss=sparse_cross_entropy),  # the model's layers in order
    data=batch,
    eval_data=lambda step, n: batch(10**6 + step, n),  # held out: other seeds
    optimizer=optax.adam(1e-3),
    name="two_device_mlp",
)


if __name__ == "__main__":
    jaxpar.setup_devices(2)  # 2 simulated devices on a CPU (a GPU machine uses its own)
    config = jaxpar.load_config(
        [],
        [
            "run.devices=2",
            "mesh.stage=2",
            "train.steps=100",
            "train.batch_size=32",
            "train.eval_every=50",
        ],
    )
    state = jaxpar.build(config, TASK).trainer.init()
    for index, layer in state.params["layers"].items():  # the Sequential's layers 0 and 2
        kernel = layer["kernel"]
        devices = sorted(d.id for d in kernel.sharding.device_set)
        print(f"layer {index} (Linear {kernel.shape[0]}→{kernel.shape[1]}) on devices {devices}")
    jaxpar.train(config, task=TASK)
