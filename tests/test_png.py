"""The PNG encoder, the bitmap font and the layout-lab bar chart.

Images are decoded here with an independent little PNG reader (zlib + struct), and
expectations are recomputed from the definitions (glyph box, bar length ∝ value).
"""

import numpy as np
import pytest

from jaxpar import png
from jaxpar.lab import chart
from tests.helpers import decode_png as decode

# ---- PNG -------------------------------------------------------------------------------------


def test_encode_png_roundtrip():
    rgb = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    out = decode(png.encode_png(rgb))
    assert out.shape == (7, 5, 3)
    np.testing.assert_array_equal(out, rgb)


def test_encode_png_rejects_bad_arrays():
    for bad in (np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                np.zeros((4, 4, 4), np.uint8), np.zeros((0, 4, 3), np.uint8)):
        with pytest.raises(ValueError, match="uint8"):
            png.encode_png(bad)


def test_write_png_file(tmp_path):
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    path = png.write_png_file(rgb, tmp_path / "a" / "b.png")
    assert path == tmp_path / "a" / "b.png"
    np.testing.assert_array_equal(decode(path.read_bytes()), rgb)
    assert [p.name for p in path.parent.iterdir()] == ["b.png"]  # no temporary left behind
    png.write_png_file(255 - rgb, path)  # replaces the file
    np.testing.assert_array_equal(decode(path.read_bytes()), 255 - rgb)


# ---- font ------------------------------------------------------------------------------------

A_ROWS = ["01110", "10001", "10001", "10001", "11111", "10001", "10001"]


def _blank(h=40, w=60) -> np.ndarray:
    return np.full((h, w, 3), 255, np.uint8)


def _ink(img: np.ndarray) -> np.ndarray:
    return (img != 255).any(axis=2)


@pytest.mark.parametrize("scale", [1, 3])
def test_draw_text_A_inside_its_box(scale):
    img = _blank()
    x, y = 4, 6
    end = png.draw_text(img, x, y, "A", (0, 0, 0), scale)
    assert end == x + 5 * scale == x + png.text_width("A", scale)
    ink = _ink(img)
    box = np.zeros_like(ink)
    box[y:y + 7 * scale, x:x + 5 * scale] = True
    assert ink.any() and not (ink & ~box).any()
    expected = np.array([[c == "1" for c in row] for row in A_ROWS])
    expected = expected.repeat(scale, axis=0).repeat(scale, axis=1)
    np.testing.assert_array_equal(ink[y:y + 7 * scale, x:x + 5 * scale], expected)
    assert (img[ink] == 0).all()


def test_glyphs_differ():
    masks = {ch: png.text_mask(ch) for ch in "Il1|O0"}
    assert not np.array_equal(masks["I"], masks["l"])
    assert len({m.tobytes() for m in masks.values()}) == len(masks)
    # every printable ASCII character except space has ink, and they are all distinct
    printable = [chr(c) for c in range(33, 127)]
    inked = [png.text_mask(ch) for ch in printable]
    assert all(m.any() for m in inked)
    assert len({m.tobytes() for m in inked}) == len(printable)
    assert not png.text_mask(" ").any()


def test_unknown_character_draws_question_mark():
    np.testing.assert_array_equal(png.text_mask("é"), png.text_mask("?"))


def test_text_width_and_spacing():
    assert png.text_width("", 2) == 0
    assert png.text_width("AB", 2) == (6 * 2 - 1) * 2
    mask = png.text_mask("AA", 2)
    assert mask.shape == (png.text_height(2), png.text_width("AA", 2))
    np.testing.assert_array_equal(mask[:, :10], mask[:, 12:22])  # second A 6 px·scale on
    assert not mask[:, 10:12].any()  # the blank column between glyphs


def test_draw_text_clips_at_edges():
    scale = 2
    full = _blank()
    png.draw_text(full, 10, 10, "AB", (0, 0, 0), scale)
    clipped = _blank(16, 20)
    png.draw_text(clipped, -3, -5, "AB", (0, 0, 0), scale)  # hangs off top, left and right
    np.testing.assert_array_equal(_ink(clipped), _ink(full)[15:31, 13:33])
    untouched = _blank(8, 8)
    png.draw_text(untouched, 100, -50, "AB", (0, 0, 0), scale)
    assert not _ink(untouched).any()
    with pytest.raises(ValueError, match="scale"):
        png.draw_text(untouched, 0, 0, "A", (0, 0, 0), 0)


# ---- fmt_value -------------------------------------------------------------------------------


@pytest.mark.parametrize("v, unit, text", [
    (12.3 * 2**20, "B", "12.3 MiB"),
    (512, "B", "512 B"),
    (1536, "B", "1.5 KiB"),
    (3 * 2**30, "B", "3 GiB"),
    (0.9 * 2**30, "B", "922 MiB"),
    (1.2e9, "FLOP", "1.2e9 FLOP"),
    (5000, "FLOP", "5000 FLOP"),
    (0.41, "s", "0.41 s"),
    (2.5, "s", "2.5 s"),
    (0.0042, "s", "4.2 ms"),
    (3e-6, "s", "3 us"),
    (0, "s", "0 s"),
    (123456, "", "1.23e5"),
    (0.123456, "", "0.123"),
    (99999, "", "1e5"),
    (None, "B", "n/a"),
    (None, "", "n/a"),
])
def test_fmt_value(v, unit, text):
    assert chart.fmt_value(v, unit) == text


# ---- render_bars -----------------------------------------------------------------------------


def _count(img: np.ndarray, y: int, rgb) -> int:
    """Pixels of colour ``rgb`` in image row ``y``."""
    return int((img[y] == np.array(rgb, np.uint8)).all(axis=1).sum())


def _rows_with(img: np.ndarray, rgb) -> set[int]:
    return set(np.nonzero((img == np.array(rgb, np.uint8)).all(axis=2).any(axis=1))[0].tolist())


def test_bars_proportional():
    labels = ["a", "b", "c"]
    img = chart.render_bars(labels, [("metric", [1.0, 2.0, 4.0], "")])
    lay = chart.layout(labels, [("metric", [1.0, 2.0, 4.0], "")])
    assert img.shape == (lay.height, lay.width, 3) and img.dtype == np.uint8
    n = [_count(img, y + 2, chart.BAR_RGB) for y in lay.row_y[0]]
    assert n[0] > 10
    assert abs(n[1] - 2 * n[0]) <= 1 and abs(n[2] - 4 * n[0]) <= 2
    # bar colour appears only in the three label rows, every row of each band the same
    bands = {y + k for y in lay.row_y[0] for k in range(png.text_height(chart.SCALE))}
    assert _rows_with(img, chart.BAR_RGB) == bands
    for y, count in zip(lay.row_y[0], n):
        assert all(_count(img, y + k, chart.BAR_RGB) == count
                   for k in range(png.text_height(chart.SCALE)))


def test_bars_compare_within_a_panel_only():
    labels = ["a", "b"]
    panels = [("small", [1.0, 2.0], "s"), ("big", [1e9, 2e9], "B")]
    img = chart.render_bars(labels, panels)
    lay = chart.layout(labels, panels)
    small = [_count(img, y + 2, chart.BAR_RGB) for y in lay.row_y[0]]
    big = [_count(img, y + 2, chart.BAR_RGB) for y in lay.row_y[1]]
    assert small == big and abs(small[1] - 2 * small[0]) <= 1


def test_none_has_no_bar_but_says_na():
    labels = ["ok", "invalid", "ok2"]
    panels = [("memory", [1.0, None, 4.0], "B")]
    img = chart.render_bars(labels, panels)
    lay = chart.layout(labels, panels)
    band = img[lay.row_y[0][1]:lay.row_y[0][1] + png.text_height(chart.SCALE)]
    assert not (band == np.array(chart.BAR_RGB, np.uint8)).all(axis=2).any()
    na = png.text_mask("n/a", chart.SCALE)
    got = (band[:, lay.bar_x:lay.bar_x + na.shape[1]] == np.array(chart.NA_RGB, np.uint8))
    np.testing.assert_array_equal(got.all(axis=2), na)
    n = [_count(img, lay.row_y[0][i] + 2, chart.BAR_RGB) for i in (0, 2)]
    assert n[0] > 0 and abs(n[1] - 4 * n[0]) <= 2


def test_value_text_follows_the_bar():
    labels = ["a", "b"]
    panels = [("t", [1.0, 3.0], "s")]
    img = chart.render_bars(labels, panels)
    lay = chart.layout(labels, panels)
    for y in lay.row_y[0]:
        band = img[y:y + png.text_height(chart.SCALE), lay.bar_x:]
        bar = (band == np.array(chart.BAR_RGB, np.uint8)).all(axis=2)
        text = (band == np.array(chart.TEXT_RGB, np.uint8)).all(axis=2)
        bar_end = np.nonzero(bar.any(axis=0))[0].max()
        text_cols = np.nonzero(text.any(axis=0))[0]
        assert text_cols.size and text_cols.min() > bar_end


def test_paired_bars_and_legend():
    labels = ["a", "b", "c"]
    panels = [("bytes", [(1.0, 2.0), (4.0, None), None], "B")]
    img = chart.render_bars(labels, panels)
    lay = chart.layout(labels, panels)
    top = [y + 1 for y in lay.row_y[0]]
    low = [y + chart.PAIR_BAR_H + chart.PAIR_GAP + 1 for y in lay.row_y[0]]
    measured = [_count(img, y, chart.BAR_RGB) for y in top]
    predicted = [_count(img, y, chart.PREDICTED_RGB) for y in low]
    assert measured[0] > 10 and abs(measured[1] - 4 * measured[0]) <= 2 and measured[2] == 0
    assert abs(predicted[0] - 2 * measured[0]) <= 1 and predicted[1:] == [0, 0]
    assert [_count(img, y, chart.PREDICTED_RGB) for y in top] == [0, 0, 0]
    # the legend line under the title holds a swatch of each bar colour
    legend = img[lay.legend_y[0]:lay.legend_y[0] + png.text_height(chart.SCALE)]
    for rgb in (chart.BAR_RGB, chart.PREDICTED_RGB):
        assert (legend == np.array(rgb, np.uint8)).all(axis=2).any()
    assert lay.legend_y[0] < lay.row_y[0][0]


def test_unpaired_panel_has_no_legend():
    lay = chart.layout(["a"], [("t", [1.0], "s")])
    assert lay.legend_y == (None,)


def test_render_bars_rejects_mismatched_values():
    with pytest.raises(ValueError, match="2 values for 3 labels"):
        chart.render_bars(["a", "b", "c"], [("t", [1.0, 2.0], "")])
    with pytest.raises(ValueError, match="at least one label"):
        chart.render_bars([], [("t", [], "")])


def test_write_chart_decodes_to_render(tmp_path):
    labels = ["data=8", "fsdp=8", "tensor=8"]
    panels = [("memory", [2**30, 2**29, None], "B"),
              ("collectives", [(1e6, 2e6), (3e6, 2.5e6), None], "B"),
              ("step", [0.41, 0.5, None], "s")]
    path = chart.write_chart(labels, panels, tmp_path / "lab" / "chart.png")
    np.testing.assert_array_equal(decode(path.read_bytes()), chart.render_bars(labels, panels))
