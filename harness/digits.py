"""scikit-learn's 8x8 digits as the tests' and benches' datasets: the arrays, and an npz of them
as a dataset upload takes it."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits

from harness.stack import npz_bytes

__all__ = ["digits", "digits_npz"]


def digits(shifted: bool = False, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` digits (all 1,797 by default) as (x, y); ``shifted`` lowers the contrast
    and raises the brightness, a shift the BatchNorm statistics can adapt to."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8) in [0, 1]
    if shifted:
        x = np.clip(x * 0.5 + 0.3, 0, 1).astype(np.float32)  # contrast down, brightness up
    y = data.target.astype(np.int64)
    return (x[:n], y[:n]) if n else (x, y)


def digits_npz(shifted: bool = False, n: int | None = None, labels: bool = True) -> bytes:
    """:func:`digits` as the bytes of an npz (``x``, and ``y`` with ``labels``)."""
    x, y = digits(shifted, n)
    return npz_bytes(x=x, y=y) if labels else npz_bytes(x=x)
