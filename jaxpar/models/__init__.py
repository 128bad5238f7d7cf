"""Built-in Flax NNX models. They name logical axes only (see ``jaxpar.logical``)."""

from jaxpar.models.classifiers import ConvNet, MLPClassifier
from jaxpar.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "ConvNet", "GPTConfig", "MLPClassifier"]
