"""Rotary frequencies: the base ``theta`` and the frequency scalings Llama-style models use.

A rotary embedding turns each pair of a head's dims at position p by the angle
p · inv_freq[i]. The kinds of scaling (Hugging Face's ``rope_type``):

* ``default``: inv_freq[i] = theta^(−2i/H).
* ``linear``: every frequency divided by ``factor`` (positions stretched ``factor``-fold).
* ``llama3`` (Llama 3.1 and later): wavelengths shorter than
  ``original_max_len / high_freq_factor`` keep their frequency, those longer than
  ``original_max_len / low_freq_factor`` are divided by ``factor``, and the band between
  is interpolated smoothly.

The arithmetic follows transformers' ``modeling_rope_utils`` step by step in float32,
so a loaded checkpoint rotates exactly as it was trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

#: ``model.rope_type`` values.
RopeType = Literal["default", "linear", "llama3"]


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are scaled (see the module docstring)."""

    kind: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


#: No scaling: every frequency theta^(−2i/H).
NO_SCALING = RopeScaling()


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling = NO_SCALING) -> np.ndarray:
    """The ``head_dim / 2`` inverse frequencies (float32) of a rotary embedding."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's smooth scaling of long wavelengths."""
    f32 = np.float32
    low_wavelen = s.original_max_len / s.low_freq_factor
    high_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / f32(s.factor), inv_freq).astype(f32)
    smooth = (
        (s.original_max_len / wavelen - s.low_freq_factor)
        / (s.high_freq_factor - s.low_freq_factor)
    ).astype(f32)
    smoothed = ((1 - smooth) * scaled / f32(s.factor) + smooth * scaled).astype(f32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)
