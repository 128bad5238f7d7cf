"""Training data: token files (written by :mod:`~jaxpar.data.prepare`, read by
:mod:`~jaxpar.data.token_file`), the grain loader
(:mod:`~jaxpar.data.loader`) and the data a config asks for
(:mod:`~jaxpar.data.sources`)."""

import typing as _typing

from jaxpar import lazy as _lazy

if _typing.TYPE_CHECKING:
    from jaxpar.data.images import load_digits, load_npz, synthetic_images
    from jaxpar.data.loader import ArrayExamples, Loader, TokenWindows, fixed_batches
    from jaxpar.data.prepare import builtin_corpus, builtin_text, prepare_data
    from jaxpar.data.sources import Data, load_data
    from jaxpar.data.token_file import TokenFile, check_vocab, open_tokens

#: each name's module, imported on first use (``jaxpar prepare-data`` then starts
#: without loading JAX and grain, which the loader needs)
_HOMES = {
    "ArrayExamples": "jaxpar.data.loader",
    "Loader": "jaxpar.data.loader",
    "TokenWindows": "jaxpar.data.loader",
    "fixed_batches": "jaxpar.data.loader",
    "builtin_corpus": "jaxpar.data.prepare",
    "builtin_text": "jaxpar.data.prepare",
    "prepare_data": "jaxpar.data.prepare",
    "Data": "jaxpar.data.sources",
    "load_data": "jaxpar.data.sources",
    "load_digits": "jaxpar.data.images",
    "load_npz": "jaxpar.data.images",
    "synthetic_images": "jaxpar.data.images",
    "TokenFile": "jaxpar.data.token_file",
    "check_vocab": "jaxpar.data.token_file",
    "open_tokens": "jaxpar.data.token_file",
}

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

__getattr__, __dir__ = _lazy.exports(__name__, _HOMES, globals())
