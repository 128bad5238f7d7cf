"""The layout lab's commands, ``jaxpar sweep`` and ``jaxpar plan``: each parses nothing
(:mod:`jaxpar.cli.parser` did) and calls :mod:`jaxpar.lab`, importing it only when run."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from jaxpar.errors import ConfigError, Terminated

if TYPE_CHECKING:
    from pathlib import Path

    from jaxpar.config import Config
    from jaxpar.lab.hardware import Hardware
    from jaxpar.task import Task


def checked_layouts(config: Config, layouts: list[str] | None) -> None:
    """``--layouts`` against ``config``: a key or value that no config takes (a typo) is
    refused in one line as the command line is read, as an unknown axis is; a layout that
    is well formed but cannot run (a degree that does not divide) is the lab's row.

    Raises:
      ConfigError: naming the layout, the key and the fix.
    """
    from jaxpar.config import apply_overrides
    from jaxpar.lab.measure import layout_overrides

    for layout in layouts or ():
        try:
            apply_overrides(config, layout_overrides(layout))
        except ConfigError as err:
            raise ConfigError(f"layout '{layout}': {err}") from None


def run_sweep(args: argparse.Namespace, config: Config, task: Task | None) -> None:
    from jaxpar.lab import resume, sweep, sweep_files
    from jaxpar.lab.hardware import get_profile
    from jaxpar.mesh import select_devices

    if bool(args.layouts) == bool(args.all):
        raise ConfigError("jaxpar sweep needs either --layouts L … or --all (not both)")
    checked_layouts(config, args.layouts)
    hw = get_profile(args.hardware, args.hardware_file)
    memory = args.memory_gb * 1e9 if args.memory_gb else None
    devices = select_devices(config.run.devices)
    if args.out is not None:  # an unusable --out is refused before anything is planned
        sweep_files.output_folder(args.out, config.run.dir, args.overwrite, None, create=False)
    layouts, note = list(dict.fromkeys(args.layouts or ())), None
    if len(layouts) < len(args.layouts or ()):
        note = "note: a layout named twice in --layouts is measured once"
    if not layouts:
        # timed layouts run here; others are read for the profile's platform (measure.lower)
        platform = None if args.steps else hw.platform
        layouts, note = sweep.microbatched(
            config, *sweep.default_layouts(config, len(devices), task, platform)
        )
    key = resume.command_key(config, layouts, args.task, args.steps, hw, memory, devices)
    out = sweep_files.output_folder(
        args.out, config.run.dir, args.overwrite, key
    )  # before compiling
    what = (task.name or "the --task") if task is not None else config.family.name
    print(
        f"sweeping {len(layouts)} layout{'s' * (len(layouts) != 1)} of {what} "
        f"(global batch {config.train.batch_size})",
        flush=True,
    )
    if note:
        print(note, flush=True)
    with resume.holding(out):
        _measure(config, task, args, hw, memory, layouts, key, out)


def _measure(
    config: Config,
    task: Task | None,
    args: argparse.Namespace,
    hw: Hardware,
    memory: float | None,
    layouts: list[str],
    key: dict,
    out: Path,
) -> None:
    """The sweep's layouts measured into ``out`` (which the sweep holds), but those a
    stopped run of the same command kept there; each row kept on disk as it comes."""
    from jaxpar.lab import resume, sweep, sweep_files

    before = [] if args.overwrite else resume.kept_rows(out, key)
    resume.keep(out, key, before)  # the folder names its command from the start
    if before:
        print(
            f"resuming: {len(before)} of {len(layouts)} layouts were measured by a stopped "
            f"run of this command ({out / resume.PARTIAL}); measuring the other "
            f"{len(layouts) - len(before)}",
            flush=True,
        )
    finished = list(before)

    def done(row) -> None:  # each row on disk as it comes: a stop loses only those in flight
        finished.append(row)
        resume.keep(out, key, finished)

    measured = {r.layout for r in before}
    try:
        rows = sweep.sweep(
            config,
            [x for x in layouts if x not in measured],
            hw,
            args.steps,
            memory,
            echo=True,
            task=task,
            done=done,
            among=layouts,
        )
    except (KeyboardInterrupt, Terminated):
        if finished:  # what was measured is shown and kept for the same command
            print(
                f"measured before the stop ({len(finished)} of {len(layouts)} layouts, kept in "
                f"{out / resume.PARTIAL}: the same command measures only the other "
                f"{len(layouts) - len(finished)}):\n"
                f"{sweep_files.format_table(_ordered(finished, layouts), hw)}",
                flush=True,
            )
        raise
    rows = _ordered(before + rows, layouts)
    print(sweep_files.format_table(rows, hw))
    for path in sweep_files.write_outputs(rows, hw, out):
        print(f"wrote {path}")
    resume.done(out)


def _ordered(rows: list, layouts: list[str]) -> list:
    return sorted(rows, key=lambda r: layouts.index(r.layout))


def estimated(args: argparse.Namespace) -> bool:
    """Whether ``plan`` estimates its layouts rather than compiling them on ``--devices``
    simulated devices (``--analytic``, or more devices than compile here)."""
    from jaxpar.limits import COMPILED_DEVICES

    if args.command != "plan" or args.longest:  # --longest compiles: its devices are set up
        return False
    return args.analytic or args.devices > COMPILED_DEVICES


def run_plan(args: argparse.Namespace, config: Config, task: Task | None) -> None:
    from jaxpar.lab.hardware import get_profile
    from jaxpar.lab.longest import format_longest, longest_sequence
    from jaxpar.lab.plan_text import ESTIMATED_TOP, format_plan
    from jaxpar.lab.planner import plan, plan_folder
    from jaxpar.lab.sweep_files import write_csv

    checked_layouts(config, args.layouts)
    _warn_mesh_overrides(args.args, args.devices)
    hw = get_profile(args.hardware, args.hardware_file)
    if args.fit:
        hw = _fitted(args.fit, hw)
    memory = args.memory_gb * 1e9 if args.memory_gb else hw.memory_bytes
    what = (task.name or "the --task") if task is not None else config.family.name
    if args.longest:
        if args.out:
            raise ConfigError("jaxpar plan --longest writes no plan.csv: leave out --out")
        if not args.layouts:
            raise ConfigError(
                "jaxpar plan --longest needs --layouts L …: the layouts whose "
                "longest sequence to find"
            )
        print(
            f"the longest sequence of {what} (global batch {config.train.batch_size}, "
            f"from data.seq_len={config.data.seq_len}, doubling) on {args.devices} × "
            f"{hw.name}",
            flush=True,
        )
        found = [longest_sequence(config, layout, hw, memory, task) for layout in args.layouts]
        print(format_longest(found, memory))
        return
    out = plan_folder(args.out, args.overwrite) if args.out else None  # before compiling
    print(
        f"planning {what} (global batch {config.train.batch_size}) on {args.devices} × {hw.name}",
        flush=True,
    )
    ranked = plan(
        config,
        args.devices,
        hw,
        memory,
        args.layouts,
        echo=True,
        task=task,
        analytic=estimated(args),
    )
    top = args.top if args.top is not None else ESTIMATED_TOP if estimated(args) else 0
    print(format_plan(ranked, hw, memory, top))
    if out is not None:
        print(f"wrote {write_csv([p.row for p in ranked], out / 'plan.csv')}")


def _warn_mesh_overrides(given: list[str], devices: int) -> None:
    """A plan sets every mesh degree itself: ``mesh.<axis>=N`` on its command line would be
    silently replaced, so it is warned of, with the layout it names."""
    import warnings

    from jaxpar.axes import MESH_AXES

    degrees = [
        a.removeprefix("mesh.")
        for a in given
        if a.startswith("mesh.") and a.partition("=")[0].removeprefix("mesh.") in MESH_AXES
    ]
    if degrees:
        warnings.warn(
            f"{', '.join('mesh.' + d for d in degrees)} "
            f"{'has' if len(degrees) == 1 else 'have'} no effect on jaxpar plan, which "
            f"plans every layout of --devices {devices} (or those of --layouts); to plan this "
            f"one: --layouts {','.join(degrees)}",
            stacklevel=2,
        )


def _fitted(paths: list[str], base: Hardware) -> Hardware:
    """``base`` fitted to the steps timed in ``paths`` (its platform the one they were
    timed on); says how well it ranks layouts it was not fitted on and which constants it
    kept, and prints it as a --hardware-file entry."""
    import jax

    from jaxpar.lab import fit

    rows = fit.read_sweeps(paths)
    # the machine that timed the steps (a sweep written before it said: this one)
    base = dataclasses.replace(base, platform=fit.timed_on(paths) or jax.default_backend())
    named = " and ".join(paths)
    hw = fit.fit_profile(rows, base, source=f"fitted to {len(rows)} layouts of {named}")
    first, second = fit.held_out(rows, base)
    kept = fit.unseen(rows, hw.latency_per)
    if kept:
        why = "; ".join(fit.UNSEEN_WHY[k] for k in fit.CONSTANTS if k in kept)
        print(f"kept from the {base.key} profile, which the steps cannot show: {why}", flush=True)
    if len(paths) > 1:
        print(
            f"the {len(paths)} sweeps rank their layouts alike with Spearman rho "
            f"{fit.agreement(paths):.2f} (each pair's, averaged): a fit to one of them could "
            "not rank held-out layouts much better",
            flush=True,
        )
    print(
        f"fitted to {len(rows)} timed layouts of {named}; on layouts it was not fitted on "
        f"(every other one, each half in turn) it ranks with Spearman rho {first:.2f} and "
        f"{second:.2f}. As a --hardware-file entry:\n{fit.profile_yaml(hw)}",
        flush=True,
    )
    if min(first, second) < fit.GOOD_RHO:
        print(
            f"warning: a weak fit (rho below {fit.GOOD_RHO}): its ranking of layouts it was "
            "not fitted on is little better than a guess; time more steps a layout "
            "(--steps) or more layouts, or --fit several sweeps of the same layouts",
            flush=True,
        )
    return hw
