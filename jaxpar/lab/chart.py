"""Comparison charts of layouts: one horizontal-bar panel per metric, drawn with matplotlib.

How to read a chart from :func:`chart_figure` (``sweep.png`` of ``jaxpar sweep``):

* one panel per metric, two panels a row; each has its title and, on its x axis, the
  quantity and its unit (bytes in B/KiB/MiB/GiB…, seconds in s/ms/us, chosen per panel);
* inside a panel there is one row per label (a layout, e.g. ``data=2,fsdp=2,tensor=2``),
  the labels down the left edge, a bar whose length is the value, then the value as text
  (see :func:`fmt_value`); bars compare within a panel, never across panels;
* ``n/a`` with no bar marks a missing value — e.g. a layout that is invalid;
* a panel whose values are pairs ``(measured, predicted)`` draws two bars per row,
  measured (blue) above predicted (orange), with a legend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from jaxpar.figures import new_figure, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: One value of a panel: a number, ``None`` (missing), or a ``(measured, predicted)`` pair.
Value = float | None | tuple[float | None, float | None]


class Panel(NamedTuple):
    """One metric: its title, one value per label, the unit for :func:`fmt_value`
    (``"B"``, ``"s"``, or any other) and what the x axis measures (e.g. ``"bytes per
    device"``; its unit is added in parentheses)."""

    title: str
    values: list[Value]
    unit: str
    quantity: str = ""


#: Bar colour of single values and of measured values.
BAR_COLOUR = "#4378c8"
#: Bar colour of predicted values.
PREDICTED_COLOUR = "#e88c28"
#: Colour of the missing-value text.
NA_COLOUR = "#969696"
#: Panel width (inches).
PANEL_W_IN = 4.6
#: Height per label row (inches).
ROW_IN = 0.39
#: Room for a panel's title and axis (inches).
PANEL_EXTRA_IN = 1.1
#: Width of a label character (inches).
LABEL_CHAR_IN = 0.075
#: Text size (points).
FONT_PT = 9.0
_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


# ---- numbers -------------------------------------------------------------------------------


def _number(x: float) -> str:
    """About three significant digits: ``0.412``, ``12.3``, ``1234``, ``1.23e9``."""
    a = abs(x)
    if a == 0:
        return "0"
    if 100 <= a < 1e4:
        return f"{x:.0f}"
    if 0.01 <= a < 100:
        return f"{x:.3g}"
    exp = math.floor(math.log10(a))
    mant = f"{x / 10.0**exp:.3g}"
    if mant.lstrip("-") == "10":  # rounding carried into the next power of ten
        mant, exp = mant.replace("10", "1"), exp + 1
    return f"{mant}e{exp}"


def _bytes(v: float) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 KiB``, ``12.3 MiB``, ``2 GiB``."""
    if abs(v) < 1024:
        return f"{v:.0f} B"
    for unit in _BYTE_UNITS:
        v /= 1024
        if abs(v) < 1024:
            return f"{_number(v)} {unit}"
    return f"{_number(v)} {_BYTE_UNITS[-1]}"


def _seconds(v: float) -> str:
    """Seconds, switching to ``ms`` below 0.01 s and ``us`` below 10 µs."""
    a = abs(v)
    if a == 0 or a >= 0.01:
        return f"{_number(v)} s"
    if a >= 1e-5:
        return f"{_number(v * 1e3)} ms"
    return f"{_number(v * 1e6)} us"


def fmt_value(v: float | None, unit: str) -> str:
    """A compact text of ``v`` in ``unit``, about three significant digits.

    Examples: ``fmt_value(12.3 * 2**20, "B") == "12.3 MiB"``,
    ``fmt_value(1.2e9, "FLOP") == "1.2e9 FLOP"``, ``fmt_value(0.41, "s") == "0.41 s"``,
    ``fmt_value(0.0042, "s") == "4.2 ms"``, ``fmt_value(123456, "") == "1.23e5"``,
    ``fmt_value(None, "B") == "n/a"``.

    Args:
      v: the value; ``None`` gives ``"n/a"``.
      unit: ``"B"`` (bytes, shown in B/KiB/MiB/GiB/TiB/PiB), ``"s"`` (seconds, shown
        in s/ms/us), ``""`` (a bare number) or any other unit, appended as is
        (e.g. ``"FLOP"``).
    """
    if v is None:
        return "n/a"
    v = float(v)
    if not math.isfinite(v):
        return f"{v} {unit}".rstrip()
    if unit == "B":
        return _bytes(v)
    if unit == "s":
        return _seconds(v)
    return f"{_number(v)} {unit}".rstrip()


# ---- values --------------------------------------------------------------------------------


def _is_paired(values: list[Value]) -> bool:
    """Whether a panel holds ``(measured, predicted)`` pairs."""
    return any(isinstance(v, (tuple, list)) for v in values)


def _pair(v: Value) -> tuple[float | None, float | None]:
    """``v`` as ``(measured, predicted)``: ``None`` → both missing, a number → measured only."""
    if v is None:
        return None, None
    if isinstance(v, (tuple, list)):
        return v[0], v[1]
    return v, None


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(float(x))


def _panel_max(values: list[Value]) -> float:
    """The largest finite value of a panel (both halves of pairs), 0 when there is none."""
    return max((abs(float(x)) for v in values for x in _pair(v) if _finite(x)), default=0.0)


def axis_unit(vmax: float, unit: str) -> tuple[float, str]:
    """(divisor, unit text) for an axis whose largest value is ``vmax``.

    Bytes take the largest binary unit that keeps ``vmax`` ≥ 1 (``B``, ``KiB``, ``MiB``…),
    seconds ``s`` from 0.01 s up, ``ms`` from 10 µs, ``us`` below (as :func:`fmt_value`);
    any other unit is kept as it is (divisor 1).
    """
    if unit == "B":
        divisor = 1.0
        name = "B"
        for next_name in _BYTE_UNITS:
            if vmax < divisor * 1024:
                break
            divisor = divisor * 1024
            name = next_name
        return divisor, name
    if unit == "s":
        if vmax == 0 or vmax >= 0.01:
            return 1.0, "s"
        return (1e-3, "ms") if vmax >= 1e-5 else (1e-6, "us")
    return 1.0, unit


def _check(labels: list[str], panels: list[Panel]) -> None:
    """Raises ValueError unless there are labels, panels, and one value per label."""
    if not labels or not panels:
        raise ValueError(
            f"chart_figure needs at least one label and one panel, got "
            f"{len(labels)} labels and {len(panels)} panels"
        )
    for panel in panels:
        if len(panel.values) != len(labels):
            raise ValueError(
                f"panel {panel.title!r} has {len(panel.values)} values for "
                f"{len(labels)} labels; give one value (or None) per label"
            )
        bad = [v for v in panel.values if isinstance(v, (tuple, list)) and len(v) != 2]
        if bad:
            raise ValueError(
                f"panel {panel.title!r}: pairs must be (measured, predicted), got {bad[0]}"
            )


# ---- drawing -------------------------------------------------------------------------------


def _bars(
    ax: Axes,
    ys: list[float],
    values: list[float | None],
    divisor: float,
    height: float,
    colour: str,
    unit: str,
    label: str | None,
    quiet: list[bool] | None = None,
) -> None:
    """One bar per value at rows ``ys`` (none for a missing value), each with its text;
    ``quiet[i]``: no ``n/a`` text for a missing value ``i`` (its row says it already)."""
    widths = [float(v) / divisor if _finite(v) else 0.0 for v in values]
    bars = ax.barh(ys, widths, height=height, color=colour, label=label)
    quiet = quiet or [False] * len(values)
    texts = [
        "" if q and not _finite(v) else fmt_value(v if _finite(v) else None, unit)
        for v, q in zip(values, quiet)
    ]
    for text in ax.bar_label(bars, texts, padding=3, fontsize=FONT_PT - 1):
        if text.get_text() == "n/a":
            text.set_color(NA_COLOUR)


def _draw_panel(ax: Axes, labels: list[str], panel: Panel) -> None:
    """The bars of one panel, its title, its x axis label with the unit."""
    divisor, unit_text = axis_unit(_panel_max(panel.values), panel.unit)
    rows = list(range(len(labels)))
    if _is_paired(panel.values):
        pairs = [_pair(v) for v in panel.values]
        _bars(
            ax,
            [y - 0.2 for y in rows],
            [m for m, _ in pairs],
            divisor,
            0.38,
            BAR_COLOUR,
            panel.unit,
            "measured",
        )
        _bars(
            ax,
            [y + 0.2 for y in rows],
            [p for _, p in pairs],
            divisor,
            0.38,
            PREDICTED_COLOUR,
            panel.unit,
            "predicted",
            [not _finite(m) for m, _ in pairs],
        )
        ax.legend(loc="best", fontsize="small")
    else:
        _bars(ax, rows, list(panel.values), divisor, 0.6, BAR_COLOUR, panel.unit, None)
    ax.set_title(panel.title, fontsize="medium", loc="left")
    ax.set_xlabel(f"{panel.quantity} ({unit_text})" if panel.quantity else unit_text)
    ax.margins(x=0.3)  # room for the value texts right of the longest bar
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def chart_figure(labels: list[str], panels: list[Panel | tuple]) -> Figure:
    """A comparison chart of ``labels`` over several metrics (see the module docstring).

    Args:
      labels: one name per compared item (e.g. per layout), down the left edge.
      panels: :class:`Panel` s (or tuples of its fields) per metric; ``values`` has one
        entry per label: a number, ``None`` (drawn as ``n/a``), or a ``(measured,
        predicted)`` pair (either half may be ``None``).

    Returns:
      The figure: one axes per panel, in order (unused grid cells removed); in each, one
      :class:`~matplotlib.container.BarContainer` per series (``measured`` and
      ``predicted`` in a paired panel) with a bar per label, label ``i`` on row ``i``
      (top to bottom), bar lengths in the x axis' unit.

    Raises:
      TaskError: if there are no labels or panels, or a panel's values do not match
        the labels one to one.
    """
    panels = [Panel(*p) for p in panels]
    _check(labels, panels)
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    label_in = LABEL_CHAR_IN * max(len(s) for s in labels)
    fig = new_figure(label_in + ncols * PANEL_W_IN, nrows * (PANEL_EXTRA_IN + ROW_IN * len(labels)))
    grid = fig.subplots(nrows, ncols, sharey=True, squeeze=False)
    axes = grid.ravel()
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, labels, panel)
    for ax in axes[len(panels) :]:
        fig.delaxes(ax)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].set_ylim(len(labels) - 0.5, -0.5)  # first label on top
    return fig


def write_chart(labels: list[str], panels: list[Panel | tuple], path: str | Path) -> Path:
    """Writes :func:`chart_figure` at ``path`` (folders created; format from the suffix:
    ``.png``, ``.svg`` …), mode 0644."""
    return save_figure(chart_figure(labels, panels), path)
