"""The parsers of the commands that take no config: ``prepare-data`` (local text and
records into a token file) and ``launch`` (a command in N local processes)."""

from __future__ import annotations

import argparse

from jaxpar.cli.options import count, overwrite_argument, seconds
from jaxpar.limits import MAX_CPU_DEVICES


def prepare_parser(sub: argparse._SubParsersAction) -> None:
    prep = sub.add_parser(
        "prepare-data", help="tokenize local text and record files into a token file"
    )
    prep.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text or record files (JSONL, .jsonl.gz, Parquet, Arrow), folders "
        "(every non-hidden file below, sorted; a save_to_disk folder's "
        "Arrow files) and/or globs",
    )
    prep.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="the token file to write, e.g. corpus.tokens (plus PATH.json)",
    )
    prep.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|TOKENIZER.json|FOLDER",
        help="'byte' (vocab 256), a local Hugging Face tokenizers JSON file, or "
        "a model folder holding tokenizer.json (its tokenizer_config.json "
        "names the end-of-text token)",
    )
    prep.add_argument(
        "--glob",
        default=None,
        metavar="PATTERN",
        help="keep only folder files matching this pattern, e.g. '*.txt'",
    )
    overwrite_argument(prep, "an existing token file at --out (its metadata and mask too)")
    prep.add_argument(
        "--workers",
        type=count(4096),
        default=0,
        metavar="N",
        help="processes that encode (0: one per CPU core this process may "
        "use; 1: this process, on the tokenizer library's threads); the "
        "token file does not depend on it (--records text only)",
    )
    _record_arguments(prep)


def _record_arguments(prep: argparse.ArgumentParser) -> None:
    """What ``prepare-data`` reads from each record, and the separators it adds."""
    prep.add_argument(
        "--text-key",
        default="text",
        metavar="KEY",
        help="the field of each record that holds its text (default: text)",
    )
    prep.add_argument(
        "--records",
        default="text",
        choices=("text", "prompt_completion", "chat"),
        help="text: each record's --text-key is a document; prompt_completion "
        "or chat: fine-tuning records, written with a loss mask "
        "(PATH.mask) so that only completion tokens count (docs/data.md)",
    )
    for key, default in (
        ("prompt", "prompt"),
        ("completion", "completion"),
        ("messages", "messages"),
    ):
        prep.add_argument(
            f"--{key}-key",
            default=default,
            metavar="KEY",
            help=f"the field holding a record's {key} (default: {default})",
        )
    for which, what in (("bos", "before"), ("eos", "after")):
        prep.add_argument(
            f"--{which}",
            default="auto",
            metavar="auto|none|TOKEN",
            help=f"the token {what} each document: auto (the tokenizer's own; "
            "none for byte), none, or a token such as '<|endoftext|>'",
        )


def launch_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "launch", help="run a jaxpar command in N local processes (one jax.distributed run)"
    )
    run.add_argument(
        "-n", "--processes", type=count(MAX_CPU_DEVICES, 1), required=True, metavar="N"
    )
    run.add_argument(
        "--devices-per-process",
        type=count(MAX_CPU_DEVICES),
        default=0,
        metavar="K",
        help="simulated CPU devices per process (0: leave the backend alone)",
    )
    run.add_argument(
        "--cpus-per-process",
        type=count(2**16),
        default=0,
        metavar="C",
        help="pin process i to CPU cores [i*C, (i+1)*C) (0: no pinning)",
    )
    run.add_argument(
        "--port",
        type=count(65535),
        default=0,
        help="coordinator port (0: a free one; retried if another program takes it)",
    )
    run.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address the coordinator listens on (default: loopback only; "
        "0.0.0.0 or :: for every interface)",
    )
    run.add_argument(
        "--grace",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="after a failure, how long the others get to stop before SIGKILL",
    )
    run.add_argument(
        "jaxpar_args",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="after --: the jaxpar command and its arguments, e.g. train mesh.fsdp=8",
    )
