"""The ``jaxpar`` command: a thin layer that parses arguments and calls the Python API.

    jaxpar train   [CONFIG.yaml …] [section.key=value …] [--devices N]
    jaxpar inspect [CONFIG.yaml …] [section.key=value …] [--devices N]

With no CONFIG the default config (``configs/gpt_tiny.yaml``'s settings) is used.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.config import Config, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "train a model"),
                       ("inspect", "print where every parameter lives, without training")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value",
                         help="YAML files (later ones win), then overrides such as mesh.fsdp=8")
        cmd.add_argument("--devices", type=int, default=None,
                         help="device count (simulated CPU devices when there is no accelerator)")
    return parser


def _config(args: argparse.Namespace) -> Config:
    files = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if args.devices is not None:
        overrides.append(f"run.devices={args.devices}")
    return load_config(files, overrides)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        config = _config(args)
        # JAX is imported by now, but its backend starts only at first use.
        from jaxpar.mesh import setup_devices

        setup_devices(config.run.devices)
        if args.command == "train":
            from jaxpar.loop import train

            train(config)
        else:
            from jaxpar.loop import build
            from jaxpar.report import format_report, layout_totals

            run = build(config)
            print(format_report(run, layout_totals(run)))
    except ValueError as err:  # a user mistake: the message says what to fix
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # train.nonfinite=stop
        print(f"jaxpar: stopped: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
