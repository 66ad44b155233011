"""From a dataset file to tensors, a batch at a time.

A worker never holds a whole dataset (NOTE [ Reading datasets in bounded memory ] in
service/formats/arrays.py): :class:`Samples` is a view of ``x`` (memory-mapped where the file
allows) that reads and converts only the rows a batch asks for. Slicing a :class:`Samples`, or
indexing it with indices, gives another view; :func:`load_rows` turns rows of a view, or of a
plain tensor, into a float32 tensor. So code that takes ``Data`` runs the same on an
in-memory tensor (tests, training's reference runs) and on a dataset far larger than memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt
import torch

from api_schemas.jobs import num_batches
from workers.errors import DataError
from workers.passes.images import ImageSamples

__all__ = [
    "Batches",
    "Data",
    "Samples",
    "iter_batches",
    "load_rows",
    "num_batches",
    "to_tensors",
]

# What a batch of rows is turned into after its float32 conversion (B, ...) -> (B, ...).
Transform: TypeAlias = Callable[[torch.Tensor], torch.Tensor]


class Samples:
    """Rows of a (N, *sample_shape) float32 or uint8 array, converted to float32 (uint8 scaled
    by 1/255 to [0, 1], then ``transform``) only when :meth:`load` reads them.

    ``rows`` selects rows of ``array`` (a slice of consecutive rows, or an index array); the
    array is never copied whole."""

    def __init__(
        self,
        array: npt.NDArray[Any],
        rows: slice | npt.NDArray[np.int64] | None = None,
        transform: Transform | None = None,
        scale: bool = True,
    ) -> None:
        if array.dtype != np.uint8 and array.dtype.kind != "f":
            raise DataError(
                f"x must be float32 or uint8, got {array.dtype}; convert it before upload"
            )
        self.array = array
        self.rows = slice(0, len(array)) if rows is None else rows
        self.transform = transform
        self.scale = scale

    def _view(self, rows: slice | npt.NDArray[np.int64]) -> Samples:
        return Samples(self.array, rows, self.transform, self.scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.array.shape[1:])

    def __len__(self) -> int:
        if isinstance(self.rows, slice):
            return int(self.rows.stop - self.rows.start)
        count: int = self.rows.shape[0]
        return count

    def __getitem__(self, index: slice | torch.Tensor | npt.NDArray[np.int64]) -> Samples:
        """A view of some of these rows: a slice with step 1, or indices (N,)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"a Samples view takes slices with step 1, got {step}")
            stop = max(stop, start)
            if isinstance(self.rows, slice):
                base = self.rows.start
                return self._view(slice(base + start, base + stop))
            return self._view(self.rows[start:stop])
        picked = index.numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        picked = picked.astype(np.int64, copy=False)
        if isinstance(self.rows, slice):
            return self._view(picked + self.rows.start)
        return self._view(self.rows[picked])

    def load(self) -> torch.Tensor:
        """The rows as one float32 tensor (B, ...), read from the array now."""
        rows = self.array[self.rows]  # a view of a memory map, or a copy for indices
        out = torch.empty(self.shape, dtype=torch.float32)
        target = out.numpy()
        if rows.dtype == np.uint8 and self.scale:
            # One pass from the file's bytes to floats; float32 division is exactly
            # torch's `.to(torch.float32).div_(255)`.
            np.divide(rows, np.float32(255), out=target, dtype=np.float32)
        else:
            target[...] = rows  # float32 in any byte order, or float16
        return out if self.transform is None else self.transform(out)


# Arrays (Samples) and tars of images (ImageSamples, workers/passes/images.py) alike.
Data: TypeAlias = "torch.Tensor | Samples | ImageSamples"


def load_rows(x: Data, index: slice | torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``x`` (all when ``index`` is None) as a float32 tensor on the CPU: a view for a
    tensor sliced by a slice, read from the file for :class:`Samples`."""
    if isinstance(x, Samples | ImageSamples):
        return (x if index is None else x[index]).load()
    return x if index is None else x[index]


class Batches(Sequence[torch.Tensor]):
    """The batches ``x[i * batch_size : (i + 1) * batch_size]`` (B, ...) in order, at most
    ``max_batches``, each read when it is indexed: a sequence to cycle over that holds no
    batch itself."""

    def __init__(self, x: Data, batch_size: int, max_batches: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
        self.x = x
        self.batch_size = batch_size
        self._count = num_batches(x.shape[0], batch_size, max_batches)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError(f"batch {index} of {self._count}")
        index %= self._count
        return load_rows(self.x, slice(index * self.batch_size, (index + 1) * self.batch_size))


def iter_batches(
    x: Data, batch_size: int, max_batches: int | None = None
) -> Iterator[torch.Tensor]:
    """The batches ``x[i : i + batch_size]`` (B, ...) in order, the last may be short; views of
    a tensor, read one at a time from :class:`Samples`. Arguments are checked now, not at the
    first ``next``."""
    batches = Batches(x, batch_size, max_batches)
    if isinstance(x, ImageSamples):  # decoded ahead by loader processes
        return x.batches(batch_size, len(batches))
    return (batches[i] for i in range(len(batches)))


def _tensor(array: np.ndarray) -> torch.Tensor:
    # torch.from_numpy shares memory and warns on read-only arrays (memory-mapped files).
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def to_tensors(x: np.ndarray, y: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All of ``x`` in memory as float32 (uint8 scaled by 1/255 to [0, 1]); ``y`` as int64 class
    labels or float32 targets. For tests and small data: jobs read :class:`Samples`."""
    # A float32 x is shared, not copied.
    x_t = _tensor(x).to(torch.float32) if x.dtype.kind == "f" else Samples(x).load()
    return x_t, None if y is None else labels_tensor(y, len(x))


def labels_tensor(y: np.ndarray, num_samples: int) -> torch.Tensor:
    """``y`` as int64 class labels or float32 targets, one per sample."""
    if len(y) != num_samples:
        raise DataError(
            f"x has {num_samples} samples but y has {len(y)}; give one label per sample"
        )
    if y.dtype.kind in "iu":
        return _tensor(y).to(torch.int64)
    if y.dtype.kind == "f":
        return _tensor(y).to(torch.float32)
    raise DataError(f"y must hold integer class labels or float targets, got {y.dtype}; convert it")
