"""What a plan says beside its rows: the layouts it leaves out (a ``tensor`` group beyond
an NVLink domain, stages that cannot cut the model's layers), whose memory a compiled row
reports, and a rule some of its own layouts cannot split, as one note."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

import jax

from jaxpar.axes import Axis
from jaxpar.config import Config
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.plan_fixes import degrees
from jaxpar.lab.sweep import count_layouts
from jaxpar.task import Task


def within_domains(layouts: list[str], note: str | None, hw: Hardware) -> tuple[list[str], str]:
    """``layouts`` less those whose ``tensor`` group spans more than one of ``hw``'s NVLink
    domains (their every layer's activation all-reduces would cross the network: Megatron-LM
    SC'21 keeps tensor parallelism inside a node), and the note saying so."""
    domain = hw.domain_devices
    kept = [x for x in layouts if not domain or degrees(x)[Axis.TENSOR] <= domain]
    if len(kept) < len(layouts):
        left = (
            f"note: {count_layouts(len(layouts) - len(kept))} with mesh.tensor above the "
            f"{domain} GPUs of one NVLink domain left out (each layer's activations would "
            "cross the network); name them with --layouts to plan them"
        )
        note = f"{note}\n{left}" if note else left
    return kept, note


def cuttable(
    layouts: list[str], note: str | None, config: Config, task: Task | None
) -> tuple[list[str], str]:
    """``layouts`` less those whose stages cannot hold equal shares of a built-in model's
    layers (they cannot run: either executor cuts a stack of layers into ``stage ×
    virtual stages`` equal chunks), and the note saying so; all of them for a user's task
    (its layers are its own) or a model that does not name its layer count."""
    layers = getattr(config.model, "n_layers", None)
    chunks = config.pipeline.virtual_stages
    if task is not None or not isinstance(layers, int):
        return layouts, note
    kept = [x for x in layouts if layers % (degrees(x)[Axis.STAGE] * chunks) == 0]
    if len(kept) < len(layouts):
        cut = {degrees(x)[Axis.STAGE] for x in kept}
        stages = sorted({degrees(x)[Axis.STAGE] for x in layouts} - cut)
        left = (
            f"note: {count_layouts(len(layouts) - len(kept))} with mesh.stage "
            f"{', '.join(map(str, stages))} left out: {layers} layers do not cut into that "
            f"many equal chunks (× pipeline.virtual_stages={chunks})"
        )
        note = f"{note}\n{left}" if note else left
    return kept, note


#: the warning of a rule that cannot split a dim (:func:`jaxpar.sharding.fit_soft_rules`)
_SOFT = re.compile(r"rules\.(\w+)=.*: (\d+) \w+ of '.*' do not split (\d+) ways")


@contextlib.contextmanager
def soft_rules_once() -> Iterator[list[str]]:
    """Around measuring a plan's layouts: a rule that cannot split a dim in some of them
    (8 K/V heads over ``tensor=16``: held whole on each device, as the rows count them) is
    a warning for a run that names it; in a plan of layouts the plan chose, one note (the
    list yielded, filled on exit). Other warnings pass as they are."""
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield notes
    splits: dict[tuple[str, str], set[int]] = {}
    said: set[str] = set()
    for w in seen:
        found = _SOFT.search(str(w.message))
        if found is None:
            if str(w.message) not in said:  # once each, as the default filter shows them
                said.add(str(w.message))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        name, count, ways = found.groups()
        splits.setdefault((name, count), set()).add(int(ways))
    notes += [
        f"note: where a layout splits {name} {', '.join(map(str, sorted(ways)))} ways, "
        f"its {count} {name} are held whole on each device of the group (its row counts "
        "them so)"
        for (name, count), ways in splits.items()
    ]


def cpu_memory_note(config: Config, hw: Hardware, analytic: bool, task: Task | None) -> list[str]:
    """A compiled plan of a bfloat16 model for a GPU profile reports the memory of the
    program XLA:CPU compiles here, which holds bfloat16 activations as float32 and fuses
    less: the note saying so (Llama-3-8B at ``fsdp=8``: 55.3 GiB compiled here, 27.1 GiB
    estimated for an H100)."""
    if analytic or task is not None or hw.platform == "cpu" or jax.default_backend() != "cpu":
        return []
    if config.family.compute_dtype(config.model) != "bfloat16":
        return []
    return [
        "note: memory is that of the program XLA:CPU compiles here, which holds bfloat16 "
        "activations as float32 and fuses less than a GPU: a GPU's temporaries can be half "
        "of it or less; --analytic estimates the GPU's program (docs/lab.md)"
    ]
