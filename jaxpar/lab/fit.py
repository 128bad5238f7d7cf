"""A hardware profile fitted to steps timed on the user's own machine (``jaxpar plan
--fit SWEEP.csv``).

A datasheet profile says what a chip could do; a sweep with ``--steps N`` says what this
machine did. The fit keeps the roofline's form (:func:`jaxpar.lab.hardware.roofline`) and
chooses its six constants (those the steps cannot show keep the base profile's:
:func:`unseen`) — matmul FLOP/s, the bandwidth of the temporaries' traffic and
of the state's (arguments and outputs: the optimizer update streams the parameters and
moments, where unfused kernels write and read the activations), interconnect bandwidth,
the latency of one collective and a fixed cost per step (dispatch, host work) — so that
the predicted step times of the sweep's layouts match the measured ones, in ratio (least
squares on the logarithms, SciPy's trust-region solver; each constant positive). Whether a
collective's latency is paid per instruction, per array or per device taking part
(:attr:`~jaxpar.lab.hardware.Hardware.latency_per`) is chosen by which fits better.

What a fitted profile is worth is what it predicts for layouts it was not fitted on:
:func:`held_out` fits on every other layout of a sweep and ranks the rest (Spearman's
ρ against their measured times).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares
from scipy.stats import spearmanr

from jaxpar.errors import ConfigError
from jaxpar.lab.hardware import LATENCY_PER, PLATFORMS, Hardware, roofline

#: a sweep.csv's columns the fit reads
NEEDED = (
    "layout",
    "flops",
    "mem_traffic_bytes",
    "mem_args_bytes",
    "mem_output_bytes",
    "comm_bytes",
    "collective_ops",
    "step_time_s",
)
#: timed layouts a fit needs: more than its six constants in each held-out half
LEAST = 14
#: the held-out Spearman rho below which ``plan --fit`` calls its fit weak (issue 45's bar)
GOOD_RHO = 0.8
#: how far from its start (each term alone a fair share of the median step) a fitted
#: constant may go
BOUND = 1e6


@dataclass(frozen=True)
class Timed:
    """One layout of a sweep: what its compiled step does per device, and its time."""

    layout: str
    flops: float
    traffic: float
    state: float  # the state's part of ``traffic`` (arguments and outputs)
    comm: float
    calls: dict[str, float]  # by :data:`~jaxpar.lab.hardware.LATENCY_PER`
    seconds: float


def read_sweep(path: str | Path) -> list[Timed]:
    """The timed layouts of a ``sweep.csv`` (rows without a measured step are skipped).

    Raises:
      ConfigError: for a missing file, or one without the columns a fit needs (a sweep
        with ``--steps 0`` times nothing).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--fit {path}: no such file; give the sweep.csv of `jaxpar sweep`")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in NEEDED if rows and c not in rows[0]]
    timed = [_timed(path, r) for r in rows if not missing and r["step_time_s"] and r["flops"]]
    timed = [t for t in timed if t.seconds > 0]
    if missing or len(timed) < LEAST:
        why = f"lacks {', '.join(missing)}" if missing else f"times {len(timed)} layouts"
        raise ConfigError(
            f"--fit {path} {why}; a fit needs at least {LEAST} timed layouts: run `jaxpar "
            "sweep --all --steps 5` (or more --layouts) on this machine"
        )
    return timed


def timed_on(paths: list[str | Path]) -> str | None:
    """The platform the sweeps' steps were timed on (their ``timed_on`` column), None
    where none says (sweeps written before the column).

    Raises:
      ConfigError: where the sweeps name two platforms, or one that is no JAX platform.
    """
    found = set()
    for path in paths:
        with Path(path).open(newline="") as f:
            found |= {r.get("timed_on") or "" for r in csv.DictReader(f)} - {""}
    unknown = found - set(PLATFORMS)
    if unknown:
        raise ConfigError(
            f"--fit: timed_on={unknown.pop()!r} is no JAX platform ({', '.join(PLATFORMS)}); "
            "give an unedited sweep.csv"
        )
    if len(found) > 1:
        raise ConfigError(
            f"--fit: the sweeps were timed on {' and '.join(sorted(found))}; fit a profile "
            "to the sweeps of one machine"
        )
    return found.pop() if found else None


def read_sweeps(paths: list[str | Path]) -> list[Timed]:
    """The timed layouts of several sweeps of one machine, each layout's time the
    geometric mean of the sweeps' (a CPU's timings of the same layouts vary by about 10%
    from one sweep to the next: docs/lab.md); its counts are the same in every sweep, and
    what pays latency is counted as any sweep counted it. One sweep: :func:`read_sweep`.

    Raises:
      ConfigError: as :func:`read_sweep`, or where a sweep lacks a layout the first timed
        or counts one differently (a sweep of another config or model).
    """
    first, *others = (read_sweep(p) for p in paths)
    for path, other in zip(paths[1:], others, strict=True):
        found = {r.layout: r for r in other}
        missing = [r.layout for r in first if r.layout not in found]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ConfigError(
                f"--fit {path} did not time {missing[0]!r}{more}, which {paths[0]} timed; "
                "give sweeps of the same layouts"
            )
        first = [_together(r, found[r.layout], path, paths[0]) for r in first]
    return [replace(r, seconds=r.seconds ** (1 / len(paths))) for r in first]


def agreement(paths: list[str | Path]) -> float:
    """How alike several sweeps of one machine rank their layouts: the mean of Spearman's
    ρ over each pair of sweeps (1: the same order). A fit to one sweep cannot rank
    held-out layouts much better than one sweep ranks another's."""
    sweeps = [{r.layout: r.seconds for r in read_sweep(p)} for p in paths]
    pairs = [
        spearman([a[k] for k in a if k in b], [b[k] for k in a if k in b])
        for i, a in enumerate(sweeps)
        for b in sweeps[i + 1 :]
    ]
    return float(np.mean(pairs)) if pairs else 1.0


def _together(r: Timed, other: Timed, path: str | Path, first: str | Path) -> Timed:
    """``r`` with ``other``'s time multiplied in and its counts of what pays latency
    added where ``r`` has none.

    Raises:
      ConfigError: where the two count the layout's work differently.
    """
    counts = ("flops", "traffic", "state", "comm")
    if any(not math.isclose(getattr(r, c), getattr(other, c), rel_tol=1e-9) for c in counts):
        raise ConfigError(
            f"--fit {path} counts layout {r.layout!r} differently from {first} (its FLOPs, "
            "memory or communication): give sweeps of the same config on this machine"
        )
    calls = {**other.calls, **r.calls}
    return replace(r, seconds=r.seconds * other.seconds, calls=calls)


def _timed(path: Path, r: dict[str, str]) -> Timed:
    """One row of a sweep.csv as numbers (empty counts are 0)."""
    try:
        ops = float(r["collective_ops"] or 0)
        # a sweep written before jaxpar counted participants offers no such fit
        participants = r.get("collective_participants") or None
        return Timed(
            r["layout"],
            float(r["flops"]),
            float(r["mem_traffic_bytes"]),
            float(r["mem_args_bytes"]) + float(r["mem_output_bytes"]),
            float(r["comm_bytes"] or 0),
            {
                "collective": ops,
                "array": float(r.get("collective_arrays") or ops),
                **({"participant": float(participants)} if participants is not None else {}),
            },
            float(r["step_time_s"]),
        )
    except ValueError as err:
        raise ConfigError(
            f"--fit {path}: the row of layout {r['layout']!r} holds a value that is not a "
            f"number ({err}); give an unedited sweep.csv"
        ) from None


def _predict(log_params: np.ndarray, rows: list[Timed], per: str) -> np.ndarray:
    """:func:`predicted_seconds` for the constants ``exp(log_params)``, vectorised for
    the solver (``tests/test_fit.py`` checks the two agree)."""
    peak, hbm, state, link, alpha, overhead = np.exp(log_params)
    return np.array(
        [
            overhead
            + max(r.flops / peak, r.state / state + (r.traffic - r.state) / hbm)
            + r.comm / link
            + r.calls[per] * alpha
            for r in rows
        ]
    )


#: how little the state streamed a step may vary over a sweep for its bandwidth to count
#: as not pinned down (one model on one GPU: its batch, part of the arguments, moves it by
#: 0.02%), below the 2–17% two sweeps of the same steps differ by (docs/lab.md)
STEADY = 0.02
#: the six constants, in :func:`_predict`'s order
CONSTANTS = ("flops", "traffic", "state", "link", "latency", "overhead")


def unseen(rows: list[Timed], per: str) -> set[str]:
    """The constants ``rows`` cannot pin down, which a fit keeps at its base profile's
    values: the interconnect's and the collectives' latency where no step ran a collective
    (one GPU's sweep), the state's bandwidth where every step streams about the same state
    (:data:`STEADY`: its time then cannot be told from the fixed cost a step)."""
    out = set()
    states = [r.state for r in rows]
    if max(states) <= min(states) * (1 + STEADY):
        out.add("state")
    if not any(r.comm for r in rows):
        out.add("link")
    if not any(r.calls[per] for r in rows):
        out.add("latency")
    return out


#: why a constant :func:`unseen` names keeps the base profile's value, as ``plan --fit``
#: says it
UNSEEN_WHY = {
    "state": "the state's bandwidth (every step streamed about the same state)",
    "link": "the links' bandwidth (no step ran a collective)",
    "latency": "a collective's latency (no step ran one)",
}


def _median(values: list[float]) -> float:
    """The median of the positive ``values`` (1 where there are none)."""
    positive = [v for v in values if v > 0]
    return float(np.median(positive)) if positive else 1.0


def _held(base: Hardware) -> dict[str, float]:
    """``base``'s values of the constants a fit may keep, in the fit's units."""
    return {
        "state": base.state_rate,
        "link": base.link_rate,
        "latency": base.collective_latency,
    }


def _fit(rows: list[Timed], per: str, base: Hardware) -> tuple[np.ndarray, float]:
    """The log-constants that fit ``rows`` best with latency paid ``per`` (those the rows
    cannot pin down held at ``base``'s: :func:`unseen`), and the fit's root-mean-square
    error in log time."""
    seconds = np.array([r.seconds for r in rows])
    # a start where each term alone would be a fair share of the median step
    median = float(np.median(seconds))
    # medians over the steps that have the term (a sweep whose few multi-device layouts
    # alone communicate starts its links from those, not from nothing)
    scale = [_median([getattr(r, k) for r in rows]) for k in ("flops", "traffic", "state", "comm")]
    calls = _median([r.calls[per] for r in rows])
    start = np.log([*(s / median for s in scale), median / calls, median / 4])
    held = _held(base)
    # a term no step has costs nothing at any value: a profile's 0 (no latency) is held
    # at a tiny one the logarithm takes
    fixed = {CONSTANTS.index(k): math.log(max(held[k], 1e-30)) for k in unseen(rows, per)}
    free = [i for i in range(len(CONSTANTS)) if i not in fixed]

    def full(p: np.ndarray) -> np.ndarray:
        out = start.copy()
        out[free] = p
        for i, v in fixed.items():
            out[i] = v
        return out

    def residual(p: np.ndarray) -> np.ndarray:
        return np.log(_predict(full(p), rows, per)) - np.log(seconds)

    # each constant within a factor of BOUND of its start: one whose term the steps do
    # not show (too cheap to measure) stops there instead of running off to infinity
    span = math.log(BOUND)
    x0 = start[free]
    found = least_squares(residual, x0, method="trf", bounds=(x0 - span, x0 + span))
    return full(found.x), float(np.sqrt(np.mean(found.fun**2)))


def fit_profile(rows: list[Timed], base: Hardware, source: str = "") -> Hardware:
    """``base`` (its memory and platform kept) with the six constants fitted to
    ``rows``, latency paid per instruction, per array or per participant (where every
    row counts them), whichever fits better; named ``fitted``. A constant the rows cannot
    pin down (:func:`unseen`) keeps ``base``'s value: a sweep of one GPU runs no
    collective, so a profile fitted to it keeps the datasheet's links."""
    pers = [per for per in LATENCY_PER if all(per in r.calls for r in rows)]
    fits = {per: _fit(rows, per, base) for per in pers}
    per = min(fits, key=lambda k: fits[k][1])
    peak, hbm, state, link, alpha, overhead = (float(v) for v in np.exp(fits[per][0]))
    kept = unseen(rows, per)
    state = _held(base)["state"] if "state" in kept else state  # exactly, not through a log
    links = {} if "link" in kept else {"link_bandwidth": link, "links": 1, "link_efficiency": 1.0}
    latency = {} if "latency" in kept else {"collective_latency": alpha, "latency_per": per}
    return replace(
        base,
        key="fitted",
        name=f"this {base.platform.upper()} machine, fitted to {len(rows)} timed steps",
        source=source or f"fitted to {len(rows)} timed layouts",
        flops_bf16=peak,
        flops_f32=peak,
        matmul_efficiency=1.0,  # the fitted rate is what the steps achieved
        hbm_bandwidth=hbm,
        state_bandwidth=state,
        **links,  # the fitted rate is the achieved one: no share of a wire's
        **latency,
        step_overhead=overhead,
        fitted=True,
    )


def predicted_seconds(hw: Hardware, rows: list[Timed]) -> list[float]:
    """What ``hw`` predicts for each of ``rows``: :func:`~jaxpar.lab.hardware.roofline` on
    their own counts, as ``plan`` predicts with a CPU's profile (its bytes as compiled,
    nothing hidden)."""
    return [
        roofline(
            hw, r.flops, r.traffic, r.comm, "float32", r.calls[hw.latency_per], state_bytes=r.state
        ).total_s
        for r in rows
    ]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (SciPy's)."""
    value = float(spearmanr(a, b).statistic)
    return value if math.isfinite(value) else 0.0


def profile_yaml(hw: Hardware) -> str:
    """``hw`` as a ``--hardware-file`` entry (every field; loads back as itself)."""
    entry = {f.name: getattr(hw, f.name) for f in fields(hw) if f.name != "key"}
    return yaml.safe_dump({hw.key: entry}, sort_keys=False)


def held_out(rows: list[Timed], base: Hardware) -> tuple[float, float]:
    """Spearman's ρ on layouts the profile was not fitted on: fitted on the even-numbered
    rows, ranking the odd ones; and the other way round."""
    halves = (rows[0::2], rows[1::2])
    out = []
    for fitted, tested in (halves, halves[::-1]):
        hw = fit_profile(fitted, base)
        out.append(spearman([r.seconds for r in tested], predicted_seconds(hw, tested)))
    return out[0], out[1]
