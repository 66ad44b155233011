"""The shifted test sets of bench/adaptation/quality.py: pure numpy, no service, no torch.

Images are (N, 1, 8, 8) float32 in [0, 1] (scikit-learn's digits / 16), black background 0.
Each shift has three severities; the values are fixed in advance, not tuned to the results:

| shift | formula (per image x) | severities 1, 2, 3 | clipped to [0, 1] |
|---|---|---|---|
| contrast | (x - m) * c + m, m the image's mean | c = 0.4, 0.2, 0.05 | no (stays inside) |
| brightness | x + b | b = 0.1, 0.3, 0.5 | yes |
| scale | x * s | s = 0.4, 0.2, 0.05 | no (stays inside) |
| gaussian_noise | x + sigma * N(0, 1), i.i.d. per pixel | sigma = 0.08, 0.18, 0.38 | yes |
| gaussian_blur | Gaussian filter, std sigma pixels | sigma = 0.5, 1.0, 1.5 | no (stays inside) |
| invert | 1 - x (one severity) | | no |

Contrast, brightness and noise take ImageNet-C's values for its severities 1, 3 and 5
(Hendrycks & Dietterich 2019: contrast ``(x - mean) * c + mean``, brightness ``+b`` on the V
channel then clipped, Gaussian noise ``sigma`` then clipped); scale uses the contrast factors
with the pivot at black instead of at the image's mean. Clipping is where a camera or an 8-bit
image would saturate: brightness and noise push pixels past 1 (or below 0). ImageNet-C's blur
sigmas (1 to 6 pixels at 224 pixels, 0.4 to 1 at CIFAR's 32) do not transfer to 8x8 digits,
where one pixel is already a quarter of a stroke's length: 0.5, 1 and 1.5 pixels go from a
light to a heavy blur (scipy's ``gaussian_filter``, ``mode="nearest"`` as skimage's filter that
ImageNet-C calls, truncated at 4 sigma). ``invert`` is a semantic shift: white digits on black
become black digits on white, which no re-estimation of normalization statistics should be
expected to undo.

Conditions where one pooled set of statistics cannot fit every image (named in
:func:`condition_names` after the uniform ones):

- per-image variants ``<shift>-h3``: each image gets its own level, drawn uniformly between
  no shift (c = s = 1, b = sigma = 0) and severity 3's level, so the target distribution is a
  spread of shifts rather than one; ``invert-h1`` inverts each image with probability 1/2.
- mixtures ``<a>+<b>``: each image is shifted by condition ``a`` or ``b`` (``clean`` included),
  each with probability 1/2.

Both draw from generators seeded by ``seed`` and the condition's name, so they are
reproducible on their own too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
from scipy.ndimage import gaussian_filter

__all__ = [
    "CLEAN",
    "MIXTURES",
    "PER_IMAGE_SEVERITY",
    "SHIFTS",
    "Shift",
    "brightness",
    "condition_names",
    "contrast",
    "gaussian_blur",
    "gaussian_noise",
    "invert",
    "scale",
    "shifted",
]

CLEAN: Final = "clean"


def contrast(x: np.ndarray, c: float) -> np.ndarray:
    """``(x - m) * c + m`` with ``m`` each image's mean; x (N, C, H, W)."""
    m = x.mean(axis=(1, 2, 3), keepdims=True)  # (N, 1, 1, 1)
    out: np.ndarray = (x - m) * c + m
    return out


def brightness(x: np.ndarray, b: float) -> np.ndarray:
    return np.clip(x + b, 0.0, 1.0)


def scale(x: np.ndarray, s: float) -> np.ndarray:
    return x * s


def gaussian_noise(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return np.clip(x + rng.normal(0.0, sigma, size=x.shape), 0.0, 1.0)


def gaussian_blur(x: np.ndarray, sigma: float) -> np.ndarray:
    """Each image filtered over its two spatial axes only; x (N, C, H, W)."""
    blurred: np.ndarray = gaussian_filter(
        x, sigma=(0.0, 0.0, sigma, sigma), mode="nearest", truncate=4.0
    )
    return blurred


def invert(x: np.ndarray) -> np.ndarray:
    return 1.0 - x


@dataclass(frozen=True)
class Shift:
    """``apply(x, level, rng)`` for each of ``levels`` (severity 1 first); ``symbol`` names
    the level in the formula."""

    name: str
    symbol: str
    levels: tuple[float, ...]
    apply: Callable[[np.ndarray, float, np.random.Generator], np.ndarray]


SHIFTS: Final[tuple[Shift, ...]] = (
    Shift("contrast", "c", (0.4, 0.2, 0.05), lambda x, c, rng: contrast(x, c)),
    Shift("brightness", "b", (0.1, 0.3, 0.5), lambda x, b, rng: brightness(x, b)),
    Shift("scale", "s", (0.4, 0.2, 0.05), lambda x, s, rng: scale(x, s)),
    Shift("gaussian_noise", "sigma", (0.08, 0.18, 0.38), gaussian_noise),
    Shift("gaussian_blur", "sigma", (0.5, 1.0, 1.5), lambda x, s, rng: gaussian_blur(x, s)),
    Shift("invert", "", (1.0,), lambda x, _, rng: invert(x)),
)
_BY_NAME: Final = {shift.name: shift for shift in SHIFTS}
# The level "no shift" of each shift's parameter: one end of the per-image variants' range.
_IDENTITY: Final = {
    "contrast": 1.0,
    "brightness": 0.0,
    "scale": 1.0,
    "gaussian_noise": 0.0,
    "gaussian_blur": 0.0,
}
PER_IMAGE_SEVERITY: Final = 3  # the per-image variants range up to this severity's level
MIXTURES: Final[tuple[tuple[str, str], ...]] = (
    (CLEAN, "scale-3"),
    (CLEAN, "invert-1"),
    ("contrast-2", "brightness-3"),
    ("scale-2", "gaussian_noise-3"),
)


def condition_names(shifts: tuple[Shift, ...] = SHIFTS, mixed: bool = False) -> list[str]:
    """``clean`` and ``<shift>-<severity>`` for every severity, in table order; with
    ``mixed``, then the per-image variants ``<shift>-h<severity>`` and the mixtures
    ``<a>+<b>`` (see the module docstring)."""
    names = [CLEAN]
    for shift in shifts:
        names += [f"{shift.name}-{s}" for s in range(1, len(shift.levels) + 1)]
    if mixed:
        for shift in shifts:
            names.append(f"{shift.name}-h{min(PER_IMAGE_SEVERITY, len(shift.levels))}")
        names += [f"{a}+{b}" for a, b in MIXTURES]
    return names


def _per_image(x: np.ndarray, shift: Shift, severity: int, rng: np.random.Generator) -> np.ndarray:
    """Each image of ``x`` (N, C, H, W) float64 under its own level of ``shift``."""
    out = np.empty_like(x)
    if shift.name == "invert":
        flip = rng.random(len(x)) < 0.5  # (N,)
        out[:] = np.where(flip[:, None, None, None], invert(x), x)
        return out
    ends = sorted((_IDENTITY[shift.name], shift.levels[severity - 1]))
    levels = rng.uniform(ends[0], ends[1], size=len(x))  # (N,)
    for i, level in enumerate(levels):
        out[i : i + 1] = shift.apply(x[i : i + 1], float(level), rng)
    return out


def _mixture(x: np.ndarray, a: str, b: str, seed: int) -> np.ndarray:
    """Each image of ``x`` (N, C, H, W) under condition ``a`` or ``b``, 1/2 each."""
    pick_b = np.random.default_rng([seed, 1000, *map(ord, a + "+" + b)]).random(len(x)) < 0.5
    shifted_a = shifted(x, a, seed).astype(np.float64)
    shifted_b = shifted(x, b, seed).astype(np.float64)
    out: np.ndarray = np.where(pick_b[:, None, None, None], shifted_b, shifted_a)
    return out


def shifted(x: np.ndarray, condition: str, seed: int) -> np.ndarray:
    """The test images ``x`` (N, C, H, W) in [0, 1] under ``condition`` (a name from
    :func:`condition_names`), as float32. Random shifts draw from a generator seeded by
    ``seed``, the shift and the severity, so every condition is reproducible on its own."""
    if x.ndim != 4 or x.dtype != np.float32:
        raise ValueError(f"expected float32 images (N, C, H, W), got {x.dtype} {x.shape}")
    if condition == CLEAN:
        return x.copy()
    if "+" in condition:
        a, _, b = condition.partition("+")
        return _mixture(x, a, b, seed).astype(np.float32)
    name, _, severity_text = condition.rpartition("-")
    shift = _BY_NAME.get(name)
    per_image = severity_text.startswith("h")
    severity_text = severity_text.removeprefix("h")
    if shift is None or not severity_text.isdigit():
        raise ValueError(
            f"unknown condition {condition!r}; use one of {condition_names(mixed=True)}"
        )
    severity = int(severity_text)
    if not 1 <= severity <= len(shift.levels):
        raise ValueError(
            f"{name} has severities 1 to {len(shift.levels)}, got {severity} in {condition!r}"
        )
    rng = np.random.default_rng([seed, SHIFTS.index(shift), severity, int(per_image)])
    if per_image:
        return _per_image(x.astype(np.float64), shift, severity, rng).astype(np.float32)
    return shift.apply(x.astype(np.float64), shift.levels[severity - 1], rng).astype(np.float32)
