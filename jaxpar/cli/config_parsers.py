"""The parsers of the commands that take a config: ``train``, ``inspect``, ``pipeline``,
``export``, and the layout lab's ``sweep`` and ``plan``."""

from __future__ import annotations

import argparse

from jaxpar.cli.options import (
    STEP,
    count,
    devices_argument,
    gigabytes,
    layout,
    overwrite_argument,
    task_argument,
)
from jaxpar.limits import COMPILED_DEVICES, MAX_DEVICES


def config_arguments(cmd: argparse.ArgumentParser, text: str) -> None:
    """A config command's YAML files and overrides (``text``: their help)."""
    cmd.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value", help=text)


def config_parsers(sub: argparse._SubParsersAction) -> None:
    """``train``, ``inspect``, ``pipeline`` and ``export``: commands that take a config."""
    for name, text in (
        ("train", "train a model"),
        ("inspect", "print where every parameter lives, without training"),
        ("pipeline", "print (and draw) the pipeline schedule of a config"),
        ("export", "write a checkpoint's parameters to an .npz file"),
    ):
        cmd = sub.add_parser(name, help=text)
        config_arguments(cmd, "YAML files (later ones win), then overrides such as mesh.fsdp=8")
        devices_argument(cmd)
        task_argument(cmd)
        if name == "train":
            cmd.add_argument(
                "--help-config",
                action="store_true",
                help="print the reference of every config key (Markdown, as in "
                "docs/config.md) and exit",
            )
        if name == "pipeline":
            _pipeline_arguments(cmd)
        if name == "export":
            _export_arguments(cmd)


def _pipeline_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--png",
        default=None,
        metavar="PATH",
        help="also write the schedule chart (PNG; a path ending in .svg writes SVG)",
    )
    overwrite_argument(cmd, "an existing --png file")
    cmd.add_argument(
        "--width",
        type=count(100_000, 1),
        default=None,
        help="wrap the text grid at this many columns",
    )


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
        "--step", type=STEP, default=None, help="the checkpoint step (default: the latest)"
    )
    cmd.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file, or the model files (config.json, "
        "safetensors, tokenizer) of a non-empty --out directory; without "
        "it either is refused",
    )


def lab_parsers(sub: argparse._SubParsersAction) -> None:
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
        _lab_arguments(cmd)
    plan.add_argument(
        "--longest",
        action="store_true",
        help="for each of --layouts, the longest data.seq_len that fits "
        "(doubling from the config's)",
    )
    _sweep_arguments(sweep)
    plan.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="also write the ranking as DIR/plan.csv (predicted step time, tokens/s per "
        "device, MFU, the roofline's terms, memory, collectives)",
    )
    overwrite_argument(plan, "plan.csv in a --out folder that holds files")
    plan.add_argument(
        "--fit",
        default=None,
        nargs="+",
        metavar="SWEEP.csv",
        help="predict with a profile fitted to the steps a `jaxpar sweep --steps N` timed on "
        "this machine (instead of --hardware's datasheet figures; its memory kept); several "
        "sweeps of the same layouts: each layout's time their geometric mean",
    )
    plan.add_argument(
        "--devices",
        type=count(MAX_DEVICES, 1),
        required=True,
        help="how many devices to plan for (simulated on the CPU to compile; above "
        f"{COMPILED_DEVICES}, estimated from the model's shape as with --analytic)",
    )
    plan.add_argument(
        "--top",
        type=count(10**6),
        metavar="N",
        help="print the N fastest layouts that fit, and the first N that do not fit or cannot "
        "run, counting the rest (0: all; default: all when compiled, 20 when estimated); "
        "--out writes them all",
    )
    plan.add_argument(
        "--analytic",
        action="store_true",
        help="estimate each layout from the model's shape instead of compiling it: FLOPs, "
        "state, activations and collectives, for any --devices (docs/lab.md)",
    )


def _lab_arguments(cmd: argparse.ArgumentParser) -> None:
    """What ``sweep`` and ``plan`` share: the config, the hardware, the layouts."""
    config_arguments(cmd, "YAML files (later ones win), then overrides")
    cmd.add_argument(
        "--hardware",
        default=None,
        help="hardware profile for the predicted step time (a100_40, a100, h100 (the "
        "default), a3_high, h200, b200, gb200, or one from --hardware-file)",
    )
    cmd.add_argument(
        "--hardware-file",
        default=None,
        metavar="PATH",
        help="a YAML file of extra hardware profiles (see jaxpar/lab/hardware.yaml)",
    )
    cmd.add_argument(
        "--memory-gb",
        type=gigabytes,
        default=None,
        metavar="G",
        help="device memory that 'fits' is judged against (default: the hardware profile's)",
    )
    cmd.add_argument(
        "--layouts",
        nargs="+",
        type=layout,
        default=None,
        metavar="LAYOUT",
        help='layouts such as "data=8" "fsdp=4,stage=2" (axes left out are 1)',
    )
    task_argument(cmd)


def _sweep_arguments(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument(
        "--all",
        action="store_true",
        help="every way to factor the device count over data/fsdp/context/tensor/stage",
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
        type=count(10**6),
        default=5,
        help="timed steps per layout after 2 warm-up steps (0: compile only)",
    )
    devices_argument(sweep)
