"""Model families, one module each: the model (Flax NNX, logical axes only), its typed
config, its Task builder and its counts, registered by name (see
``jaxpar/models/family.py``). Importing this package registers the built-in ones.

What a family of your own needs is here too: :class:`Family`, :class:`ModelConfig` and
:func:`section` (its config's declaration), :class:`DataNeeds` and :class:`Counts`. What
the layout lab knows of a family is the lab's (:mod:`jaxpar.lab.families`)."""

from jaxpar.models.bert import BERT, BERTConfig, mlm_loss
from jaxpar.models.classifiers import ConvNet, MLPClassifier, classification_loss
from jaxpar.models.family import (
    Counts,
    Family,
    ModelConfig,
    families,
    register,
)
from jaxpar.models.gemma import Gemma, GemmaConfig, gemma_loss
from jaxpar.models.gpt import GPT, GPTConfig, lm_loss
from jaxpar.models.llama import Llama, LlamaConfig, llama_loss
from jaxpar.models.resnet import ResNet, ResNetConfig
from jaxpar.schema import section
from jaxpar.task import DataNeeds

__all__ = [
    "BERT",
    "GPT",
    "BERTConfig",
    "ConvNet",
    "Counts",
    "DataNeeds",
    "Family",
    "GPTConfig",
    "Gemma",
    "GemmaConfig",
    "gemma_loss",
    "Llama",
    "LlamaConfig",
    "MLPClassifier",
    "ModelConfig",
    "ResNet",
    "ResNetConfig",
    "classification_loss",
    "families",
    "llama_loss",
    "lm_loss",
    "mlm_loss",
    "register",
    "section",
]
