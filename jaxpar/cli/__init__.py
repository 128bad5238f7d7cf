"""The ``jaxpar`` command: a thin layer that parses arguments (:mod:`jaxpar.cli.parser`,
whose help text lists every command and the exit statuses) and calls the Python API;
failures are reported by :mod:`jaxpar.cli.failures`.

This module imports nothing heavy at its top (no JAX). When this process is the command
(the console script, ``python -m jaxpar`` or ``-m jaxpar.cli``), its first statement installs
the start-up signal handlers, before its own imports and JAX's take their time, so that a
stop signal while the command starts is one line (:mod:`jaxpar.signals`); a program that
imports jaxpar.cli keeps its own handlers."""

from __future__ import annotations

from jaxpar import signals

if signals.is_command():  # before the imports below (E402 is waived for this file)
    signals.guard_imports()

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from jaxpar.cli.failures import failure_of, internal, one_line_reports
from jaxpar.cli.lab_commands import estimated, run_plan, run_sweep
from jaxpar.errors import INTERRUPTED, TERMINATED, WRITE_FAILED, ConfigError, Terminated

if TYPE_CHECKING:
    from jaxpar.config import Config
    from jaxpar.task import Task
    from jaxpar.weights import Defaults, Source

#: Exit status when writing a checkpoint (or another file) failed (tests import it here).
CHECKPOINT_FAILED = WRITE_FAILED


def _opened(args: argparse.Namespace, defaults: Defaults) -> Source:
    """The run dir or Hugging Face folder ``sample`` or ``eval`` looks at, its devices set
    up."""
    from jaxpar.mesh import setup_devices
    from jaxpar.weights import open_source

    bad = [a for a in args.args if "=" not in a]
    if bad:
        raise ConfigError(
            f"jaxpar {args.command} takes one RUN_DIR or FOLDER, then "
            f"section.key=value settings; got also {' '.join(bad)}"
        )
    overrides = [*args.args, *([f"run.devices={args.devices}"] if args.devices else [])]
    source = open_source(args.run_dir, overrides, trust_code=args.trust_code, defaults=defaults)
    setup_devices(source.config.run.devices)
    return source


def _sample(args: argparse.Namespace) -> None:
    from jaxpar.sample import folder_defaults, sample_source

    source = _opened(args, folder_defaults)
    out = sample_source(
        source,
        args.prompt,
        prompt_ids=args.prompt_ids,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        step=args.step,
        samples=args.samples,
        stop=args.stop,
    )
    where = source.where if out.step is None else f"step {out.step} of {source.where}"
    print(f"jaxpar: {where}", file=sys.stderr, flush=True)
    for i, (row, n) in enumerate(zip(out.tokens, out.lengths)):
        if i:
            print("\n---")
        if args.prompt is None:  # ids in, ids out (a stop token included)
            print(",".join(str(t) for t in [*out.prompt_tokens, *row[:n]]), flush=True)
        else:
            print(args.prompt + out.texts[i], flush=True)


def _eval(args: argparse.Namespace) -> None:
    from jaxpar.evaluation import evaluate_source
    from jaxpar.weights import shorter_sequences

    out = evaluate_source(_opened(args, shorter_sequences), batches=args.batches, step=args.step)
    print(out.json() if args.json else out.line(), flush=True)


def _launch(args: argparse.Namespace) -> int:
    from jaxpar.launch import launch

    command = args.jaxpar_args
    command = command[1:] if command[:1] == ["--"] else command
    return launch(
        args.processes,
        command,
        devices_per_process=args.devices_per_process,
        cpus_per_process=args.cpus_per_process,
        port=args.port,
        grace_s=args.grace,
        bind=args.bind,
    )


def _export(
    config: Config,
    out: str,
    step: int | None,
    task: Task | None,
    format: str = "npz",
    overwrite: bool = False,
) -> None:
    from jaxpar.export import export_params

    path, step = export_params(config, out, step, task=task, format=format, overwrite=overwrite)
    what, tokenizer = "parameters of", ""
    if format == "hf":
        from jaxpar import hf
        from jaxpar.export import run_tokenizer

        what = f"Hugging Face {hf.written_as(config.model)} files of"
        found = run_tokenizer(config)
        named = found is not None and "eos_token_id" in found[2]
        ends = " and its end-of-text id in generation_config.json" if named else ""
        tokenizer = (
            f", with the tokenizer {found[0]} as tokenizer.json{ends}"
            if found
            else "; no tokenizer written: the run reads UTF-8 bytes (or random ids), "
            "which no tokenizer.json describes"
        )
    print(f"{what} step {step} written to {path}{tokenizer}")


def _prepare_data(args: argparse.Namespace) -> None:
    from jaxpar.data.prepare import prepare_data
    from jaxpar.outputs import check_new_file

    # never a run's own file nor a held folder (an existing --out: prepare_data says)
    check_new_file(args.out, "--out", overwrite=True)
    if args.records != "text" and args.workers > 1:
        raise ConfigError(
            f"--workers {args.workers} applies to --records text; fine-tuning "
            "records are encoded in this process: drop --workers"
        )
    if args.records == "text":
        tf = prepare_data(
            args.inputs,
            args.out,
            args.tokenizer,
            args.glob,
            text_key=args.text_key,
            bos=args.bos,
            eos=args.eos,
            workers=args.workers or None,
            overwrite=args.overwrite,
        )
    else:
        from jaxpar.data.finetune import Keys, prepare_records

        keys = Keys(args.prompt_key, args.completion_key, args.messages_key)
        tf = prepare_records(
            args.inputs,
            args.out,
            args.tokenizer,
            args.glob,
            layout=args.records,
            keys=keys,
            bos=args.bos,
            eos=args.eos,
            overwrite=args.overwrite,
        )
    size, docs = tf.num_tokens * tf.tokens.dtype.itemsize, len(tf.documents)
    print(
        f"{tf.num_tokens:,} tokens from {docs:,} document{'s' * (docs != 1)} "
        f"(vocab {tf.vocab_size:,}, {tf.tokens.dtype.name}, {size:,} bytes) written to {tf.path}"
    )


_EXECUTORS = {
    "spmd": "executor: spmd (one program; every device runs one action a tick, in lockstep)",
    "mpmd": "executor: mpmd (a program per action on its stage's devices, dispatched in tick "
    "order; a stage waits only for its inputs)",
}


def _show_pipeline(
    config: Config, png: str | None, width: int | None, task: Task | None, overwrite: bool = False
) -> None:
    from jaxpar.outputs import check_new_file
    from jaxpar.pipeline import chart
    from jaxpar.run import build

    if png:
        check_new_file(png, "--png", overwrite)
    plan = build(config, task).plan
    table = plan.pipeline
    if table is None:
        raise ConfigError(
            f"mesh.stage={config.mesh.stage}: there is no pipeline to show; "
            "set mesh.stage to 2 or more"
        )
    print(chart.text_grid(table, width))
    print(chart.summary(table))
    print(_EXECUTORS[plan.executor])
    if png:
        print(f"chart written to {chart.write_png(table, png)}")


def _config(args: argparse.Namespace) -> Config:
    from jaxpar.config import load_config

    files = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if args.devices is not None and not estimated(args):
        overrides.append(f"run.devices={args.devices}")
    run_dirs = [f for f in files if os.path.isdir(f)]
    if not run_dirs:
        return load_config(files, overrides)
    if len(files) > 1 or not os.path.isfile(os.path.join(run_dirs[0], "config.yaml")):
        raise ConfigError(
            f"'{run_dirs[0]}' is a directory: give a run directory (one holding "
            "config.yaml) alone, or config files"
        )

    from jaxpar.user_code import refuse_run_dir_code

    saved = Path(run_dirs[0]) / "config.yaml"
    refuse_run_dir_code(saved, overrides, hooks=args.command == "train", trust=args.trust_code)
    config = load_config([saved], overrides)
    if any(o.startswith("run.dir=") for o in overrides):
        return config
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=run_dirs[0]))


def _run(args: argparse.Namespace) -> None:
    """A command that takes a config (and optionally --task)."""
    config = _config(args)
    task = None
    if args.task:
        from jaxpar.config import run_dir_for
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
        _show_pipeline(config, args.png, args.width, task, args.overwrite)
    elif args.command == "export":
        _export(config, args.out, args.step, task, args.format, args.overwrite)
    elif args.command == "sweep":
        run_sweep(args, config, task)
    elif args.command == "plan":
        run_plan(args, config, task)
    else:
        from jaxpar.report import format_report, layout_totals
        from jaxpar.run import build

        run = build(config, task)
        print(format_report(run, layout_totals(run)))


#: What a command imports before its own phase begins (:func:`signals.raising`): a stop
#: signal while these load — JAX's import takes seconds — is the start-up's one line
#: ("while starting; nothing was written"), whatever the command.
_LIGHT_COMMANDS = {
    "prepare-data": ("jaxpar.data.prepare",),
    "launch": ("jaxpar.launch",),
    "plot": ("jaxpar.plot",),
}
_JAX_COMMAND = ("jax", "jaxpar.config", "jaxpar.run", "jaxpar.loop")


def import_for(command: str) -> None:
    """Imports what ``command`` needs (see :data:`_LIGHT_COMMANDS`)."""
    for module in _LIGHT_COMMANDS.get(command, _JAX_COMMAND):
        importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script; returns the exit status.

    Errors a user can fix, faults (disk full, a failed save, a non-finite run) and
    Ctrl-C print one line and return their exit status (see the module docstring);
    ``--debug`` or ``JAXPAR_DEBUG=1`` prints the traceback as well.
    """
    from jaxpar.cli.parser import debug_flag, parse

    argv, debug_given = debug_flag(list(sys.argv[1:] if argv is None else argv))
    if debug_given:
        os.environ["JAXPAR_DEBUG"] = "1"  # also for the processes of `jaxpar launch`
    args = parse(argv)
    from jaxpar.launch import pin_from_env

    pin_from_env()  # a process started by `jaxpar launch --cpus-per-process`
    debug = os.environ.get("JAXPAR_DEBUG", "") not in ("", "0")
    import_for(args.command)
    try:
        with one_line_reports(debug), signals.raising():
            if args.command == "prepare-data":  # needs no config
                _prepare_data(args)
                return 0
            if args.command == "launch":
                return _launch(args)
            if args.command == "sample":  # a run dir's or a folder's config
                _sample(args)
                return 0
            if args.command == "eval":  # likewise
                _eval(args)
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
            signals.raise_pending()  # a signal whose exception a library swallowed
    except SystemExit:
        raise
    except BaseException as err:
        return _report(err, debug, args.command)
    return 0


def _report(err: BaseException, debug: bool, command: str = "train") -> int:
    """Prints ``err``'s one line (and with ``debug`` its traceback); its exit status."""
    signals.clear()
    failure = failure_of(err)
    if failure is None:
        failure = internal(err, debug)
    elif debug:
        traceback.print_exc()
    status, message = failure
    if isinstance(err, (KeyboardInterrupt, Terminated)) and command not in (
        "train",
        "launch",
        "prepare-data",
    ):  # those say what they kept
        message = signals.stopped_line(err, command)
    print(message, file=sys.stderr, flush=True)
    return status


@contextlib.contextmanager
def as_command() -> Iterator[None]:
    """A research script's end as ``jaxpar train``'s: a failure inside the block prints
    its one line and exits with the command's status (4 after a SIGTERM or a first Ctrl-C
    with the checkpoint written, 2 for bad input, 70 for a bug, … : docs/failures.md), so
    a job script acts on it as on the command's::

        with jaxpar.cli.as_command():
            jaxpar.train(config, task=TASK)

    ``JAXPAR_DEBUG=1`` prints the traceback too. It exits through ``sys.exit``, so the
    caller's ``finally`` blocks and ``atexit`` handlers run."""
    debug = os.environ.get("JAXPAR_DEBUG", "") not in ("", "0")
    try:
        with one_line_reports(debug):
            yield
    except SystemExit:
        raise
    except BaseException as err:
        sys.exit(_report(err, debug))  # the caller's finally blocks and atexit handlers run


def _exit(status: int) -> NoReturn:
    """Ends the process with ``status``. After a failed checkpoint write the process ends
    without Python's shutdown, where the writer's leftover background tasks (tensorstore,
    asyncio) would print tracebacks about their closed event loop after the one-line
    report; so it does after a stop signal in a single process, where shutdown would wait
    for the compilations XLA's threads still run (or crash in them: exit 139, not 143)."""
    quiet = os.environ.get("JAXPAR_DEBUG", "") in ("", "0")
    if (status == WRITE_FAILED and quiet) or (
        status in (INTERRUPTED, TERMINATED) and not _distributed()
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def console() -> None:
    """The ``jaxpar`` command (and ``python -m jaxpar``): :func:`main`, then exit with its
    status (:func:`_exit`).

    The start-up signal handlers are installed by this module's first statement, when the
    process is the command; here again for a caller that named this function itself."""
    signals.guard_imports()
    _exit(main())


def _distributed() -> bool:
    """Whether JAX's distributed runtime is up (its shutdown tells the other processes)."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()
