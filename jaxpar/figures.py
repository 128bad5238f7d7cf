"""Figures drawn with matplotlib, written atomically.

matplotlib is imported inside the functions that draw, so ``import jaxpar`` stays fast.
Figures are :class:`matplotlib.figure.Figure` objects on the Agg canvas, made without
pyplot: no global figure registry to leak into, no GUI backend chosen behind a user's back,
nothing to close. :func:`save_figure` writes one atomically in the format its path's
suffix names (``.png``, ``.svg``, ``.pdf``, …), readable by everyone (mode 0644).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.errors import PathError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Pixels per inch of raster images (PNG).
DPI = 100
#: File mode of written images: readable by everyone, whatever the umask.
IMAGE_MODE = 0o644


def new_figure(width: float, height: float) -> Figure:
    """An empty figure of ``width × height`` inches on the Agg canvas, constrained layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def image_format(path: str | Path) -> str:
    """The format matplotlib writes for ``path``: its suffix, or ``png`` when it has none.

    Raises:
      PathError: for a suffix matplotlib cannot write, listing the ones it can.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix not in formats:
        others = ", ".join("." + f for f in sorted(formats) if f not in ("png", "svg"))
        raise PathError(
            f"cannot write an image to '{path}': end the path in .png or .svg "
            f"(matplotlib also writes {others})"
        )
    return suffix


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Writes ``fig`` at ``path`` (parent folders created) and returns the path.

    The format follows the suffix (see :func:`image_format`). The image goes to a
    temporary file in the same folder, which then replaces ``path``, so a reader never
    sees a half-written image; the file is then made mode 0644 (a temporary file is
    created 0600).

    Raises:
      PathError: for a suffix matplotlib cannot write.
      OSError: naming ``path`` when it cannot be written (a full disk).
    """
    path = Path(path)
    fmt = image_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # no creation date in vector formats: the same figure gives the same file
            metadata = {"Date": None} if fmt in ("svg", "pdf") else None
            fig.savefig(f, format=fmt, dpi=DPI, metadata=metadata)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if err.filename:
            raise
        # a full disk's error names no file: the one-line report names the image
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    os.chmod(path, IMAGE_MODE)
    return path
