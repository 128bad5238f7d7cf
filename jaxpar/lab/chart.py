"""Comparison charts of layouts: one horizontal-bar panel per metric, drawn with NumPy.

How to read a chart from :func:`render_bars`:

* panels are stacked top to bottom, one per metric; each starts with its title;
* inside a panel there is one row per label (a layout, e.g. ``data=2,fsdp=2,tensor=2``),
  the label on the left, then a bar whose length is the value over the largest value
  of that panel (so bars compare within a panel, never across panels), then the value
  as text (see :func:`fmt_value`);
* ``n/a`` with no bar marks a missing value — e.g. a layout that is invalid;
* a panel whose values are pairs ``(measured, predicted)`` draws two thin bars per
  row, measured (blue) above predicted (orange), with a legend line under its title;
  the value text reads ``measured / predicted``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.png import draw_text, text_height, text_width, write_png_file

#: One value of a panel: a number, ``None`` (missing), or a ``(measured, predicted)`` pair.
Value = float | None | tuple[float | None, float | None]
#: One panel: (title, one value per label, unit for :func:`fmt_value`).
Panel = tuple[str, list[Value], str]

#: Text scale (font pixels → image pixels), margins and sizes in pixels.
SCALE = 2
MARGIN, BAR_W, ROW_GAP, PANEL_GAP, TEXT_GAP = 12, 320, 6, 16, 6
#: Height of each of the two thin bars of a pair, and the gap between them.
PAIR_BAR_H, PAIR_GAP = 6, 2
BACKGROUND_RGB = (255, 255, 255)
TEXT_RGB = (40, 40, 40)
TITLE_RGB = (0, 0, 0)
RULE_RGB = (200, 200, 200)
NA_RGB = (150, 150, 150)
#: Bar colours: single values and measured values; predicted values.
BAR_RGB = (66, 120, 200)
PREDICTED_RGB = (232, 140, 40)
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
    mant = f"{x / 10.0 ** exp:.3g}"
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
            break
    return f"{_number(v)} {unit}"


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


def _value_text(v: Value, unit: str, paired: bool) -> str:
    """The text after a bar: the value, or ``measured / predicted`` in a paired panel."""
    if not paired:
        return fmt_value(v, unit)
    measured, predicted = _pair(v)
    if measured is None and predicted is None:
        return "n/a"
    return f"{fmt_value(measured, unit)} / {fmt_value(predicted, unit)}"


def _panel_max(values: list[Value]) -> float:
    """The largest finite value of a panel (both halves of pairs), 0 when there is none."""
    flat = [x for v in values for x in _pair(v)]
    finite = [float(x) for x in flat if x is not None and math.isfinite(float(x))]
    return max(finite, default=0.0)


def bar_length(v: float | None, vmax: float) -> int:
    """Pixels of the bar of ``v`` when ``vmax`` gets :data:`BAR_W`; 0 for missing or ≤ 0."""
    if v is None or vmax <= 0 or not math.isfinite(float(v)) or v <= 0:
        return 0
    return max(1, round(BAR_W * float(v) / vmax))


def _check(labels: list[str], panels: list[Panel]) -> None:
    """Raises ValueError unless there are labels, panels, and one value per label."""
    if not labels or not panels:
        raise ValueError(f"render_bars needs at least one label and one panel, got "
                         f"{len(labels)} labels and {len(panels)} panels")
    for title, values, _ in panels:
        if len(values) != len(labels):
            raise ValueError(f"panel {title!r} has {len(values)} values for {len(labels)} "
                             "labels; give one value (or None) per label")
        bad = [v for v in values if isinstance(v, (tuple, list)) and len(v) != 2]
        if bad:
            raise ValueError(f"panel {title!r}: pairs must be (measured, predicted), got {bad[0]}")


# ---- layout --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where things go, in pixels.

    Attributes:
      width: image width.
      height: image height.
      bar_x: column where every bar starts.
      title_y: top row of each panel's title.
      legend_y: top row of each panel's legend line, ``None`` for unpaired panels.
      row_y: ``row_y[panel][label]``: top row of that label's bar(s) and text.
    """

    width: int
    height: int
    bar_x: int
    title_y: tuple[int, ...]
    legend_y: tuple[int | None, ...]
    row_y: tuple[tuple[int, ...], ...]


LEGEND = ("measured", " / ", "predicted")


def _content_width(labels: list[str], panels: list[Panel]) -> tuple[int, int]:
    """(bar_x, image width) fitting the labels, bars, value texts, titles and legends."""
    bar_x = MARGIN + max(text_width(s, SCALE) for s in labels) + MARGIN
    texts = [_value_text(v, unit, _is_paired(values))
             for _, values, unit in panels for v in values]
    right = bar_x + BAR_W + TEXT_GAP + max(text_width(t, SCALE) for t in texts) + MARGIN
    titles = max(text_width(title, SCALE) for title, _, _ in panels) + 1 + 2 * MARGIN
    legend = text_width("".join(LEGEND), SCALE) + 2 * text_height(SCALE) + 2 * MARGIN
    return bar_x, max(right, titles, legend)


def layout(labels: list[str], panels: list[Panel]) -> Layout:
    """The :class:`Layout` of the chart :func:`render_bars` draws for these arguments."""
    _check(labels, panels)
    th = text_height(SCALE)
    bar_x, width = _content_width(labels, panels)
    y, title_y, legend_y, row_y = MARGIN, [], [], []
    for _, values, _ in panels:
        title_y.append(y)
        y += th + ROW_GAP
        legend_y.append(y if _is_paired(values) else None)
        y += th + ROW_GAP if _is_paired(values) else 0
        row_y.append(tuple(y + i * (th + ROW_GAP) for i in range(len(labels))))
        y += len(labels) * (th + ROW_GAP) + PANEL_GAP
    height = y - PANEL_GAP - ROW_GAP + MARGIN
    return Layout(width, height, bar_x, tuple(title_y), tuple(legend_y), tuple(row_y))


# ---- drawing -------------------------------------------------------------------------------


def _draw_legend(img: np.ndarray, y: int) -> None:
    """``■ measured / ■ predicted``, each word after a swatch in its bar colour."""
    th = text_height(SCALE)
    x = MARGIN
    for word, rgb in zip(LEGEND, (BAR_RGB, None, PREDICTED_RGB)):
        if rgb is not None:
            img[y + 2:y + th - 2, x:x + th - 4] = rgb
            x += th
        x = draw_text(img, x, y, word, TEXT_RGB, SCALE)


def _draw_bars(img: np.ndarray, x: int, y: int, v: Value, vmax: float, paired: bool) -> int:
    """The bar(s) of one row from ``(x, y)``; returns the column just past the longest."""
    if not paired:
        n = bar_length(v, vmax)
        img[y:y + text_height(SCALE), x:x + n] = BAR_RGB
        return x + n
    measured, predicted = _pair(v)
    n, k = bar_length(measured, vmax), bar_length(predicted, vmax)
    img[y:y + PAIR_BAR_H, x:x + n] = BAR_RGB
    y2 = y + PAIR_BAR_H + PAIR_GAP
    img[y2:y2 + PAIR_BAR_H, x:x + k] = PREDICTED_RGB
    return x + max(n, k)


def _draw_row(img: np.ndarray, lay: Layout, y: int, label: str, v: Value,
              unit: str, vmax: float, paired: bool) -> None:
    """One label row: the label right-aligned before the bars, the bars, the value text."""
    draw_text(img, lay.bar_x - MARGIN - text_width(label, SCALE), y, label, TEXT_RGB, SCALE)
    text = _value_text(v, unit, paired)
    if text == "n/a":
        draw_text(img, lay.bar_x, y, text, NA_RGB, SCALE)
        return
    end = _draw_bars(img, lay.bar_x, y, v, vmax, paired)
    draw_text(img, end + TEXT_GAP, y, text, TEXT_RGB, SCALE)


def _draw_panel(img: np.ndarray, lay: Layout, i: int, labels: list[str], panel: Panel) -> None:
    """Panel ``i``: bold title and a rule under it, the legend if paired, one row per label."""
    title, values, unit = panel
    for dx in (0, 1):  # drawn twice, a pixel apart: bold
        draw_text(img, MARGIN + dx, lay.title_y[i], title, TITLE_RGB, SCALE)
    rule_y = lay.title_y[i] + text_height(SCALE) + ROW_GAP // 2
    img[rule_y, MARGIN:lay.width - MARGIN] = RULE_RGB
    if lay.legend_y[i] is not None:
        _draw_legend(img, lay.legend_y[i])
    vmax, paired = _panel_max(values), _is_paired(values)
    for y, label, v in zip(lay.row_y[i], labels, values):
        _draw_row(img, lay, y, label, v, unit, vmax, paired)


def render_bars(labels: list[str], panels: list[Panel]) -> np.ndarray:
    """A comparison chart of ``labels`` over several metrics (see the module docstring).

    Args:
      labels: one name per compared item (e.g. per layout), drawn left of the bars.
      panels: ``(title, values, unit)`` per metric; ``values`` has one entry per label:
        a number, ``None`` (drawn as ``n/a``), or a ``(measured, predicted)`` pair (either
        half may be ``None``). ``unit`` is passed to :func:`fmt_value`.

    Returns:
      The chart as an RGB uint8 array ``[height, width, 3]`` on a white background.

    Raises:
      ValueError: if there are no labels or panels, or a panel's values do not match
        the labels one to one.
    """
    lay = layout(labels, panels)
    img = np.empty((lay.height, lay.width, 3), np.uint8)
    img[:] = BACKGROUND_RGB
    for i, panel in enumerate(panels):
        _draw_panel(img, lay, i, labels, panel)
    return img


def write_chart(labels: list[str], panels: list[Panel], path: str | Path) -> Path:
    """Renders :func:`render_bars` and writes it as a PNG at ``path`` (folders created)."""
    return write_png_file(render_bars(labels, panels), path)
