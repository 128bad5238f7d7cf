"""What the ``jaxpar`` commands' parsers share: option types that refuse a bad value in one
line, and the arguments several commands take (``--overwrite``, ``--task``,
``--trust-code``, a run dir's)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from jaxpar.axes import MESH_AXES
from jaxpar.files import shorten
from jaxpar.limits import MAX_DEVICES, MAX_STEPS


def count(high: int, low: int | None = 0) -> Callable[[str], int]:
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


def number(low: float, high: float, what: str, low_included: bool = True) -> Callable[[str], float]:
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
gigabytes = number(0, 10**6, "a memory size in GB", low_included=False)
#: ``launch --grace``'s type: seconds, up to a day.
seconds = number(0, 86_400, "a time in seconds")
#: ``--devices``' type: a device count (0: all), at most MAX_DEVICES (the same bound as
#: run.devices; without an accelerator jaxpar.mesh refuses more than MAX_CPU_DEVICES).
DEVICES = count(MAX_DEVICES)
#: ``--step``'s type: a checkpoint's step.
STEP = count(MAX_STEPS)


def layout(text: str) -> str:
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


def token_ids(text: str) -> tuple[int, ...]:
    """``--prompt-ids``' type: comma-separated whole numbers."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expects token ids separated by commas, e.g. 1,2,3; got {shorten(text, 40)!r}"
        ) from None


def stop_ids(text: str) -> str | tuple[int, ...]:
    """``--stop``'s type: ``auto``, ``none`` or :func:`token_ids`."""
    return text if text in ("auto", "none") else token_ids(text)


def overwrite_argument(cmd: argparse.ArgumentParser, what: str) -> None:
    """A writing command's ``--overwrite`` (``what``: what it replaces)."""
    cmd.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace {what}; without it that is refused (a run's own files "
        "and a running run's directory never are written)",
    )


def devices_argument(cmd: argparse.ArgumentParser) -> None:
    """``--devices``: the device count of a command that runs a config."""
    cmd.add_argument(
        "--devices",
        type=DEVICES,
        default=None,
        help="device count (simulated CPU devices when there is no accelerator)",
    )


def trust_argument(cmd: argparse.ArgumentParser) -> None:
    """``--trust-code``: whether code a run directory's config names may run."""
    cmd.add_argument(
        "--trust-code",
        action="store_true",
        help="import the code a run directory's config.yaml names (model.name="
        "FILE:NAME, train.hooks); without it only code named on the command "
        "line runs",
    )


def task_argument(cmd: argparse.ArgumentParser) -> None:
    """``--task`` (and ``--trust-code``): a user's task in place of the built-in model."""
    trust_argument(cmd)
    cmd.add_argument(
        "--task",
        default=None,
        metavar="FILE.py:NAME",
        help="train your own model: a jaxpar.Task (or a function returning one) "
        "in a Python file or module (package.module:NAME)",
    )
