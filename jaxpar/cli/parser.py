"""The ``jaxpar`` command's arguments (argparse): the commands, and options given before
the command. Each command's parser is built beside its kind: :mod:`~jaxpar.cli.
config_parsers` (the commands that take a config), :mod:`~jaxpar.cli.run_parsers`
(``sample`` and ``eval``), :mod:`~jaxpar.cli.tool_parsers` (``prepare-data``, ``launch``),
with the option types they share in :mod:`~jaxpar.cli.options`."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from jaxpar import plot
from jaxpar.cli.config_parsers import config_parsers, lab_parsers
from jaxpar.cli.run_parsers import eval_parser, sample_parser
from jaxpar.cli.tool_parsers import launch_parser, prepare_parser
from jaxpar.files import shorten

#: ``jaxpar --help``: the commands, their arguments and the exit statuses.
HELP = """\
    jaxpar train    [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
                    [--trust-code] [--help-config]
    jaxpar inspect  [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
                    [--trust-code]
    jaxpar pipeline [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
                    [--trust-code] [--png PATH] [--width N] [--overwrite]
    jaxpar export   [RUN_DIR | CONFIG.yaml …] [section.key=value …] [--devices N]
                    [--task FILE.py:NAME] [--trust-code] [--format npz|hf] --out PARAMS.npz|DIR
                    [--step N] [--overwrite]
    jaxpar sweep    [CONFIG.yaml …] [section.key=value …] (--layouts L … | --all) [--out DIR]
                    [--overwrite] [--steps N] [--hardware NAME] [--hardware-file PATH]
                    [--memory-gb G] [--devices N] [--task FILE.py:NAME] [--trust-code]
    jaxpar plan     [CONFIG.yaml …] [section.key=value …] --devices N [--hardware NAME]
                    [--hardware-file PATH] [--memory-gb G] [--layouts L …] [--out DIR]
                    [--overwrite] [--fit SWEEP.csv …] [--analytic] [--top N] [--longest]
                    [--task FILE.py:NAME] [--trust-code]
    jaxpar prepare-data INPUT… --out PATH [--tokenizer byte|TOKENIZER.json|FOLDER]
                    [--glob PATTERN] [--text-key KEY] [--bos auto|none|TOKEN]
                    [--eos auto|none|TOKEN] [--workers N] [--records text|prompt_completion|chat]
                    [--prompt-key KEY] [--completion-key KEY] [--messages-key KEY] [--overwrite]
    jaxpar launch   -n N [--devices-per-process K] [--cpus-per-process C] [--port P]
                    [--bind ADDRESS] [--grace S] -- COMMAND …
    jaxpar plot     RUN_DIR [RUN_DIR …] [--out PATH] [--overwrite]
    jaxpar sample   RUN_DIR|FOLDER (--prompt TEXT | --prompt-ids 1,2,3) [--tokens N]
                    [--temperature T] [--top-k K] [--seed S] [--step N] [--samples N]
                    [--stop auto|none|2,7] [section.key=value …] [--devices N] [--trust-code]
    jaxpar eval     RUN_DIR|FOLDER [section.key=value …] [--batches N] [--step N] [--json]
                    [--devices N] [--trust-code]

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
    config_parsers(sub)
    lab_parsers(sub)
    sample_parser(sub)
    eval_parser(sub)
    plot.add_parser(sub)
    prepare_parser(sub)
    launch_parser(sub)
    return parser


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
