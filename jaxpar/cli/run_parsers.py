"""The parsers of the commands that read a trained run or a Hugging Face folder:
``sample`` and ``eval``."""

from __future__ import annotations

import argparse

from jaxpar.cli.options import STEP, count, devices_argument, stop_ids, token_ids, trust_argument


def sample_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "sample",
        help="continue a prompt with a language model (a run dir's "
        "latest checkpoint, or a Hugging Face folder)",
    )
    _path_arguments(cmd)
    prompt = cmd.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument(
        "--prompt-ids",
        type=token_ids,
        metavar="1,2,3",
        help="the prompt as token ids (a folder without tokenizer.json); the output is ids too",
    )
    cmd.add_argument(
        "--tokens", type=count(2**24, None), default=200, help="tokens to generate (200)"
    )
    cmd.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="0: greedy (the most likely token); higher: more random (1.0)",
    )
    cmd.add_argument(
        "--top-k",
        type=count(2**31, None),
        default=0,
        metavar="K",
        help="draw from the K most likely tokens only (0: all)",
    )
    cmd.add_argument("--seed", type=count(2**32 - 1), default=0, help="random seed (0)")
    cmd.add_argument(
        "--samples", type=count(2**16, None), default=1, help="continuations to draw (1)"
    )
    cmd.add_argument(
        "--stop",
        type=stop_ids,
        default="auto",
        metavar="auto|none|2,7",
        help="end a sample at these token ids (auto: the model's end-of-text token, "
        "from the folder's generation_config.json, or its config.json when it has none, "
        "or the run's token file; none: draw --tokens tokens)",
    )


def eval_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "eval",
        help="loss and perplexity of a run dir's checkpoint or a "
        "Hugging Face folder on held-out data, writing nothing",
    )
    _path_arguments(cmd)
    cmd.add_argument(
        "--batches",
        type=count(2**20, 1),
        default=None,
        metavar="N",
        help="held-out batches to read (default: train.eval_batches)",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")


def _path_arguments(cmd: argparse.ArgumentParser) -> None:
    """What ``sample`` and ``eval`` share: the run dir or folder, overrides, the step."""
    cmd.add_argument(
        "run_dir",
        metavar="RUN_DIR|FOLDER",
        help="the run.dir of a trained run, or a Hugging Face folder (config.json + safetensors)",
    )
    cmd.add_argument(
        "args",
        nargs="*",
        metavar="section.key=value",
        help="settings over the run's config.yaml (a folder's: the default "
        "config), e.g. mesh.data=1",
    )
    cmd.add_argument(
        "--step", type=STEP, default=None, help="the checkpoint step (default: the latest)"
    )
    trust_argument(cmd)
    devices_argument(cmd)
