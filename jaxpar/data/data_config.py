"""The ``data`` section of a config: where the training data is, how it is packed and
held out, and how the loader reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from jaxpar.data import mixture as mix
from jaxpar.data.records import TEXT_KEY
from jaxpar.errors import ConfigError
from jaxpar.schema import Float, section

#: ``data.dataset`` values (see the module docstring).
Dataset = Literal["auto", "digits", "synthetic"]
#: ``data.pack`` values: windows cut across documents (``concat``), or with attention and
#: positions kept within each document (``documents``; docs/data.md).
Pack = Literal["concat", "documents"]


@section("data")
class DataConfig:
    """Training data and its loader (see ``jaxpar/data/``)."""

    path: str = Field(
        "",
        description="a token file made by jaxpar prepare-data, or records "
        "(JSONL, Parquet, Arrow, a datasets save_to_disk folder) or text files "
        "(a file, folder or glob, read as byte tokens) for language models, an "
        ".npz with images (N,H,W[,C]) and labels (N,) for classifiers; empty: "
        "the built-in data (Python's pydoc_data.topics text; synthetic images)",
    )
    mixture: mix.Setting = Field(
        None,
        json_schema_extra={"type": "list of path:weight"},
        description="several text sources (each as data.path takes "
        "it) mixed by weight, instead of data.path: a YAML list of "
        "{path, weight}, or path:weight,path:weight on the command "
        "line (docs/data.md, Mixtures)",
    )
    text_key: str = Field(
        TEXT_KEY,
        min_length=1,
        description="the field of each record that holds its text (records in data.path)",
    )
    dataset: Dataset = Field(
        "auto",
        description="auto (path or the built-in data), digits "
        "(scikit-learn's handwritten digits) or synthetic (random tokens / "
        "template images of num_examples examples, for benchmarks)",
    )
    seq_len: int = Field(128, ge=1, le=2**24, description="tokens per example (language models)")
    pack: Pack = Field(
        "concat",
        description="concat: windows cut from the token stream; "
        "documents: the same windows, each token attending only within its "
        "own document, positions restarting at each (language models)",
    )
    eval_fraction: Float = Field(0.1, description="the held-out share, in (0, 1)")
    image_size: int = Field(8, ge=1, le=2**16, description="height and width of synthetic images")
    channels: int = Field(1, ge=1, le=2**16, description="channels of synthetic images")
    num_examples: int = Field(4096, ge=2, le=2**40, description="examples of synthetic data")
    threads: int = Field(2, ge=0, le=1024, description="grain reader threads")
    prefetch: int = Field(4, ge=0, le=2**16, description="batches read ahead")
    workers: int = Field(0, ge=0, le=1024, description="grain worker processes")
    wait_warn: Float = Field(
        0.1,
        ge=0,
        le=1,
        description="warn once when the loop spends more "
        "than this fraction of its time waiting for data (0: never)",
    )

    @field_validator("eval_fraction")
    @classmethod
    def _a_share(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise ConfigError(
                f"data.eval_fraction={value} must be in (0, 1); set e.g. data.eval_fraction=0.1"
            )
        return value
