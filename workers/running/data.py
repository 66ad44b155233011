"""From validated numpy arrays (see ``service/formats/arrays.py``) to tensors and batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from api_schemas.jobs import num_batches
from workers.errors import DataError

__all__ = ["iter_batches", "num_batches", "to_tensors"]


def _tensor(array: np.ndarray) -> torch.Tensor:
    # torch.from_numpy shares memory and warns on read-only arrays (memory-mapped files).
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def to_tensors(x: np.ndarray, y: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` as float32 (uint8 scaled by 1/255 to [0, 1]); ``y`` as int64 class labels or
    float32 targets. The float32 ``x`` shares memory with the array where it can."""
    if x.dtype == np.uint8:
        x_t = _tensor(x).to(torch.float32).div_(255)
    elif x.dtype.kind == "f":
        x_t = _tensor(x).to(torch.float32)
    else:
        raise DataError(f"x must be float32 or uint8, got {x.dtype}; convert it before upload")
    if y is None:
        return x_t, None
    if len(y) != len(x):
        raise DataError(f"x has {len(x)} samples but y has {len(y)}; give one label per sample")
    if y.dtype.kind in "iu":
        return x_t, _tensor(y).to(torch.int64)
    if y.dtype.kind == "f":
        return x_t, _tensor(y).to(torch.float32)
    raise DataError(f"y must hold integer class labels or float targets, got {y.dtype}; convert it")


def iter_batches(
    x: torch.Tensor, batch_size: int, max_batches: int | None = None
) -> Iterator[torch.Tensor]:
    """Contiguous views ``x[i : i + batch_size]`` (B, ...) in order; the last may be short.
    Arguments are checked now, not at the first ``next``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
    count = num_batches(x.shape[0], batch_size, max_batches)
    return (x[i * batch_size : (i + 1) * batch_size] for i in range(count))
