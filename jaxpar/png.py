"""Pictures without a plotting library: a minimal PNG encoder and a 5×7 bitmap font.

Images are RGB uint8 arrays ``[height, width, 3]``. :func:`encode_png` turns one into
the bytes of a PNG (8-bit RGB, no interlace, filter type 0 on every row, one zlib
stream); :func:`draw_text` writes text onto one with the embedded font, which covers
printable ASCII (32–126) plus ``×``; any other character is drawn as ``?``.

Glyphs are 5×7 pixels (capitals and digits fill the box) in an 8-pixel-tall line: the
eighth row holds only the descenders of ``g j p q y ,``.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: Glyph box in font pixels (5×7), line height (the box plus a descender row), and the
#: horizontal advance (glyph plus one blank column).
GLYPH_W, GLYPH_H, LINE_H, ADVANCE = 5, 7, 8, 6

# Each glyph is 7 rows of 5 bits (bit 4 = leftmost column), written as 14 hex digits.
# Rows of this list are ASCII 32–126 in order, eight glyphs a row.
_ASCII_HEX = """
00000000000000 04040404000004 0A0A0A00000000 0A0A1F0A1F0A0A 040F140E051E04 18190204081303 0C12140815120D 0C040800000000
02040808080402 08040202020408 0004150E150400 0004041F040400 000000000C0408 0000001F000000 00000000000C0C 00010204081000
0E11131519110E 040C040404040E 0E11010204081F 1F02040201110E 02060A121F0202 1F101E0101110E 0608101E11110E 1F010204080808
0E11110E11110E 0E11110F01020C 000C0C000C0C00 000C0C000C0408 02040810080402 00001F001F0000 08040201020408 0E110102040004
0E11010D15150E 0E1111111F1111 1E11111E11111E 0E11101010110E 1C12111111121C 1F10101E10101F 1F10101E101010 0E11101711110F
1111111F111111 0E04040404040E 0702020202120C 11121418141211 1010101010101F 111B1515111111 11111915131111 0E11111111110E
1E11111E101010 0E11111115120D 1E11111E141211 0F10100E01011E 1F040404040404 1111111111110E 11111111110A04 1111111515150A
11110A040A1111 1111110A040404 1F01020408101F 0E08080808080E 00100804020100 0E02020202020E 040A1100000000 0000000000001F
08040200000000 00000E010F110F 1010161911111E 00000E1010110E 01010D1311110F 00000E111F100E 0609081C080808 000F11110F010E
10101619111111 04000C0404040E 0200060202120C 10101214181412 0C04040404040E 00001A15151111 00001619111111 00000E1111110E
00001E111E1010 00000D130F0101 00001619101010 00000E100E011E 08081C08080906 0000111111130D 00001111110A04 0000111115150A
0000110A040A11 000011110F010E 00001F0204081F 02040408040402 04040404040404 08040402040408 00000815020000
"""
_EXTRA_HEX = {"×": "00110A040A1100"}
# Glyphs with a descender: 8 rows (16 hex digits), replacing the 7-row forms above.
_DESCENDER_HEX = {
    "g": "00000F11110F010E", "j": "020006020202120C", "p": "00001E11111E1010",
    "q": "00000F11110F0101", "y": "00001111110F010E",
    ",": "00000000000C0408",
}


def _glyph(hex_rows: str) -> np.ndarray:
    """A ``[LINE_H, GLYPH_W]`` bool mask from 14 or 16 hex digits (rows of 5 bits)."""
    hex_rows = hex_rows.ljust(2 * LINE_H, "0")
    rows = [int(hex_rows[i:i + 2], 16) for i in range(0, 2 * LINE_H, 2)]
    bits = [[(r >> (GLYPH_W - 1 - c)) & 1 for c in range(GLYPH_W)] for r in rows]
    return np.array(bits, bool)


def _build_font() -> dict[str, np.ndarray]:
    """Character → glyph mask for printable ASCII and the extras."""
    codes = _ASCII_HEX.split()
    assert len(codes) == 95, len(codes)
    font = {chr(32 + i): _glyph(h) for i, h in enumerate(codes)}
    font.update({ch: _glyph(h) for ch, h in {**_EXTRA_HEX, **_DESCENDER_HEX}.items()})
    return font


#: The embedded font: character → ``[LINE_H, GLYPH_W]`` bool mask.
FONT: dict[str, np.ndarray] = _build_font()


# ---- PNG -----------------------------------------------------------------------------------


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, tag, data, CRC-32 of tag + data."""
    crc = zlib.crc32(tag + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)


def encode_png(rgb: np.ndarray) -> bytes:
    """A minimal PNG (RGB8, no interlace, filter 0 on every row) of an ``[h, w, 3]`` array.

    Raises:
      ValueError: if ``rgb`` is not a non-empty uint8 ``[h, w, 3]`` array.
    """
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ValueError(f"encode_png needs a non-empty uint8 [h, w, 3] array, got "
                         f"{rgb.dtype} {rgb.shape}; convert with np.asarray(x, np.uint8)")
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (PNG_SIGNATURE + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + _png_chunk(b"IEND", b""))


def write_png_file(rgb: np.ndarray, path: str | Path) -> Path:
    """Writes ``rgb`` as a PNG at ``path`` atomically (parent folders created).

    The bytes go to a temporary file in the same folder, which then replaces ``path``,
    so a reader never sees a half-written image.

    Raises:
      ValueError: as :func:`encode_png`.
    """
    path = Path(path)
    data = encode_png(rgb)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---- text ----------------------------------------------------------------------------------


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of ``text`` drawn at ``scale`` (no blank column after the last glyph)."""
    return max(0, (ADVANCE * len(text) - 1) * scale)


def text_height(scale: int = 1) -> int:
    """Height in pixels of a line of text drawn at ``scale`` (descender row included)."""
    return LINE_H * scale


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """The ``[text_height(scale), text_width(text, scale)]`` bool mask of ``text``."""
    mask = np.zeros((LINE_H, max(0, ADVANCE * len(text) - 1)), bool)
    for i, ch in enumerate(text):
        mask[:, ADVANCE * i:ADVANCE * i + GLYPH_W] = FONT.get(ch, FONT["?"])
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def draw_text(img: np.ndarray, x: int, y: int, text: str,
              rgb: tuple[int, int, int], scale: int = 1) -> int:
    """Draws ``text`` onto ``img`` with its top-left corner at pixel ``(x, y)``.

    Only the glyphs' set pixels are painted; whatever falls outside ``img`` is clipped.

    Args:
      img: an ``[h, w, 3]`` uint8 array, changed in place.
      x: column of the left edge of the first glyph (may be negative).
      y: row of the top of the glyphs (may be negative).
      text: the characters; ones outside the font are drawn as ``?``.
      rgb: the colour of the set pixels.
      scale: each font pixel becomes a ``scale × scale`` square.

    Returns:
      The column just past the text, ``x + text_width(text, scale)``.

    Raises:
      ValueError: if ``scale`` is less than 1.
    """
    if scale < 1:
        raise ValueError(f"draw_text scale={scale}: use a positive integer")
    mask = text_mask(text, scale)
    h, w = mask.shape
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + h, img.shape[0]), min(x + w, img.shape[1])
    if y1 > y0 and x1 > x0:
        visible = mask[y0 - y:y1 - y, x0 - x:x1 - x]
        img[y0:y1, x0:x1][visible] = rgb
    return x + w
