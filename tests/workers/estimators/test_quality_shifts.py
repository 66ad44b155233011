"""The quality benchmark's shifted test sets (bench/adaptation/_quality_shifts.py): pure functions
only."""

from __future__ import annotations

import numpy as np
import pytest

from bench.adaptation._quality_shifts import (
    CLEAN,
    MIXTURES,
    SHIFTS,
    Shift,
    brightness,
    condition_names,
    contrast,
    gaussian_blur,
    invert,
    scale,
    shifted,
)
from harness.digits import digits


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    x, _ = digits(n=300)
    return x


def test_conditions_are_clean_and_three_severities_per_shift_but_inversion() -> None:
    names = condition_names()
    assert names[0] == CLEAN
    assert len(names) == 1 + 5 * 3 + 1
    assert names[-1] == "invert-1"
    assert {"contrast-3", "brightness-1", "scale-2", "gaussian_noise-3", "gaussian_blur-1"} <= set(
        names
    )


@pytest.mark.parametrize("condition", condition_names())
def test_every_condition_keeps_shape_dtype_and_range(images: np.ndarray, condition: str) -> None:
    out = shifted(images, condition, seed=0)
    assert out.shape == images.shape
    assert out.dtype == np.float32
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert np.array_equal(out, shifted(images, condition, seed=0))  # reproducible
    if condition == CLEAN:
        assert np.array_equal(out, images)
    else:
        assert not np.array_equal(out, images)


@pytest.mark.parametrize("shift", [s for s in SHIFTS if len(s.levels) > 1], ids=lambda s: s.name)
def test_severity_moves_the_images_further(images: np.ndarray, shift: Shift) -> None:
    distances = [
        float(np.abs(shifted(images, f"{shift.name}-{s}", seed=0) - images).mean())
        for s in (1, 2, 3)
    ]
    assert 0 < distances[0] < distances[1] < distances[2], distances


def test_formulas_on_known_numbers() -> None:
    x = np.array([0.0, 0.5, 1.0, 0.5], dtype=np.float32).reshape(1, 1, 2, 2)  # mean 0.5
    assert np.allclose(contrast(x, 0.2), [[[[0.4, 0.5], [0.6, 0.5]]]])
    assert np.allclose(contrast(x, 0.2).mean(), x.mean())  # the pivot is the image's mean
    assert np.allclose(brightness(x, 0.3), [[[[0.3, 0.8], [1.0, 0.8]]]])  # clipped at 1
    assert np.allclose(scale(x, 0.05), x * 0.05)
    assert np.array_equal(invert(invert(x)), x)
    flat = np.full((1, 1, 8, 8), 0.25)
    assert np.allclose(gaussian_blur(flat, 1.5), flat)  # a constant image stays constant
    dot = np.zeros((2, 1, 8, 8))
    dot[0, 0, 4, 4] = 1.0
    blurred = gaussian_blur(dot, 1.0)
    assert abs(blurred.sum() - 1.0) < 1e-3  # the mass spreads (3 sigma to the border)
    assert blurred[0, 0, 4, 4] < 0.2
    assert np.allclose(blurred[0, 0, 3, 4], blurred[0, 0, 5, 4])  # symmetric around the dot
    assert not blurred[1].any()  # images are filtered one by one


def test_noise_differs_by_seed_and_condition(images: np.ndarray) -> None:
    a = shifted(images, "gaussian_noise-1", seed=0)
    assert not np.array_equal(a, shifted(images, "gaussian_noise-1", seed=1))
    clean_noise = a - images
    assert abs(float(clean_noise[images > 0.2].std()) - 0.08) < 0.01  # unclipped pixels


def test_unknown_conditions_are_refused(images: np.ndarray) -> None:
    for bad in ("fog-1", "contrast-4", "contrast", "invert-2"):
        with pytest.raises(ValueError, match=r"condition|severities"):
            shifted(images, bad, seed=0)
    with pytest.raises(ValueError, match="float32"):
        shifted(images.astype(np.float64), CLEAN, seed=0)


def test_per_image_variants_and_mixtures(images: np.ndarray) -> None:
    """Each image of a per-image variant is under its own level, and each image of a mixture
    is exactly that image under one of the two conditions."""
    uniform = condition_names()
    mixed = condition_names(mixed=True)[len(uniform) :]
    assert condition_names(mixed=True)[: len(uniform)] == uniform
    assert len(mixed) == len(SHIFTS) + len(MIXTURES)
    for condition in mixed:
        out = shifted(images, condition, seed=0)
        assert out.shape == images.shape and out.dtype == np.float32
        assert out.min() >= 0.0 and out.max() <= 1.0
        assert np.array_equal(out, shifted(images, condition, seed=0))
        assert not np.array_equal(out, images)
    ratio = shifted(images, "scale-h3", seed=0).sum(axis=(1, 2, 3)) / images.sum(axis=(1, 2, 3))
    assert 0.05 <= ratio.min() < ratio.max() <= 1.0 and len(np.unique(ratio.round(6))) > 100
    for a, b in MIXTURES:
        out = shifted(images, f"{a}+{b}", seed=0)
        from_a = (out == shifted(images, a, seed=0)).all(axis=(1, 2, 3))
        from_b = (out == shifted(images, b, seed=0)).all(axis=(1, 2, 3))
        assert (from_a | from_b).all() and 0.3 < from_b.mean() < 0.7
