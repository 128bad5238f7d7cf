"""Model families, one module each: the model (Flax NNX, logical axes only), its typed
config, its Task builder, its counts and lab knowledge, registered by name (see
``jaxpar/models/family.py``). Importing this package registers the built-in ones."""

from jaxpar.models.bert import BERT, BERTConfig, mlm_loss
from jaxpar.models.classifiers import ConvNet, MLPClassifier, classification_loss
from jaxpar.models.family import (
           Counts,
           Family,
           LabModel,
           ModelConfig,
           families,
           register,
)
from jaxpar.models.gpt import GPT, GPTConfig, lm_loss
from jaxpar.models.resnet import ResNet, ResNetConfig

__all__ = ["BERT", "GPT", "BERTConfig", "ConvNet", "Counts", "Family", "GPTConfig", "LabModel",
           "MLPClassifier", "ModelConfig", "ResNet", "ResNetConfig", "classification_loss",
           "families", "lm_loss", "mlm_loss", "register"]
