"""The ``jaxpar`` command: a thin layer that parses arguments and calls the Python API.

    jaxpar train    [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
    jaxpar inspect  [CONFIG.yaml …] [section.key=value …] [--devices N] [--task FILE.py:NAME]
    jaxpar pipeline [CONFIG.yaml …] [section.key=value …] [--devices N] [--png PATH] [--width N]
    jaxpar export   [RUN_DIR | CONFIG.yaml …] [section.key=value …] [--devices N]
                    [--format npz|hf] --out PARAMS.npz|DIR [--step N]
    jaxpar sweep    [CONFIG.yaml …] [section.key=value …] (--layouts L … | --all) [--out DIR]
                    [--steps N] [--hardware NAME] [--memory-gb G] [--devices N]
    jaxpar plan     [CONFIG.yaml …] [section.key=value …] --devices N [--hardware NAME]
                    [--memory-gb G] [--layouts L …]
    jaxpar sample   RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K]
                    [--seed S] [--step N] [--samples N] [section.key=value …] [--devices N]
    jaxpar prepare-data INPUT… --out PATH [--tokenizer byte|TOKENIZER.json] [--glob PATTERN]
    jaxpar launch   -n N [--devices-per-process K] [--cpus-per-process C] -- COMMAND [ARGS…]
    jaxpar plot     RUN_DIR [RUN_DIR …] [--out PATH]

With no CONFIG the default config (``configs/gpt_tiny.yaml``'s settings) is used; a
RUN_DIR (a directory holding a run's ``config.yaml``) in its place means that run's config,
with ``run.dir`` = RUN_DIR.
``--task FILE.py:NAME`` (or ``package.module:NAME``) trains a user's jaxpar.Task instead
of the built-in model (every command that takes a config accepts it).
``sample`` continues a prompt with a run's language model: its config is the run dir's
``config.yaml`` (overrides apply on top, e.g. another layout: ``mesh.data=1 --devices 1``).
Options (``--devices``, ``--task``, …) may come anywhere: before the command too.
``prepare-data`` takes no config: it turns local text files and folders into a token file
(``PATH`` plus ``PATH.json``) that training memory-maps.
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

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jaxpar.config import Config, load_config, run_dir_for
from jaxpar.errors import (
    BAD_INPUT,
    INTERNAL,
    INTERRUPTED,
    WRITE_FAILED,
    CheckpointError,
    ConfigError,
    JaxparError,
    NonFiniteStop,
    Preempted,
)

if TYPE_CHECKING:
    from jaxpar.task import Task

#: Exit status when writing a checkpoint (or another file) failed (tests import it here).
CHECKPOINT_FAILED = WRITE_FAILED
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
                errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ENOTEMPTY}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="print the full traceback of an error (also JAXPAR_DEBUG=1); "
                             "may be given anywhere before a launch's --")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "train a model"),
                       ("inspect", "print where every parameter lives, without training"),
                       ("pipeline", "print (and draw) the pipeline schedule of a config"),
                       ("export", "write a checkpoint's parameters to an .npz file")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value",
                         help="YAML files (later ones win), then overrides such as mesh.fsdp=8")
        cmd.add_argument("--devices", type=int, default=None,
                         help="device count (simulated CPU devices when there is no accelerator)")
        _task_argument(cmd)
        if name == "train":
            cmd.add_argument("--help-config", action="store_true",
                             help="print the reference of every config key (Markdown, as in "
                                  "docs/config.md) and exit")
        if name == "pipeline":
            cmd.add_argument("--png", default=None, metavar="PATH",
                             help="also write the schedule chart (PNG; a path ending in .svg "
                                  "writes SVG)")
            cmd.add_argument("--width", type=int, default=None,
                             help="wrap the text grid at this many columns")
        if name == "export":
            cmd.add_argument("--out", required=True, metavar="PARAMS.npz|DIR",
                             help="where to write the parameters: an .npz file ('blocks/w_in' "
                                  "→ array), or with --format hf a directory")
            cmd.add_argument("--format", choices=("npz", "hf"), default="npz",
                             help="npz (jaxpar's parameter paths) or hf (config.json + "
                                  "model.safetensors in GPT-2's layout, for transformers' "
                                  "GPT2LMHeadModel; the GPT with tied embeddings only)")
            cmd.add_argument("--step", type=int, default=None,
                             help="the checkpoint step (default: the latest)")
    _lab_parsers(sub)
    _sample_parser(sub)
    from jaxpar import plot

    plot.add_parser(sub)
    prep = sub.add_parser("prepare-data", help="tokenize local text files into a token file")
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="text files and/or folders (every non-hidden file below, sorted)")
    prep.add_argument("--out", required=True, metavar="PATH",
                      help="the token file to write, e.g. corpus.tokens (plus PATH.json)")
    prep.add_argument("--tokenizer", default="byte", metavar="byte|TOKENIZER.json",
                      help="'byte' (vocab 256) or a local Hugging Face tokenizers JSON file")
    prep.add_argument("--glob", default=None, metavar="PATTERN",
                      help="keep only folder files matching this pattern, e.g. '*.txt'")
    run = sub.add_parser("launch", help="run a jaxpar command in N local processes "
                                        "(one jax.distributed run)")
    run.add_argument("-n", "--processes", type=int, required=True, metavar="N")
    run.add_argument("--devices-per-process", type=int, default=0, metavar="K",
                     help="simulated CPU devices per process (0: leave the backend alone)")
    run.add_argument("--cpus-per-process", type=int, default=0, metavar="C",
                     help="pin process i to CPU cores [i*C, (i+1)*C) (0: no pinning)")
    run.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one; "
                                                          "retried if another program takes it)")
    run.add_argument("--bind", default="127.0.0.1", metavar="ADDRESS",
                     help="the address the coordinator listens on (default: loopback only; "
                          "0.0.0.0 or :: for every interface)")
    run.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                     help="after a failure, how long the others get to stop before SIGKILL")
    run.add_argument("jaxpar_args", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="after --: the jaxpar command and its arguments, e.g. train mesh.fsdp=8")
    return parser


def _sample_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("sample", help="continue a prompt with a trained language model "
                                        "(a run dir's latest checkpoint)")
    cmd.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a trained run")
    cmd.add_argument("args", nargs="*", metavar="section.key=value",
                     help="settings over the run's config.yaml, e.g. mesh.data=1")
    cmd.add_argument("--prompt", required=True, help="the text to continue")
    cmd.add_argument("--tokens", type=int, default=200, help="tokens to generate (200)")
    cmd.add_argument("--temperature", type=float, default=1.0,
                     help="0: greedy (the most likely token); higher: more random (1.0)")
    cmd.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="draw from the K most likely tokens only (0: all)")
    cmd.add_argument("--seed", type=int, default=0, help="random seed (0)")
    cmd.add_argument("--step", type=int, default=None,
                     help="the checkpoint step (default: the latest)")
    cmd.add_argument("--samples", type=int, default=1, help="continuations to draw (1)")
    cmd.add_argument("--devices", type=int, default=None,
                     help="device count (simulated CPU devices when there is no accelerator)")


def _sample(args: argparse.Namespace) -> None:
    from jaxpar.mesh import setup_devices
    from jaxpar.sample import load_run_config, sample_config

    overrides = [*args.args, *([f"run.devices={args.devices}"] if args.devices else [])]
    bad = [a for a in args.args if "=" not in a]
    if bad:
        raise ConfigError(f"jaxpar sample takes one RUN_DIR, then section.key=value settings; "
                          f"got also {' '.join(bad)}")
    config = load_run_config(args.run_dir, overrides)
    setup_devices(config.run.devices)
    out = sample_config(config, args.prompt, tokens=args.tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, step=args.step, samples=args.samples)
    print(f"jaxpar: step {out.step} of {config.run.dir}", file=sys.stderr, flush=True)
    for i, text in enumerate(out.texts):
        if i:
            print("\n---")
        print(args.prompt + text, flush=True)


def _task_argument(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--task", default=None, metavar="FILE.py:NAME",
                     help="train your own model: a jaxpar.Task (or a function returning one) "
                          "in a Python file or module (package.module:NAME)")


def _lab_parsers(sub: argparse._SubParsersAction) -> None:
    """``sweep`` and ``plan`` (the layout lab, ``jaxpar/lab/``)."""
    sweep = sub.add_parser("sweep", help="compile, measure and predict several layouts side by "
                                         "side (table, sweep.csv, sweep.md, sweep.png)")
    plan = sub.add_parser("plan", help="rank every layout of N devices by predicted step time "
                                       "on a hardware profile, without training")
    for cmd in (sweep, plan):
        cmd.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value",
                         help="YAML files (later ones win), then overrides")
        cmd.add_argument("--hardware", default="h100",
                         help="hardware profile for the predicted step time (h100, h200, a100, "
                              "or one from --hardware-file)")
        cmd.add_argument("--hardware-file", default=None, metavar="PATH",
                         help="a YAML file of extra hardware profiles (see "
                              "jaxpar/lab/hardware.yaml)")
        cmd.add_argument("--memory-gb", type=float, default=None, metavar="G",
                         help="device memory that 'fits' is judged against (default: the "
                              "hardware profile's)")
        cmd.add_argument("--layouts", nargs="+", default=None, metavar="LAYOUT",
                         help='layouts such as "data=8" "fsdp=4,stage=2" (axes left out are 1)')
        _task_argument(cmd)
    sweep.add_argument("--all", action="store_true",
                       help="every way to factor the device count over data/fsdp/tensor/stage")
    sweep.add_argument("--out", default=None, metavar="DIR",
                       help="where sweep.csv, sweep.md and sweep.png go (default: <run.dir>/sweep)")
    sweep.add_argument("--steps", type=int, default=5,
                       help="timed steps per layout after 2 warm-up steps (0: compile only)")
    sweep.add_argument("--devices", type=int, default=None,
                       help="device count (simulated CPU devices when there is no accelerator)")
    plan.add_argument("--devices", type=int, required=True,
                      help="how many devices to plan for (simulated on the CPU to compile)")


def _sweep(args: argparse.Namespace, config: Config, task: Task | None) -> None:
    from jaxpar.lab import sweep
    from jaxpar.lab.hardware import get_profile
    from jaxpar.mesh import select_devices

    if bool(args.layouts) == bool(args.all):
        raise ConfigError("jaxpar sweep needs either --layouts L … or --all (not both)")
    hw = get_profile(args.hardware, args.hardware_file)
    layouts = args.layouts or sweep.all_layouts(len(select_devices(config.run.devices)))
    memory = args.memory_gb * 1e9 if args.memory_gb else None
    what = task.name if task is not None else config.model.name
    print(f"sweeping {len(layouts)} layout{'s' * (len(layouts) != 1)} of {what} "
          f"(global batch {config.train.batch_size})", flush=True)
    rows = sweep.sweep(config, layouts, hw, args.steps, memory, echo=True, task=task)
    print(sweep.format_table(rows, hw))
    for path in sweep.write_outputs(rows, hw, args.out or f"{config.run.dir}/sweep"):
        print(f"wrote {path}")


def _plan(args: argparse.Namespace, config: Config, task: Task | None) -> None:
    from jaxpar.lab.hardware import get_profile
    from jaxpar.lab.planner import format_plan, plan

    hw = get_profile(args.hardware, args.hardware_file)
    memory = args.memory_gb * 1e9 if args.memory_gb else hw.memory_bytes
    what = task.name if task is not None else config.model.name
    print(f"planning {what} (global batch {config.train.batch_size}) on "
          f"{args.devices} × {hw.name}", flush=True)
    print(format_plan(plan(config, args.devices, hw, memory, args.layouts, echo=True,
                           task=task), hw, memory))


def _launch(args: argparse.Namespace) -> int:
    from jaxpar.launch import launch

    command = args.jaxpar_args
    command = command[1:] if command[:1] == ["--"] else command
    return launch(args.processes, command, devices_per_process=args.devices_per_process,
                  cpus_per_process=args.cpus_per_process, port=args.port, grace_s=args.grace,
                  bind=args.bind)


def _export(config: Config, out: str, step: int | None, task: Task | None,
            format: str = "npz") -> None:
    from jaxpar.resume import export_params

    path, step = export_params(config, out, step, task=task, format=format)
    what = "GPT-2 (Hugging Face) files of" if format == "hf" else "parameters of"
    print(f"{what} step {step} written to {path}")


def _prepare_data(args: argparse.Namespace) -> None:
    from jaxpar.data.prepare import prepare_data

    tf = prepare_data(args.inputs, args.out, args.tokenizer, args.glob)
    size, docs = tf.num_tokens * tf.tokens.dtype.itemsize, len(tf.documents)
    print(f"{tf.num_tokens:,} tokens from {docs:,} document{'s' * (docs != 1)} "
          f"(vocab {tf.vocab_size:,}, {tf.tokens.dtype.name}, {size:,} bytes) written to {tf.path}")


def _show_pipeline(config: Config, png: str | None, width: int | None,
                   task: Task | None) -> None:
    from jaxpar.pipeline import chart
    from jaxpar.run import build

    table = build(config, task).plan.pipeline
    if table is None:
        raise ConfigError(f"mesh.stage={config.mesh.stage}: there is no pipeline to show; "
                          "set mesh.stage to 2 or more")
    print(chart.text_grid(table, width))
    print(chart.summary(table))
    if png:
        print(f"chart written to {chart.write_png(table, png)}")


def _config(args: argparse.Namespace) -> Config:
    files = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if args.devices is not None:
        overrides.append(f"run.devices={args.devices}")
    run_dirs = [f for f in files if os.path.isdir(f)]
    if not run_dirs:
        return load_config(files, overrides)
    if len(files) > 1 or not os.path.isfile(os.path.join(run_dirs[0], "config.yaml")):
        raise ConfigError(f"'{run_dirs[0]}' is a directory: give a run directory (one holding "
                          "config.yaml) alone, or config files")
    import dataclasses

    config = load_config([os.path.join(run_dirs[0], "config.yaml")], overrides)
    if any(o.startswith("run.dir=") for o in overrides):
        return config
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=run_dirs[0]))


def _run(args: argparse.Namespace) -> None:
    """A command that takes a config (and optionally --task)."""
    config = _config(args)
    task = None
    if args.task:
        from jaxpar.user_code import load_task

        task = load_task(args.task, config)
        config = run_dir_for(config, task.name)
    # JAX is imported by now, but its backend starts only at first use.
    from jaxpar.distributed import initialize
    from jaxpar.mesh import setup_devices

    initialize(config.distributed)  # before anything touches a device
    setup_devices(config.run.devices)
    if args.command == "train":
        from jaxpar import resume
        from jaxpar.loop import train

        resume.HARD_SECOND_CTRL_C = True  # a second Ctrl-C ends the command at once
        try:
            train(config, task=task)
        finally:
            resume.HARD_SECOND_CTRL_C = False
    elif args.command == "pipeline":
        _show_pipeline(config, args.png, args.width, task)
    elif args.command == "export":
        _export(config, args.out, args.step, task, args.format)
    elif args.command == "sweep":
        _sweep(args, config, task)
    elif args.command == "plan":
        _plan(args, config, task)
    else:
        from jaxpar.report import format_report, layout_totals
        from jaxpar.run import build

        run = build(config, task)
        print(format_report(run, layout_totals(run)))


def _parse(argv: list[str] | None) -> argparse.Namespace:
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
    commands = next(a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    at = next((i for i, a in enumerate(argv) if a in commands), 0)
    if not at or {"-h", "--help"} & set(argv[:at]):
        return argv
    return [argv[at], *argv[:at], *argv[at + 1:]]


def _debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (anywhere before a launch's ``--``), and whether it
    was there."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--debug"]
    return head + argv[end:], len(head) != end


@contextlib.contextmanager
def _one_line_reports(debug: bool) -> Iterator[None]:
    """Keeps a failure's report to one line: warnings print as ``jaxpar: warning: …``, and
    the exceptions that libraries' background threads (Orbax's writer, grain's readers)
    log with tracebacks are left to the main thread, which reports the same error once.
    ``--debug`` keeps all of it. Everything is restored on return (``main`` may be called
    from Python)."""
    if debug:
        yield
        return
    saved = (warnings.formatwarning, threading.excepthook,
             {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}, sys.stderr)
    warnings.formatwarning = lambda message, *_: f"jaxpar: warning: {message}\n"
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)

    def excepthook(args: threading.ExceptHookArgs) -> None:
        if not issubclass(args.exc_type, Exception):
            saved[1](args)

    threading.excepthook = excepthook
    # a library's native thread prints the traceback of its Python callback straight to
    # sys.stderr (tensorstore's write callbacks after Orbax's event loop closed on a failed
    # save): the main thread reports the failure itself
    sys.stderr = _QuietNativeThreads(saved[3])
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        warnings.formatwarning, threading.excepthook = saved[0], saved[1]
        if not failed:  # after a failure the writer's callbacks may still fire, at exit
            sys.stderr = saved[3]
        for name, level in saved[2].items():
            # after a failure, a failed background write's asyncio task is logged when it is
            # collected, at exit: that stays silent (the failure was reported once)
            if not (failed and name == "asyncio"):
                logging.getLogger(name).setLevel(level)


class _QuietNativeThreads:
    """``sys.stderr`` that drops what threads started outside Python write (native
    library threads, seen by Python as dummy threads); everything else passes through."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        if isinstance(threading.current_thread(), threading._DummyThread):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_NOISY_LOGGERS = ("absl", "orbax", "jax._src.distributed", "grain", "asyncio")


def _failure(err: BaseException) -> tuple[int, str] | None:
    """The exit status and the one-line message of an error jaxpar explains, or None for
    one it does not (a bug: reported by :func:`_internal`)."""
    from jaxpar.checkpoint import disk_full_cause, free_space

    if isinstance(err, KeyboardInterrupt):
        return INTERRUPTED, ("jaxpar: interrupted (Ctrl-C); no checkpoint was written by this "
                             "interruption (the complete ones stay usable)")
    if isinstance(err, JaxparError):
        from jaxpar.distributed import PortInUse
        from jaxpar.launch import ENV_RETRY_PORT, PORT_TAKEN

        if isinstance(err, PortInUse) and os.environ.get(ENV_RETRY_PORT):
            return PORT_TAKEN, f"jaxpar: {err} (jaxpar launch tries another port)"
        kind = ("" if isinstance(err, Preempted) else "checkpoint error: "
                if isinstance(err, CheckpointError) else "stopped: "
                if isinstance(err, NonFiniteStop) else "error: ")
        return err.exit_status, f"jaxpar: {kind}{err}"
    if isinstance(err, OSError):
        where = f" '{err.filename}'" if err.filename else ""
        if disk_full_cause(err) is not None:
            space = free_space(err.filename) if err.filename else "free space unknown"
            return WRITE_FAILED, (
                f"jaxpar: disk full: writing{where} failed: No space left on device ({space} "
                "there); free space and run the same command to resume from the last "
                "checkpoint")
        text = err.strerror or str(err)
        status = BAD_INPUT if err.errno in _PATH_ERRNOS else WRITE_FAILED
        return status, f"jaxpar: error: {text}:{where}" if where else f"jaxpar: error: {text}"
    return None


def _internal(err: BaseException, debug: bool) -> tuple[int, str]:
    """An exception jaxpar does not explain is a bug — in jaxpar, in JAX or in a model's own
    code — never the user's bad input: one line saying so and where the traceback is."""
    text = "".join(traceback.format_exception(err))
    if debug:
        where = "above"
        print(text, file=sys.stderr, end="", flush=True)
    else:
        fd, path = tempfile.mkstemp(prefix="jaxpar-internal-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        where = f"in {path} (or run with JAXPAR_DEBUG=1)"
    first = (str(err).strip().splitlines() or [""])[0]
    return INTERNAL, (f"jaxpar: internal error: {type(err).__name__}: {first} — not a setting "
                      "jaxpar checks, but a bug in jaxpar, JAX or the model's own code; the "
                      f"traceback is {where}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script; returns the exit status.

    Errors a user can fix, faults (disk full, a failed save, a non-finite run) and
    Ctrl-C print one line and return their exit status (see the module docstring);
    ``--debug`` or ``JAXPAR_DEBUG=1`` prints the traceback as well.
    """
    argv, debug_flag = _debug_flag(list(sys.argv[1:] if argv is None else argv))
    if debug_flag:
        os.environ["JAXPAR_DEBUG"] = "1"  # also for the processes of `jaxpar launch`
    args = _parse(argv)
    from jaxpar.launch import pin_from_env

    pin_from_env()  # a process started by `jaxpar launch --cpus-per-process`
    debug = os.environ.get("JAXPAR_DEBUG", "") not in ("", "0")
    try:
        with _one_line_reports(debug):
            if args.command == "prepare-data":  # needs no config
                _prepare_data(args)
                return 0
            if args.command == "launch":
                return _launch(args)
            if args.command == "sample":  # the run dir's config
                _sample(args)
                return 0
            if args.command == "plot":  # needs no config
                from jaxpar.plot import run as plot

                plot(args)
                return 0
            if getattr(args, "help_config", False):  # the keys, not a config
                from jaxpar.config_reference import reference

                print(reference(), end="")
                return 0
            _run(args)
    except SystemExit:
        raise
    except BaseException as err:
        failure = _failure(err)
        if failure is None:
            failure = _internal(err, debug)
        elif debug:
            traceback.print_exc()
        status, message = failure
        print(message, file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())


def console() -> None:
    """The ``jaxpar`` command (and ``python -m jaxpar``): :func:`main`, then exit with its
    status. After a failed checkpoint write the process ends without Python's shutdown,
    where the writer's leftover background tasks (tensorstore, asyncio) would print
    tracebacks about their closed event loop after the one-line report."""
    status = main()
    if status == WRITE_FAILED and os.environ.get("JAXPAR_DEBUG", "") in ("", "0"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
