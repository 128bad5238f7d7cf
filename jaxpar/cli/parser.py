"""The ``jaxpar`` command's arguments (argparse): every command, its options, and options
given before the command."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from jaxpar import plot
from jaxpar.config import MAX_STEPS
from jaxpar.files import shorten
from jaxpar.mesh import MAX_CPU_DEVICES, MAX_DEVICES, MESH_AXES

#: ``jaxpar --help``: the commands, their arguments and the exit statuses.
HELP = """    jaxpar train    [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
    jaxpar inspect  [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
    jaxpar pipeline [CONFIG.yaml …] [section.key=value …] [--devices N] [--png PATH] [--width N]
                    [--overwrite]
    jaxpar export   [RUN_DIR | CONFIG.yaml …] [section.key=value …] [--devices N]
                    [--format npz|hf] --out PARAMS.npz|DIR [--step N] [--overwrite]
    jaxpar sweep    [CONFIG.yaml …] [section.key=value …] (--layouts L … | --all) [--out DIR]
                    [--overwrite] [--steps N] [--hardware NAME] [--memory-gb G] [--devices N]
    jaxpar plan     [CONFIG.yaml …] [section.key=value …] --devices N [--hardware NAME]
                    [--memory-gb G] [--layouts L …] [--longest]
    jaxpar sample   RUN_DIR|FOLDER (--prompt TEXT | --prompt-ids 1,2,3) [--tokens N]
                    [--temperature T] [--top-k K] [--seed S] [--step N] [--samples N]
                    [section.key=value …] [--devices N]
    jaxpar eval     RUN_DIR|FOLDER [section.key=value …] [--batches N] [--step N] [--json]
                    [--devices N]
    jaxpar prepare-data INPUT… --out PATH [--tokenizer byte|TOKENIZER.json|FOLDER] [--glob PATTERN]
                    [--text-key KEY] [--bos auto|none|TOKEN] [--eos auto|none|TOKEN] [--workers N]
                    [--records text|prompt_completion|chat] [--prompt-key KEY] … [--overwrite]
    jaxpar launch   -n N [--devices-per-process K] [--cpus-per-process C] -- COMMAND [ARGS…]
    jaxpar plot     RUN_DIR [RUN_DIR …] [--out PATH] [--overwrite]

With no CONFIG the default config (``configs/gpt_tiny.yaml``'s settings) is used; a
RUN_DIR (a directory holding a run's ``config.yaml``) in its place means that run's config,
with ``run.dir`` = RUN_DIR.
``--task FILE.py:NAME`` (or ``package.module:NAME``) trains a user's jaxpar.Task instead
of the built-in model (every command that takes a config accepts it).
``sample`` continues a prompt with a run's language model (its config is the run dir's
``config.yaml``; overrides apply on top, e.g. another layout: ``mesh.data=1 --devices 1``)
or a Hugging Face FOLDER's (config.json + safetensors; its tokenizer.json, if any, encodes
the prompt); ``eval`` gives the loss and perplexity of either on held-out data
(``data.path=TOKENS`` for a folder), writing nothing.
Options (``--devices``, ``--task``, …) may come anywhere: before the command too.
A command that writes (``export``, ``sweep``, ``plot``, ``pipeline --png``) refuses an
existing file or a folder holding files unless ``--overwrite`` is given, and never writes
a run's own files or into the directory of a run that is running.
``prepare-data`` takes no config: it turns local text and record files (JSONL, Parquet,
Arrow, ``save_to_disk`` folders), folders and globs into a token file (``PATH`` plus
``PATH.json``) that training memory-maps.
Exit status: 0 done; 2 bad input (the one-line message says what to fix); 3 a non-finite
step with train.nonfinite=stop; 4 stopped by SIGTERM or a first Ctrl-C, with a checkpoint
of the current step written (run the same command to resume); 5 a checkpoint or a file
could not be written (disk full, I/O error; the complete checkpoints stay usable); 6 more
steps skipped than train.max_skipped / train.max_consecutive_skipped allow; 70 an
internal error (a bug in jaxpar, JAX or the model's own code, not bad input: the line says
where its traceback was written); 130 stopped by Ctrl-C before training began, or by a
second Ctrl-C (no checkpoint of the current step). Errors print one line; --debug (or
JAXPAR_DEBUG=1) prints the traceback too.
"""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a bad argument is one line, ``jaxpar: error: …``
    (exit status 2), not the usage followed by the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"jaxpar: error: {shorten(message, 500)}; see {self.prog} --help\n")


def _count(high: int, low: int | None = 0) -> Callable[[str], int]:
    """An option's integer type: a whole number in [``low``, ``high``] (``low`` None: no
    lower bound here — the command checks it), else one line saying so."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or beyond Python's 4,300 digits
            value = None
        if value is None or value > high or (low is not None and value < low):
            span = f"from {low} to {high:_}" if low is not None else f"at most {high:_}"
            raise argparse.ArgumentTypeError(
                f"expects an integer {span}, got {shorten(text, 40)!r}"
            )
        return value

    return count


def _number(
    low: float, high: float, what: str, low_included: bool = True
) -> Callable[[str], float]:
    """An option's number type: finite, in [``low``, ``high``] (``low`` excluded unless
    ``low_included``), else one line saying so (``what``: ``a memory size in GB``)."""

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value >= low if low_included else value > low
        if not (math.isfinite(value) and above and value <= high):
            least = f"from {low:g}" if low_included else f"above {low:g}"
            raise argparse.ArgumentTypeError(
                f"expects {what}, a number {least} to {high:_.0f}, got {shorten(text, 40)!r}"
            )
        return value

    return number


#: ``--memory-gb``'s type: device memory in GB (10**9 bytes), up to a petabyte.
_gigabytes = _number(0, 10**6, "a memory size in GB", low_included=False)
#: ``launch --grace``'s type: seconds, up to a day.
_seconds = _number(0, 86_400, "a time in seconds")


def _layout(text: str) -> str:
    """``--layouts``' type: ``axis=N`` entries over known mesh axes (a degree that does not
    fit is the lab's to report, per layout), or ``section.key=value`` overrides."""
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise argparse.ArgumentTypeError(
                f"layout '{shorten(text, 80)}': "
                f"'{shorten(item, 40)}' must look like axis=N, "
                "e.g. fsdp=8"
            )
        if "." not in key and key not in MESH_AXES:
            raise argparse.ArgumentTypeError(
                f"layout '{shorten(text, 80)}': unknown mesh axis '{shorten(key, 40)}'; the "
                f"axes are {', '.join(MESH_AXES)} (or give a section.key=value override)"
            )
    return text


def overwrite_argument(cmd: argparse.ArgumentParser, what: str) -> None:
    """A writing command's ``--overwrite`` (``what``: what it replaces)."""
    cmd.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace {what}; without it that is refused (a run's own files "
        "and a running run's directory never are written)",
    )


#: ``--devices``' type: a device count (0: all), at most MAX_DEVICES (the same bound as
#: run.devices; without an accelerator jaxpar.mesh refuses more than MAX_CPU_DEVICES).
_DEVICES = _count(MAX_DEVICES)
#: ``--step``'s type: a checkpoint's step.
_STEP = _count(MAX_STEPS)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jaxpar", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the full traceback of an error (also JAXPAR_DEBUG=1); "
        "may be given anywhere before a launch's --",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _config_parsers(sub)
    _lab_parsers(sub)
    _sample_parser(sub)
    _eval_parser(sub)
    plot.add_parser(sub)
    _prepare_parser(sub)
    _launch_parser(sub)
    return parser


def _config_parsers(sub: argparse._SubParsersAction) -> None:
    """``train``, ``inspect``, ``pipeline`` and ``export``: commands that take a config."""
    for name, text in (
        ("train", "train a model"),
        ("inspect", "print where every parameter lives, without training"),
        ("pipeline", "print (and draw) the pipeline schedule of a config"),
        ("export", "write a checkpoint's parameters to an .npz file"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument(
            "args",
            nargs="*",
            metavar="CONFIG.yaml | section.key=value",
            help="YAML files (later ones win), then overrides such as mesh.fsdp=8",
        )
        cmd.add_argument(
            "--devices",
            type=_DEVICES,
            default=None,
            help="device count (simulated CPU devices when there is no accelerator)",
        )
        _task_argument(cmd)
        if name == "train":
            cmd.add_argument(
                "--help-config",
                action="store_true",
                help="print the reference of every config key (Markdown, as in "
                "docs/config.md) and exit",
            )
        if name == "pipeline":
            cmd.add_argument(
                "--png",
                default=None,
                metavar="PATH",
                help="also write the schedule chart (PNG; a path ending in .svg writes SVG)",
            )
            overwrite_argument(cmd, "an existing --png file")
            cmd.add_argument(
                "--width",
                type=_count(100_000, 1),
                default=None,
                help="wrap the text grid at this many columns",
            )
        if name == "export":
            _export_arguments(cmd)


def _export_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--out",
        required=True,
        metavar="PARAMS.npz|DIR",
        help="where to write the parameters: an .npz file ('blocks/w_in' → "
        "array), or with --format hf a directory",
    )
    cmd.add_argument(
        "--format",
        choices=("npz", "hf"),
        default="npz",
        help="npz (jaxpar's parameter paths) or hf (config.json + "
        "safetensors in the family's Hugging Face layout, and the run's "
        "tokenizer.json when its token file has one)",
    )
    cmd.add_argument(
        "--step", type=_STEP, default=None, help="the checkpoint step (default: the latest)"
    )
    cmd.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file, or the model files (config.json, "
        "safetensors, tokenizer) of a non-empty --out directory; without "
        "it either is refused",
    )


def _prepare_parser(sub: argparse._SubParsersAction) -> None:
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
        type=_count(4096),
        default=0,
        metavar="N",
        help="processes that encode (0: one per CPU core this process may "
        "use; 1: this process, on the tokenizer library's threads); the "
        "token file does not depend on it (--records text only)",
    )
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


def _launch_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "launch", help="run a jaxpar command in N local processes (one jax.distributed run)"
    )
    run.add_argument(
        "-n", "--processes", type=_count(MAX_CPU_DEVICES, 1), required=True, metavar="N"
    )
    run.add_argument(
        "--devices-per-process",
        type=_count(MAX_CPU_DEVICES),
        default=0,
        metavar="K",
        help="simulated CPU devices per process (0: leave the backend alone)",
    )
    run.add_argument(
        "--cpus-per-process",
        type=_count(2**16),
        default=0,
        metavar="C",
        help="pin process i to CPU cores [i*C, (i+1)*C) (0: no pinning)",
    )
    run.add_argument(
        "--port",
        type=_count(65535),
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
        type=_seconds,
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


def _sample_parser(sub: argparse._SubParsersAction) -> None:
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
        type=_ids,
        metavar="1,2,3",
        help="the prompt as token ids (a folder without tokenizer.json); the output is ids too",
    )
    cmd.add_argument(
        "--tokens", type=_count(2**24, None), default=200, help="tokens to generate (200)"
    )
    cmd.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="0: greedy (the most likely token); higher: more random (1.0)",
    )
    cmd.add_argument(
        "--top-k",
        type=_count(2**31, None),
        default=0,
        metavar="K",
        help="draw from the K most likely tokens only (0: all)",
    )
    cmd.add_argument("--seed", type=_count(2**32 - 1), default=0, help="random seed (0)")
    cmd.add_argument(
        "--samples", type=_count(2**16, None), default=1, help="continuations to draw (1)"
    )


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "eval",
        help="loss and perplexity of a run dir's checkpoint or a "
        "Hugging Face folder on held-out data, writing nothing",
    )
    _path_arguments(cmd)
    cmd.add_argument(
        "--batches",
        type=_count(2**20, 1),
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
        "--step", type=_STEP, default=None, help="the checkpoint step (default: the latest)"
    )
    _trust_argument(cmd)
    cmd.add_argument(
        "--devices",
        type=_DEVICES,
        default=None,
        help="device count (simulated CPU devices when there is no accelerator)",
    )


def _ids(text: str) -> tuple[int, ...]:
    """``--prompt-ids``' type: comma-separated whole numbers."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expects token ids separated by commas, e.g. 1,2,3; got {shorten(text, 40)!r}"
        ) from None


def _trust_argument(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--trust-code",
        action="store_true",
        help="import the code a run directory's config.yaml names (model.name="
        "FILE:NAME, train.hooks); without it only code named on the command "
        "line runs",
    )


def _task_argument(cmd: argparse.ArgumentParser) -> None:
    _trust_argument(cmd)
    cmd.add_argument(
        "--task",
        default=None,
        metavar="FILE.py:NAME",
        help="train your own model: a jaxpar.Task (or a function returning one) "
        "in a Python file or module (package.module:NAME)",
    )


def _lab_parsers(sub: argparse._SubParsersAction) -> None:
    """``sweep`` and ``plan`` (the layout lab, ``jaxpar/lab/``)."""
    sweep = sub.add_parser(
        "sweep",
        help="compile, measure and predict several layouts side by "
        "side (table, sweep.csv, sweep.md, sweep.png)",
    )
    plan = sub.add_parser(
        "plan",
        help="rank every layout of N devices by predicted step time "
        "on a hardware profile, without training",
    )
    for cmd in (sweep, plan):
        cmd.add_argument(
            "args",
            nargs="*",
            metavar="CONFIG.yaml | section.key=value",
            help="YAML files (later ones win), then overrides",
        )
        cmd.add_argument(
            "--hardware",
            default="h100",
            help="hardware profile for the predicted step time (h100, h200, a100, "
            "or one from --hardware-file)",
        )
        cmd.add_argument(
            "--hardware-file",
            default=None,
            metavar="PATH",
            help="a YAML file of extra hardware profiles (see jaxpar/lab/hardware.yaml)",
        )
        cmd.add_argument(
            "--memory-gb",
            type=_gigabytes,
            default=None,
            metavar="G",
            help="device memory that 'fits' is judged against (default: the hardware profile's)",
        )
        cmd.add_argument(
            "--layouts",
            nargs="+",
            type=_layout,
            default=None,
            metavar="LAYOUT",
            help='layouts such as "data=8" "fsdp=4,stage=2" (axes left out are 1)',
        )
        _task_argument(cmd)
    plan.add_argument(
        "--longest",
        action="store_true",
        help="for each of --layouts, the longest data.seq_len that fits "
        "(doubling from the config's)",
    )
    sweep.add_argument(
        "--all",
        action="store_true",
        help="every way to factor the device count over data/fsdp/tensor/stage",
    )
    sweep.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where sweep.csv, sweep.md and sweep.png go (default: "
        "<run.dir>/sweep, or sweep-2, sweep-3 … when it holds files)",
    )
    overwrite_argument(sweep, "those files in a --out folder that holds files")
    sweep.add_argument(
        "--steps",
        type=_count(10**6),
        default=5,
        help="timed steps per layout after 2 warm-up steps (0: compile only)",
    )
    sweep.add_argument(
        "--devices",
        type=_DEVICES,
        default=None,
        help="device count (simulated CPU devices when there is no accelerator)",
    )
    plan.add_argument(
        "--devices",
        type=_count(MAX_DEVICES, 1),
        required=True,
        help="how many devices to plan for (simulated on the CPU to compile)",
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; configs and overrides may come before or after options
    (``jaxpar train --task f.py:TASK mesh.fsdp=8``)."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(_command_first(parser, argv))
    if extra:
        if not hasattr(args, "args") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*args.args, *extra]
    return args


def _command_first(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the options given before the command moved after it: a command's
    options may come anywhere (``jaxpar --devices 8 train`` = ``jaxpar train --devices
    8``). ``-h`` before the command keeps the top-level help."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    at = next((i for i, a in enumerate(argv) if a in commands), 0)
    if not at or {"-h", "--help"} & set(argv[:at]):
        return argv
    return [argv[at], *argv[:at], *argv[at + 1 :]]


def debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (anywhere before a launch's ``--``), and whether it
    was there."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--debug"]
    return head + argv[end:], len(head) != end
