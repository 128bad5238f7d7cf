"""Training data: token files (written by :mod:`~jaxpar.data.prepare`, read by
:mod:`~jaxpar.data.token_file`), the grain loader
(:mod:`~jaxpar.data.loader`) and the data a config asks for
(:mod:`~jaxpar.data.sources`)."""

from jaxpar.data.loader import ArrayExamples, Loader, TokenWindows, fixed_batches
from jaxpar.data.prepare import builtin_corpus, builtin_text, prepare_data
from jaxpar.data.sources import Data, load_data, load_digits, load_npz, synthetic_images
from jaxpar.data.token_file import TokenFile, check_vocab, open_tokens

__all__ = [
    "ArrayExamples",
    "Data",
    "Loader",
    "TokenFile",
    "TokenWindows",
    "builtin_corpus",
    "builtin_text",
    "check_vocab",
    "fixed_batches",
    "load_data",
    "load_digits",
    "load_npz",
    "open_tokens",
    "prepare_data",
    "synthetic_images",
]
