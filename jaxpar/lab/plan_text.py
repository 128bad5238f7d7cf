"""The plan as printed: the ranked table, what was left out, each layout's fix, and the
fastest layout that fits (``jaxpar plan``; :mod:`jaxpar.lab.planner` ranks)."""

from __future__ import annotations

from jaxpar.lab.analytic import RESIDUALS_LOW, TEMPS_LOW, may_not_fit
from jaxpar.lab.chart import fmt_value
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.planner import Planned, best

#: the layouts an estimated plan (above the devices compiled here) prints of each kind
#: unless ``--top`` says otherwise: its CSV (``--out``) holds them all
ESTIMATED_TOP = 20


def fmt_time(seconds: float) -> str:
    """Three significant digits in µs, ms or s, whichever keeps the number under 1000:
    ``fmt_time(4.2e-5) == "42.0 µs"``, ``fmt_time(0.0012345) == "1.23 ms"``."""
    for scale, unit in ((1e-6, "µs"), (1e-3, "ms"), (1.0, "s")):
        value = seconds / scale
        if abs(float(f"{value:.3g}")) < 1000 or unit == "s":
            return f"{value:#.3g}".rstrip(".") + f" {unit}"
    raise AssertionError("unreachable")


#: how the footer names what a collective's latency is paid for
_PAID_BY = {"collective": "executed", "array": "arrays", "participant": "participants"}


def _rate(rate: float, share: float) -> str:
    """A collective's bytes/s, and the wire's share it is where that is below 1."""
    return f"{rate / 1e9:.3g} GB/s" + (f" ({share:.0%} of the wire's)" if share < 1 else "")


def _footer(hw: Hardware, memory: float) -> str:
    """How the ranking's times were priced, and the memory it judged against."""
    gpu = not hw.as_fitted
    network = (
        f", {_rate(hw.network_rate, hw.network_efficiency)} and "
        f"{fmt_time(hw.network_latency)} a level "
        f"beyond {hw.domain_devices} GPUs"
        if hw.domain_devices and gpu
        else ""
    )
    kernels = (
        f"matmuls at up to {hw.matmul_efficiency:.0%} of peak by their shapes, the other "
        "kernels after them; "
        if gpu
        else ""
    )
    return (
        f"ranked by predicted step time on {hw.name} (roofline; {kernels}communication = "
        f"bytes / {_rate(hw.link_rate, hw.link_efficiency)}{network} + collectives "
        f"{_PAID_BY[hw.latency_per]} × "
        f"{fmt_time(hw.collective_latency)}, in brackets, but a collective matmul's sends, "
        "hidden latency and all; what overlaps compute counts only "
        f"where it outlasts it); memory judged against {memory / 1e9:.3g} GB "
        f"({fmt_value(memory, 'B')}) per device"
    )


def format_plan(planned: list[Planned], hw: Hardware, memory: float, top: int | None = None) -> str:
    """The ranked table, then what was left out (one note per reason), a note per layout
    that does not fit or cannot run, then the fastest layout that fits. ``top``: only the
    ``top`` first of the layouts that fit, of those that do not, and of those that cannot
    run, with a line counting the rest (None or 0: every layout)."""
    shown = _shown(planned, top)
    lines = _table(planned, shown, hw, memory)
    lines.append(_footer(hw, memory))
    lines += getattr(planned, "notes", [])
    if len(shown) < len(planned):
        lines.append(_rest(planned, shown, top))
    if any(p.row.ok and p.row.flops is None for p in planned):
        lines.append(
            "note: estimated without a FLOP count for this model (a model family's counts): "
            "the step time leaves its compute out"
        )
    if any(p.row.ok and p.row.mem_temp_bytes is None for p in planned):
        lines.append(
            "note: estimated without an activation estimate for this model's pipelined "
            "layouts: memory is the state and batch shards only, so a layout marked yes? "
            "may not fit"
        )
    if any(may_not_fit(p.row) for p in shown):
        lines.append(
            "note: yes? = estimated to fit (nothing compiled), but not were its temporaries "
            f"1/{TEMPS_LOW} of the estimate (1/{RESIDUALS_LOW} where they are the residuals "
            "JAX keeps: a model without a lab module's count), the lowest ratio of estimated "
            "to compiled temporaries on the test grid (docs/lab.md); `jaxpar inspect` on the "
            "devices themselves says how much it holds"
        )
    lines += [_fix(p) for p in shown if not p.row.ok or not p.row.fits]
    found = best(planned)
    margin = (
        ""
        if not (found and may_not_fit(found[1]))
        else " (yes?: its activations are not estimated)"
        if found[1].mem_temp_bytes is None
        else " (yes?: within the estimate's margin)"
    )
    lines.append(
        f"fastest that fits: `{found[0]}`, predicted "
        f"{fmt_time(found[1].predicted_step_time_s)}{margin}"
        if found
        else "no layout fits"
        if any(p.row.ok for p in planned)
        else "no layout can run (each row says why)"
    )
    return "\n".join(lines)


def _kinds(planned: list[Planned]) -> tuple[list[Planned], list[Planned], list[Planned]]:
    """The layouts that fit, those that do not, and those that cannot run (ranked)."""
    fitting = [p for p in planned if p.row.ok and p.row.fits]
    return (
        fitting,
        [p for p in planned if p.row.ok and not p.row.fits],
        [p for p in planned if not p.row.ok],
    )


def _shown(planned: list[Planned], top: int | None) -> list[Planned]:
    """The layouts printed: every one, or the ``top`` first of each kind."""
    if not top:
        return list(planned)
    return [p for kind in _kinds(planned) for p in kind[:top]]


def _rest(planned: list[Planned], shown: list[Planned], top: int | None) -> str:
    """The line that counts the layouts not printed."""
    left = [len(kind) - len(kind[:top]) for kind in _kinds(planned)]
    what = ("that fit", "that do not fit", "that cannot run")
    parts = [f"{n:,} {w}" for n, w in zip(left, what) if n]
    return (
        f"note: {len(planned) - len(shown):,} more layouts not printed ({', '.join(parts)}): "
        "--top 0 prints them all, --out DIR writes them all to DIR/plan.csv"
    )


def _fix(p: Planned) -> str:
    """Why a layout cannot run, or why it does not fit and what does."""
    if not p.row.ok:
        return f"- {p.row.layout}: cannot run: {p.row.error}"
    fix = (
        f"fits as `{p.suggestion}` ({fmt_value(p.suggestion_row.mem_total_bytes, 'B')}"
        f", predicted {fmt_time(p.suggestion_row.predicted_step_time_s)})"
        if p.suggestion_row
        else p.suggestion
    )
    return f"- {p.row.layout}: {p.why}; {fix}"


HEAD = [
    "#",
    "layout",
    "memory/device",
    "fits",
    "pred. step",
    "tokens/s/device",
    "MFU",
    "bound by",
    "collectives",
    "pred. comm",
    "measured/pred",
]


def _table(planned: list[Planned], shown: list[Planned], hw: Hardware, memory: float) -> list[str]:
    """The ranked table's lines of the ``shown`` layouts, each numbered by its place in
    the whole ranking; an estimate that fits within its margin of ``memory`` says yes?."""
    place = {id(p): i for i, p in enumerate(planned, 1)}
    body = []
    for p in shown:
        r = p.row
        rank = str(place[id(p)])
        if not r.ok:
            body.append([rank, r.layout, "", "invalid", *[""] * (len(HEAD) - 4)])
            continue
        body.append(
            [
                rank,
                r.layout,
                fmt_value(r.mem_total_bytes, "B"),
                ("yes?" if may_not_fit(r) else "yes") if r.fits else "NO",
                fmt_time(r.predicted_step_time_s),
                f"{r.predicted_tokens_per_s_per_device:,.0f}",
                "" if r.predicted_mfu is None else f"{r.predicted_mfu:.1%}",
                r.predicted_bound,
                f"{r.calls(hw.latency_per)} ({fmt_time(r.predicted_latency_s)})",
                fmt_value(r.predicted_comm_bytes, "B"),
                "" if r.comm_ratio is None else f"{r.comm_ratio:.2f}",
            ]
        )
    widths = [max(len(x[i]) for x in [HEAD, *body]) for i in range(len(HEAD))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        for row in [HEAD, ["-" * w for w in widths], *body]
    ]
