"""Training data: token files (:mod:`~jaxpar.data.prepare`), the grain loader
(:mod:`~jaxpar.data.loader`) and the data a config asks for
(:mod:`~jaxpar.data.sources`)."""

from jaxpar.data.loader import ArrayExamples, Loader, TokenWindows, fixed_batches
from jaxpar.data.prepare import (
    TokenFile,
    builtin_corpus,
    builtin_text,
    check_vocab,
    open_tokens,
    prepare_data,
)
from jaxpar.data.sources import Data, load_data, load_digits, load_npz, synthetic_images

__all__ = [
    "ArrayExamples", "Data", "Loader", "TokenFile", "TokenWindows", "builtin_corpus",
    "builtin_text", "check_vocab", "fixed_batches", "load_data", "load_digits", "load_npz",
    "open_tokens", "prepare_data", "synthetic_images",
]
