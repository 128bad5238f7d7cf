"""The ``jaxpar`` command: a thin layer that parses arguments and calls the Python API.

    jaxpar train    [CONFIG.yaml …] [section.key=value …] [--devices N]
    jaxpar inspect  [CONFIG.yaml …] [section.key=value …] [--devices N]
    jaxpar pipeline [CONFIG.yaml …] [section.key=value …] [--devices N] [--png PATH] [--width N]
    jaxpar export   [CONFIG.yaml …] [section.key=value …] [--devices N] --out PARAMS.npz [--step N]
    jaxpar prepare-data INPUT… --out PATH [--tokenizer byte|TOKENIZER.json] [--glob PATTERN]
    jaxpar launch   -n N [--devices-per-process K] [--cpus-per-process C] -- COMMAND [ARGS…]

With no CONFIG the default config (``configs/gpt_tiny.yaml``'s settings) is used.
``prepare-data`` takes no config: it turns local text files and folders into a token file
(``PATH`` plus ``PATH.json``) that training memory-maps.
Exit status: 0 done, 2 bad input, 3 non-finite stop, 4 preempted (SIGTERM; checkpoint
written), 5 a checkpoint could not be written (the complete ones stay usable).
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.config import Config, load_config

#: Exit status after a SIGTERM: the checkpoint of the current step is complete on disk.
PREEMPTED = 4
#: Exit status when writing a checkpoint failed (also an asynchronous save found at exit).
CHECKPOINT_FAILED = 5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
        if name == "pipeline":
            cmd.add_argument("--png", default=None, metavar="PATH",
                             help="also write the schedule chart as a PNG")
            cmd.add_argument("--width", type=int, default=None,
                             help="wrap the text grid at this many columns")
        if name == "export":
            cmd.add_argument("--out", required=True, metavar="PARAMS.npz",
                             help="where to write the parameters ('blocks/w_in' → array)")
            cmd.add_argument("--step", type=int, default=None,
                             help="the checkpoint step (default: the latest)")
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
    run.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    run.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                     help="after a failure, how long the others get to stop before SIGKILL")
    run.add_argument("jaxpar_args", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="after --: the jaxpar command and its arguments, e.g. train mesh.fsdp=8")
    return parser


def _launch(args: argparse.Namespace) -> int:
    from jaxpar.launch import launch

    command = args.jaxpar_args
    command = command[1:] if command[:1] == ["--"] else command
    return launch(args.processes, command, devices_per_process=args.devices_per_process,
                  cpus_per_process=args.cpus_per_process, port=args.port, grace_s=args.grace)


def _export(config: Config, out: str, step: int | None) -> None:
    from jaxpar.resume import export_params

    path, step = export_params(config, out, step)
    print(f"parameters of step {step} written to {path}")


def _prepare_data(args: argparse.Namespace) -> None:
    from jaxpar.data.prepare import prepare_data

    tf = prepare_data(args.inputs, args.out, args.tokenizer, args.glob)
    size, docs = tf.num_tokens * tf.tokens.dtype.itemsize, len(tf.documents)
    print(f"{tf.num_tokens:,} tokens from {docs:,} document{'s' * (docs != 1)} "
          f"(vocab {tf.vocab_size:,}, {tf.tokens.dtype.name}, {size:,} bytes) written to {tf.path}")


def _show_pipeline(config: Config, png: str | None, width: int | None) -> None:
    from jaxpar.pipeline import chart
    from jaxpar.run import build

    table = build(config).trainer.pipeline
    if table is None:
        raise ValueError(f"mesh.stage={config.mesh.stage}: there is no pipeline to show; "
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
    return load_config(files, overrides)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    from jaxpar.launch import pin_from_env

    pin_from_env()  # a process started by `jaxpar launch --cpus-per-process`
    try:
        if args.command == "prepare-data":  # needs no config
            _prepare_data(args)
            return 0
        if args.command == "launch":
            return _launch(args)
        config = _config(args)
        # JAX is imported by now, but its backend starts only at first use.
        from jaxpar.distributed import initialize
        from jaxpar.mesh import setup_devices

        initialize(config.distributed)  # before anything touches a device
        setup_devices(config.run.devices)
        if args.command == "train":
            from jaxpar.loop import train

            train(config)
        elif args.command == "pipeline":
            _show_pipeline(config, args.png, args.width)
        elif args.command == "export":
            _export(config, args.out, args.step)
        else:
            from jaxpar.report import format_report, layout_totals
            from jaxpar.run import build

            run = build(config)
            print(format_report(run, layout_totals(run)))
    except ValueError as err:  # a user mistake: the message says what to fix
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # train.nonfinite=stop
        print(f"jaxpar: stopped: {err}", file=sys.stderr)
        return 3
    except Exception as err:
        from jaxpar.checkpoint import CheckpointError
        from jaxpar.resume import Preempted

        if isinstance(err, CheckpointError):
            print(f"jaxpar: checkpoint error: {err}", file=sys.stderr)
            return CHECKPOINT_FAILED
        if not isinstance(err, Preempted):
            raise
        print(f"jaxpar: {err}", file=sys.stderr)
        return PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
