"""Accelerator profiles (``hardware.yaml``) and the roofline that predicts a step's time.

A profile is a chip's datasheet: peak matmul FLOP/s, HBM bandwidth, memory, and
interconnect bandwidth, plus the latency of one collective, and where its NVLink domain
ends: the chips in one, and the network's bandwidth and latency beyond it. The roofline
of one step on one device is::

    compute = max(FLOPs / peak FLOP/s, memory traffic / HBM bandwidth)
    predicted step time = compute + collective wire bytes / interconnect bandwidth
                                  + collectives executed × collective latency

for collectives inside one NVLink domain; :mod:`jaxpar.lab.network` prices those whose
group crosses domains at the network's bandwidth and latency.

The last two terms are the α-β model of communication: β the time per byte, α the fixed
cost of each collective however small (its launch and the hops of its ring), which is
what makes many small collectives — a pipeline's per-tick sends, FSDP's per-layer
gathers — cost more than one large gradient all-reduce on a tiny model. The count comes
from the compiled program (:attr:`jaxpar.hlo.ProgramCost.collective_ops`: loops times
their trip counts), or, for a profile with ``latency_per: array``, the arrays they move
(:attr:`~jaxpar.hlo.ProgramCost.collective_arrays`: gloo under XLA:CPU makes a call per
array of a combined all-reduce, so there gradient buckets save what NCCL's grouped call
already saves on a GPU), or with ``latency_per: participant`` the devices each waits for
(:attr:`~jaxpar.hlo.ProgramCost.collective_participants`: XLA:CPU's collectives are a
rendezvous of the devices' threads). Communication is added, but for what runs while the
step computes (``hidden_bytes``: a stacked layer's FSDP gathers and gradient reductions on
a GPU, a collective matmul's sends), which counts only where it outlasts the compute.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from jaxpar import yamlfile
from jaxpar.errors import ConfigError

_BUILTIN = Path(__file__).with_name("hardware.yaml")
#: what one collective latency is paid for (:attr:`Hardware.latency_per`)
LATENCY_PER = ("collective", "array", "participant")


@dataclass(frozen=True)
class Hardware:
    """One accelerator's datasheet figures (see ``hardware.yaml`` for units)."""

    key: str
    name: str
    flops_bf16: float
    flops_f32: float
    hbm_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    links: int
    collective_latency: float
    source: str = ""
    #: the JAX platform the chip runs (what ``train.grad_bucket_mb=auto`` reads)
    platform: str = "gpu"
    #: what pays ``collective_latency``: each collective instruction (NCCL runs a combined
    #: all-reduce of many arrays as one grouped call), each array of one (gloo, XLA:CPU),
    #: or each device taking part (XLA:CPU's rendezvous of its devices' threads)
    latency_per: str = "collective"
    #: seconds every step costs besides its terms (dispatch, host work): 0 on a datasheet
    #: profile; what a fit to timed steps finds (:mod:`jaxpar.lab.fit`)
    step_overhead: float = 0.0
    #: chips in one NVLink domain (8 on an HGX board, 72 in a GB200 NVL72 rack); a
    #: collective whose group leaves it crosses the network (:mod:`jaxpar.lab.network`).
    #: 0: one domain holds every chip
    domain_devices: int = 0
    #: bytes/s per chip, one direction, to chips of other domains (its own NIC): needed
    #: where ``domain_devices`` ends a domain; 0 (left out): one domain holds every chip
    network_bandwidth: float = 0.0
    #: chips one host (one process of a run) drives: what ``mesh.hosts_*`` count in (8 on
    #: an HGX board, 4 on a GB200 compute tray, whose 18 fill a rack's domain); 0: a host
    #: is a domain
    host_devices: int = 0
    #: seconds a collective that crosses the network costs besides ``collective_latency``,
    #: per level of NCCL's tree across domains (:mod:`jaxpar.lab.network`)
    network_latency: float = 0.0
    #: the share of the peak the chip's best matmuls reach (its measured MAMF over the
    #: datasheet figure): 1 prices matmuls at the peak (:mod:`jaxpar.lab.kernels`)
    matmul_efficiency: float = 1.0
    #: peak FP8 matmul FLOP/s (dense) and the share of it the best FP8 matmuls reach; 0:
    #: no FP8 tensor cores (an FP8 matmul runs at the bf16 rate)
    flops_fp8: float = 0.0
    matmul_efficiency_fp8: float = 1.0
    #: bytes/s at which a step reads and writes its state (its arguments and outputs:
    #: parameters, optimizer state, batch), where that differs from the temporaries'; 0:
    #: ``hbm_bandwidth``. A fit to timed steps finds its own (:mod:`jaxpar.lab.fit`)
    state_bandwidth: float = 0.0
    #: the share of ``links × link_bandwidth`` NCCL's collectives reach inside a domain
    #: (measured bus bandwidth over the datasheet figure): 1 prices them at the wire's rate
    link_efficiency: float = 1.0
    #: the same share of ``network_bandwidth`` for collectives that cross domains
    network_efficiency: float = 1.0
    #: fitted to steps timed on a machine (:mod:`jaxpar.lab.fit`): priced as the fit
    #: models a step (:attr:`as_fitted`), whatever its platform
    fitted: bool = False

    @property
    def as_fitted(self) -> bool:
        """Whether a step is priced as a fit models it — the roofline on the step's own
        counts, nothing hidden, one domain, no kernel model: a fitted profile's constants
        are what whole steps achieved. A CPU profile is (it can only be fitted)."""
        return self.fitted or self.platform == "cpu"

    @property
    def interconnect_bandwidth(self) -> float:
        """Bytes/s one chip sends to the other chips of its NVLink domain (all links, one
        direction), as the datasheet gives them."""
        return self.link_bandwidth * self.links

    @property
    def link_rate(self) -> float:
        """Bytes/s a collective inside one NVLink domain moves per chip: the links' figure
        × :attr:`link_efficiency`."""
        return self.interconnect_bandwidth * self.link_efficiency

    @property
    def network_rate(self) -> float:
        """Bytes/s a collective across domains moves through each chip's NIC:
        :attr:`network_bandwidth` × :attr:`network_efficiency`."""
        return self.network_bandwidth * self.network_efficiency

    @property
    def state_rate(self) -> float:
        """Bytes/s a step reads and writes its state at (:attr:`state_bandwidth`, else
        :attr:`hbm_bandwidth`)."""
        return self.state_bandwidth or self.hbm_bandwidth

    @property
    def devices_per_host(self) -> int:
        """Chips one host drives (:attr:`host_devices`, else a domain's; 0: unknown)."""
        return self.host_devices or self.domain_devices

    def peak_flops(self, dtype: str) -> float:
        """Peak matmul FLOP/s for the model's compute dtype."""
        return self.flops_bf16 if dtype in ("bfloat16", "bf16", "float16") else self.flops_f32


def load_profiles(extra: str | Path | None = None) -> dict[str, Hardware]:
    """The built-in profiles, plus (replacing same-named ones) those in ``extra``.

    Raises:
      ConfigError: when ``extra`` is missing or an entry lacks a field.
    """
    raw = yaml.safe_load(_BUILTIN.read_text())
    if extra:
        path = Path(extra)
        if not path.is_file():
            raise ConfigError(f"--hardware-file {path}: no such file")
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) else "it is not UTF-8 text"
            raise ConfigError(f"--hardware-file '{path}' cannot be read: {why}") from None
        given = (
            yamlfile.load(
                text, f"--hardware-file '{path}'", f"fix the file (see {_BUILTIN} for the form)"
            )
            or {}
        )
        if not isinstance(given, dict) or not all(isinstance(e, dict) for e in given.values()):
            raise ConfigError(
                f"--hardware-file {path} must map profile names to their fields (see {_BUILTIN})"
            )
        raw.update(given)
    names = {f.name for f in fields(Hardware)} - {"key"}
    profiles = {}
    for key, entry in raw.items():
        unknown = sorted(set(entry or {}) - names)
        if unknown:  # a misspelt field would be left unread
            raise ConfigError(
                f"hardware profile '{key}': unknown field '{unknown[0]}'"
                f"{_did_you_mean(unknown[0], names)}; see {_BUILTIN} for the fields"
            )
        missing = sorted(n for n in names - set(_OPTIONAL) if n not in (entry or {}))
        if missing:
            raise ConfigError(
                f"hardware profile '{key}' lacks {', '.join(missing)}; "
                f"see {_BUILTIN} for the fields"
            )
        profiles[key] = _hosts_in_domains(
            Hardware(key=key, **{f: _typed(key, f, entry[f]) for f in names if f in entry})
        )
    return profiles


def _hosts_in_domains(hw: Hardware) -> Hardware:
    """``hw``, whose hosts each lie in one NVLink domain (how the network model places
    them) and whose domains, if it ends them, reach each other; a one-line error
    otherwise."""
    if hw.domain_devices and not hw.network_bandwidth:
        raise ConfigError(
            f"hardware profile '{hw.key}': domain_devices={hw.domain_devices} ends an NVLink "
            "domain, so a layout of more chips crosses the network: give network_bandwidth "
            "(bytes/s per chip, one direction, e.g. 50e9 for 400 Gb/s InfiniBand), or leave "
            "domain_devices out for one domain of every chip"
        )
    if hw.host_devices and hw.domain_devices and hw.domain_devices % hw.host_devices:
        raise ConfigError(
            f"hardware profile '{hw.key}': host_devices={hw.host_devices} does not divide "
            f"domain_devices={hw.domain_devices}; a domain holds whole hosts: give the GPUs "
            "one host drives, a divisor of the domain's"
        )
    return hw


#: the JAX platforms a profile's chip may run (and a sweep's steps be timed on)
PLATFORMS = ("gpu", "tpu", "cpu")
#: fields a profile may leave out, and the values they may take (None: any text, but a
#: share in (0, 1] for the fields in ``_SHARES``; a number: any number at least that)
_OPTIONAL = {
    "source": None,
    "platform": PLATFORMS,
    "latency_per": LATENCY_PER,
    "step_overhead": 0,
    "domain_devices": 0,
    "network_bandwidth": 0,
    "host_devices": 0,
    "network_latency": 0,
    "matmul_efficiency": None,
    "flops_fp8": 0,
    "matmul_efficiency_fp8": None,
    "state_bandwidth": 0,
    "link_efficiency": None,
    "network_efficiency": None,
    "fitted": (False, True),
}
#: the least value of the number fields that need not be above 0
_LEAST = {
    "links": 1,
    "collective_latency": 0,
    **{k: v for k, v in _OPTIONAL.items() if isinstance(v, int)},
}
#: the number fields that are a share: above 0, at most 1
_SHARES = (
    "matmul_efficiency",
    "matmul_efficiency_fp8",
    "link_efficiency",
    "network_efficiency",
)
#: the number fields that count things (whole numbers)
_COUNTS = ("links", "domain_devices", "host_devices")
#: the range each figure of a real machine lies in, and its unit with an example: a value
#: outside is a unit mistake (80 for 80 GB, 15 for 15 µs), refused rather than planned with
_RATE = (1e6, 1e18)
_PLAUSIBLE = {
    **dict.fromkeys(("flops_bf16", "flops_f32", "flops_fp8"), (*_RATE, "FLOP/s, e.g. 989.4e12")),
    **dict.fromkeys(
        ("hbm_bandwidth", "state_bandwidth", "link_bandwidth", "network_bandwidth"),
        (*_RATE, "bytes/s, e.g. 25.0e9"),
    ),
    "memory_bytes": (1e6, 1e15, "bytes, e.g. 80.0e9"),
    **dict.fromkeys(
        ("collective_latency", "network_latency", "step_overhead"), (0, 1.0, "seconds, e.g. 1.0e-5")
    ),
}


def _typed(profile: str, field: str, value: object) -> object:
    """A profile value as its field's type (YAML reads ``80.0e9`` as a string)."""
    if field in ("name", "source"):
        return str(value)
    if field == "fitted":
        if not isinstance(value, bool):
            raise ConfigError(
                f"hardware profile '{profile}': fitted={value!r}; write true or false"
            )
        return value
    if isinstance(_OPTIONAL.get(field), tuple):
        if value not in _OPTIONAL[field]:
            raise ConfigError(
                f"hardware profile '{profile}': {field}={value!r}; choose one of "
                f"{', '.join(_OPTIONAL[field])}"
            )
        return value
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(
            f"hardware profile '{profile}': {field}={value!r} is not a number"
        ) from None
    least = _LEAST.get(field)
    whole = field not in _COUNTS or number.is_integer()
    bounded = number >= least if least is not None else number > 0
    if field in _SHARES and not (0 < number <= 1):
        raise ConfigError(
            f"hardware profile '{profile}': {field}={value!r} must be above 0 and at most 1"
        )
    if not math.isfinite(number) or not whole or not bounded:
        kind = "a whole number" if field in _COUNTS else "a finite number"
        bound = f"at least {least}" if least is not None else "above 0"
        raise ConfigError(f"hardware profile '{profile}': {field}={value!r} must be {kind} {bound}")
    low, high, unit = _PLAUSIBLE.get(field, (0, math.inf, ""))
    if number and not low <= number <= high:
        raise ConfigError(
            f"hardware profile '{profile}': {field}={value!r} is not a machine's figure in "
            f"{unit}; a profile's figures are in FLOP/s, bytes, bytes/s and seconds"
        )
    return int(number) if field in _COUNTS else number


#: the profile a command plans on when none is named
DEFAULT = "h100"


def get_profile(key: str | None, extra: str | Path | None = None) -> Hardware:
    """The profile named ``key`` (e.g. ``h100``; None: :data:`DEFAULT`, unless ``extra``
    is given, a file of profiles the user wrote to plan on one of them).

    Raises:
      ConfigError: for an unknown name, listing the known ones; for a file of profiles
        with no name given, naming them.
    """
    profiles = load_profiles(extra)
    if key is None and extra:
        own = sorted(set(profiles) - set(load_profiles()))
        raise ConfigError(
            f"--hardware-file {extra} is given but no --hardware: name the profile to plan "
            f"on, e.g. --hardware {own[0] if own else DEFAULT} (the file defines "
            f"{', '.join(own) or 'only built-in names'})"
        )
    key = key or DEFAULT
    if key not in profiles:
        raise ConfigError(
            f"unknown hardware '{key}'{_did_you_mean(key, profiles)}; choose one of "
            f"{', '.join(sorted(profiles))} or add it with --hardware-file"
        )
    return profiles[key]


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name`` (case aside), or ''."""
    by_lower = {k.lower(): k for k in known}
    near = difflib.get_close_matches(name.lower(), sorted(by_lower), n=1, cutoff=0.75)
    return f" (did you mean '{by_lower[near[0]]}'?)" if near else ""


@dataclass(frozen=True)
class Kernels:
    """How a step's kernels run, beside its FLOPs (:mod:`jaxpar.lab.kernels`): its
    matmuls' rate over the profile's achievable one, by their shapes (1: every matmul as
    fast as the chip's best), the HBM bytes its other kernels move (0: not known), and the
    share of its matmul FLOPs in FP8."""

    shape_efficiency: float = 1.0
    elementwise_bytes: float = 0.0
    #: the share of the matmul FLOPs that run in FP8 (``model.precision=fp8``)
    fp8_share: float = 0.0


#: a step whose kernels are not known: matmuls at the achievable rate, nothing else timed
UNKNOWN_KERNELS = Kernels()


@dataclass(frozen=True)
class StepTime:
    """The roofline terms of one step, in seconds: ``comm_s`` the bytes' (β),
    ``latency_s`` the collectives' fixed cost (α)."""

    compute_s: float
    memory_s: float
    comm_s: float
    latency_s: float = 0.0
    #: communication that runs while the matmuls compute (a collective matmul's sends)
    hidden_s: float = 0.0
    #: the profile's fixed cost per step (:attr:`Hardware.step_overhead`)
    overhead_s: float = 0.0
    #: the kernels other than matmuls, memory-bound, one after another with them
    #: (:mod:`jaxpar.lab.kernels`; 0 where not estimated: the whole step's traffic then
    #: bounds it in ``memory_s``)
    elementwise_s: float = 0.0

    @property
    def total_s(self) -> float:
        busy = max(self.compute_s + self.elementwise_s, self.memory_s, self.hidden_s)
        return busy + self.comm_s + self.latency_s + self.overhead_s

    @property
    def bound(self) -> str:
        """The largest term of the step: its kernels, named ``compute`` or ``elementwise``
        (kernels other than matmuls) by the larger part of their sum; ``memory``, ``hidden``
        (communication hidden behind matmuls that outlasts them), ``communication``
        (bytes), ``latency`` or ``overhead`` (a fitted profile's fixed cost per step)."""
        kernels = "compute" if self.compute_s >= self.elementwise_s else "elementwise"
        terms = {
            kernels: self.compute_s + self.elementwise_s,
            "memory": self.memory_s,
            "hidden": self.hidden_s,
            "communication": self.comm_s,
            "latency": self.latency_s,
            "overhead": self.overhead_s,
        }
        return max(terms, key=terms.__getitem__)


def roofline(
    hw: Hardware,
    flops: float,
    traffic_bytes: float,
    comm_bytes: float,
    dtype: str,
    collectives: int = 0,
    hidden_bytes: float = 0.0,
    kernels: Kernels = UNKNOWN_KERNELS,
    state_bytes: float = 0.0,
) -> StepTime:
    """Predicted step time on ``hw`` from per-device FLOPs, memory traffic, collective
    wire bytes and the number of collectives executed, all inside one NVLink domain
    (:func:`jaxpar.lab.network.step_time` places each collective on the domains and the
    network); ``hidden_bytes`` of communication run while the matmuls compute (they
    count only where they outlast the compute), and are not in ``comm_bytes`` or
    ``collectives``; ``state_bytes`` of the traffic are the state's
    (:func:`memory_time`)."""
    return StepTime(
        compute_time(hw, flops, dtype, kernels),
        memory_time(hw, traffic_bytes, state_bytes),
        comm_bytes / hw.link_rate,
        collectives * hw.collective_latency,
        hidden_bytes / hw.link_rate,
        hw.step_overhead,
        kernels.elementwise_bytes / hw.hbm_bandwidth,
    )


def memory_time(hw: Hardware, traffic_bytes: float, state_bytes: float = 0.0) -> float:
    """Seconds a step's memory traffic takes: ``state_bytes`` of it (the state read and
    written) at the profile's state bandwidth, the rest at its HBM bandwidth."""
    state = min(state_bytes, traffic_bytes)
    return state / hw.state_rate + (traffic_bytes - state) / hw.hbm_bandwidth


def compute_time(hw: Hardware, flops: float, dtype: str, kernels: Kernels) -> float:
    """Seconds ``flops`` of matmuls take: at the peak × the chip's best matmuls' share of
    it × the step's matmuls' share of those (their shapes); the FP8 share of them at the
    chip's FP8 rate, where it has one."""
    best = hw.peak_flops(dtype) * hw.matmul_efficiency
    fp8 = hw.flops_fp8 * hw.matmul_efficiency_fp8 or best
    share = kernels.fp8_share
    return flops * ((1 - share) / best + share / fp8) / kernels.shape_efficiency
