"""Sizes checked before anything is built: a run whose arrays no device can hold is
refused in one line naming the setting and the size it implies, where it would otherwise
hang in its first step, fill the host's memory or abort in the compiler (XLA counts
elements and bytes in int64).

Cheapest first, each from plain values:

* :func:`check_settings` — before the model is built: an integer setting beyond int64
  can be no array's dim;
* :func:`check_microbatches` — before the pipeline's tick table (one entry per
  microbatch and stage): the per-step batch must hold a row for each;
* :func:`check_state` — from the plan's abstract state and shardings (nothing is
  allocated): the bytes each device holds, against its memory (:func:`device_memory`),
  or where nothing will be allocated (``jaxpar inspect``, the lab) against
  :data:`NO_DEVICE_HOLDS`;
* :func:`check_activations` — the largest array one step must hold (a matmul's,
  convolution's or layer scan's output in the forward pass: traced, not compiled).

A user's task gets the same checks; the settings named are then the batch's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax

from jaxpar import sharding as shd
from jaxpar.errors import ConfigError, LayoutError
from jaxpar.plan.offload import device_part


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the train state on one device (the largest shard of each leaf): parameters,
    optimizer state, model state and ``total`` (with the step counters: what device memory
    holds); and of the whole (unsharded) parameters and optimizer state; ``host``: of the
    state held in host memory (an offloaded optimizer state), left out of ``total``."""

    params: int
    opt_state: int
    model_state: int
    total: int
    params_total: int
    opt_state_total: int
    host: int = 0


#: The largest count XLA can hold (it counts elements and bytes in int64).
INT64_MAX = 2**63 - 1
#: More bytes than any one device or host holds (256 TiB): a layout that needs more per
#: device cannot run anywhere, and its counts near XLA's int64 limit.
NO_DEVICE_HOLDS = 2**48
#: The outputs a step must hold whole at some moment (elementwise ones may be fused away).
_MATERIALIZED = ("dot_general", "conv_general_dilated", "scan")


@dataclass(frozen=True)
class Memory:
    """The memory a run's arrays must fit: each device's (``shared`` False), or the
    host's, which all its CPU devices share (``shared``); ``what`` names it in messages
    (``this host's memory (24.6 GB, shared by its 8 CPU devices)``)."""

    bytes: int
    shared: bool
    what: str


#: What no device holds (``jaxpar inspect`` and the lab allocate nothing, but XLA still
#: counts the sizes).
ANY_DEVICE = Memory(NO_DEVICE_HOLDS, False, f"any device holds ({NO_DEVICE_HOLDS / 1e12:.0f} TB)")


def device_memory(devices: list[jax.Device]) -> Memory | None:
    """The memory of this process's ``devices``: the host's for CPU devices, else the
    device's ``bytes_limit``; None where the backend does not say."""
    here = [d for d in devices if d.process_index == jax.process_index()] or devices
    if here[0].platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
        count = f"{len(here)} CPU device{'s' * (len(here) != 1)}"
        return Memory(total, True, f"this host's memory ({size(total)}, shared by its {count})")
    try:
        limit = (here[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 (a backend without memory statistics)
        return None
    if not limit:
        return None
    return Memory(int(limit), False, f"a {here[0].device_kind}'s memory ({size(limit)})")


def size(n: float) -> str:
    """``n`` bytes for a message: ``24.6 GB``, ``1.02e+03 EB``."""
    for unit, scale in (
        ("EB", 1e18),
        ("PB", 1e15),
        ("TB", 1e12),
        ("GB", 1e9),
        ("MB", 1e6),
        ("KB", 1e3),
    ):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def check_settings(settings: Mapping[str, Any]) -> None:
    """Integer settings (``{"model.vocab_size": 32000, …}``) must be possible array dims.

    Raises:
      ConfigError: naming a setting beyond int64.
    """
    for key, value in settings.items():
        if isinstance(value, int) and value > INT64_MAX:
            raise ConfigError(
                f"{key}={value} is larger than any array dim can be (2^63 − 1: XLA counts "
                f"in int64), and than any device's memory; lower {key}"
            )


def check_microbatches(batch_size: int, grad_accum: int, microbatches: int, stages: int) -> None:
    """With pipeline stages, one step's ``batch_size`` rows must hold ``grad_accum`` ×
    ``microbatches`` (0: twice the stages) microbatches of at least one row — checked
    before the tick table (an entry per microbatch and stage) is built; how they divide
    the batch is the plan's check.

    Raises:
      LayoutError: naming the settings and a microbatch count that fits.
    """
    if stages <= 1:
        return
    m = microbatches or 2 * stages
    parts = grad_accum * m
    if parts <= batch_size:
        return
    given = (
        f"pipeline.microbatches={m}"
        if microbatches
        else f"pipeline.microbatches (default 2 × mesh.stage = {m})"
    )
    rows = batch_size // grad_accum
    fits = next((d for d in range(min(rows, 1 << 16), 0, -1) if rows % d == 0), None)
    fix = (
        f"pipeline.microbatches={fits} (or a smaller divisor of {rows})"
        if fits
        else (f"train.grad_accum to at most {batch_size}")
    )
    raise LayoutError(
        f"{given} × train.grad_accum={grad_accum} = {parts} microbatches, more than one "
        f"step's train.batch_size={batch_size} rows (a microbatch holds at least one); set "
        f"{fix}, or raise train.batch_size"
    )


def check_state(plan: Any, memory: Memory | None, settings: Mapping[str, Any]) -> None:
    """The train state of ``plan`` fits ``memory`` (None: :data:`ANY_DEVICE`).

    Raises:
      LayoutError: naming the state's bytes, the memory, its largest parameter and the
        setting its size follows from.
    """
    # an offloaded optimizer state is in the host's memory, outside a device's (CPU
    # devices share the host's: it counts there)
    on_host = plan.optimizer_offload and not (memory is not None and memory.shared)
    held = shd.bytes_by_device(
        device_part(plan.abstract_state, on_host), device_part(plan.state_shardings, on_host)
    )
    most = max(held.values(), default=0)
    memory = ANY_DEVICE if most > NO_DEVICE_HOLDS or memory is None else memory
    mine = jax.process_index()  # an abstract mesh's one key stands for devices not here
    here = [n for d, n in held.items() if getattr(d, "process_index", mine) == mine]
    need = sum(here) if memory.shared else most
    if need <= memory.bytes:
        return
    state = plan.state_bytes()
    rows = shd.param_rows(
        plan.abstract_state.params, plan.model.param_axes, plan.state_shardings.params
    )
    top = max(rows, key=lambda r: r.bytes_per_device)
    parts = f"parameters {size(state.params)}, optimizer state {size(state.opt_state)}"
    parts = f"in all (per device: {parts})" if memory.shared else f"per device ({parts})"
    total = state.params_total + state.opt_state_total
    keys = _keys(top.shape, settings)
    origin = f" from {', '.join(keys)}" if keys else ""
    smaller = f"lower {keys[0].split('=')[0]}" if keys else "choose a smaller model"
    fix = (
        smaller
        if memory is ANY_DEVICE
        else "choose a smaller model, or train it on accelerators that hold it together "
        "(jaxpar plan finds a layout)"
        if memory.shared
        else f"shard it over at least {max(2, -(-total // memory.bytes))} such devices "
        "(mesh.fsdp, mesh.tensor) or choose a smaller model"
    )
    raise LayoutError(
        f"the train state needs {size(need)} {parts}, more than {memory.what}; its "
        f"largest parameter is {top.path} {list(top.shape)}{origin}; {fix}"
    )


def check_activations(
    plan: Any, batch: Mapping[str, Any], memory: Memory | None, settings: Mapping[str, Any]
) -> None:
    """The largest array one train step of ``plan`` must hold, split over every device
    (a lower bound), fits ``memory``.

    Raises:
      LayoutError: naming the array, the batch it is computed for and the settings its
        size follows from.
    """
    if memory is None:  # nothing is allocated: what the state check bounds is enough
        return
    found = largest_array(plan, batch)
    if found is None:
        return
    nbytes, aval, primitive = found
    devices = plan.mesh.devices.size
    here = sum(d.process_index == jax.process_index() for d in plan.mesh.devices.flat)
    share = nbytes * here / devices if memory.shared else nbytes / devices
    if share <= memory.bytes:
        return
    rows = next(iter(batch.values())).shape[0] // plan.microbatches
    keys = _keys(aval.shape, settings)
    origin = f", from {', '.join(keys)}" if keys else ""
    where = "of it on this host" if memory.shared else f"on each of its {devices} devices"
    raise LayoutError(
        f"one train step computes {aval.str_short()} ({size(nbytes)}, a {primitive} output "
        f"for a microbatch of {rows} rows{origin}): at least {size(share)} {where}, more "
        f"than {memory.what}; lower train.batch_size (or raise train.grad_accum), "
        "data.seq_len or the model's sizes, or split the batch and sequence over more "
        "devices"
    )


def largest_array(plan: Any, batch: Mapping[str, Any]) -> tuple[int, Any, str] | None:
    """Bytes, shape and primitive of the largest output of :data:`_MATERIALIZED` in the
    plan's forward pass for one microbatch of ``batch`` (global shapes: the backward pass
    computes arrays of the same shapes, and tracing it as well costs several times more);
    None when the loss cannot be traced here (its step then says why, where it always
    did)."""
    m = plan.microbatches
    micro = {
        k: jax.ShapeDtypeStruct((v.shape[0] // m, *v.shape[1:]), v.dtype) for k, v in batch.items()
    }

    def loss(params: Any, model_state: Any, batch: Any) -> Any:
        return plan.loss(params, model_state, batch, train=True, layout=plan.layout)[0]

    state = plan.abstract_state
    try:
        # not under warnings.catch_warnings(): leaving it resets Python's record of the
        # warnings shown, so every warning of the run would show again (a model's trace
        # warning here is one its step's trace then does not repeat)
        traced = jax.make_jaxpr(loss)(state.params, state.model_state, micro)
    except Exception:  # noqa: BLE001 (a loss that does not trace so: the step reports it)
        return None
    return _largest(traced.jaxpr, None)


def _largest(jaxpr: Any, best: tuple[int, Any, str] | None) -> tuple[int, Any, str] | None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MATERIALIZED:
            for var in eqn.outvars:
                aval = var.aval
                if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                    nbytes = math.prod(aval.shape) * shd.itemsize(aval.dtype)
                    if best is None or nbytes > best[0]:
                        best = (nbytes, aval, eqn.primitive.name)
        for sub in _subjaxprs(eqn.params):
            best = _largest(sub, best)
    return best


def _subjaxprs(params: Mapping[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for x in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(x, "jaxpr", x)  # a ClosedJaxpr's open jaxpr
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def _keys(shape: tuple[int, ...], settings: Mapping[str, Any]) -> list[str]:
    """``key=value`` of the settings equal to the largest dim of ``shape`` that any
    setting equals (none: the dims follow from no one setting)."""
    for dim in sorted(set(shape), reverse=True):
        keys = [f"{k}={v}" for k, v in settings.items() if v == dim and dim > 1]
        if keys:
            return keys
    return []
