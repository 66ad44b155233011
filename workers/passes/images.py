"""Image datasets in a job: batches decoded from a tar (service/formats/images.py) by a
DataLoader's processes, preprocessed by the dataset's spec; the same spec on uint8 arrays.

# NOTE [ Decoding in loader processes ]
Decoding a JPEG costs far more than the float work on its pixels, so a pass over the job's
batches (an estimator's pass, the measurement before and after) runs through a
``torch.utils.data.DataLoader`` whose ``BNADAPT_LOADER_PROCESSES`` processes each decode a
whole batch to uint8 (C, H, W) pixels, while the job's process runs the model on the batch
before. A batch crosses from a loader process as uint8, a quarter of its float bytes, and stays
uint8 until it is on the job's device: scaling and normalising happen there
(:func:`pixels_to_floats`; NOTE [ Batches to the device ] in workers/passes/transfer.py). On a
CUDA worker the loader pins the batches, and with ``BNADAPT_DECODE`` auto or gpu the loader
processes only read each batch's JPEG bytes, which the GPU decodes (NOTE [ Decoding on the
GPU ] in workers/passes/gpu_decoding.py). With 0 processes, or for batches asked one at a time
(an estimator that cycles, training's shuffled batches), the job's process decodes them itself.
Either way a batch decodes only its own images, so a shard of a sharded job decodes only its
range.

How many processes, unless ``BNADAPT_LOADER_PROCESSES`` says (:func:`auto_loader_processes`):
on a GPU worker the CPU's only work is decoding, so all the cores the worker may run on but
the one of the job's process that feeds the device; on a CPU worker the model's forward needs
cores too, so half of them. At least 1, at most 16 (DataLoader's processes each hold a batch
in flight and a copy of the index).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import DataLoader, Dataset

from api_schemas.datasets import Preprocessing
from service.errors import ArrayFileError
from service.formats.images import TarIndex, crop_origin, decode_image, index_tar
from workers.errors import DataError
from workers.passes.process_memory import loader_shares

__all__ = [
    "ImageSamples",
    "array_transform",
    "auto_loader_processes",
    "normalize_",
    "pixels_to_floats",
]

_MAX_AUTO_LOADERS: Final = 16


def auto_loader_processes(device_type: str, cores: int) -> int:
    """The loader processes of a job on ``device_type`` ("cpu", "cuda", ...) on a worker that
    may run on ``cores`` cores (NOTE [ Decoding in loader processes ])."""
    wanted = cores - 1 if device_type != "cpu" else cores // 2
    return max(1, min(_MAX_AUTO_LOADERS, wanted))


def normalize_(batch: torch.Tensor, spec: Preprocessing) -> torch.Tensor:
    """``(batch - mean) / std`` per channel of a (B, C, H, W) float batch, in place."""
    if spec.mean is not None and spec.std is not None:
        mean = torch.tensor(spec.mean, dtype=batch.dtype, device=batch.device).view(1, -1, 1, 1)
        std = torch.tensor(spec.std, dtype=batch.dtype, device=batch.device).view(1, -1, 1, 1)
        batch.sub_(mean).div_(std)
    return batch


def pixels_to_floats(pixels: torch.Tensor, spec: Preprocessing) -> torch.Tensor:
    """A uint8 (B, C, H, W) batch as float32 on its own device: scaled by 1/255 (``spec.scale``)
    and normalised: on every device the same correctly rounded float32 division, so a batch
    is bit for bit the same wherever it is converted."""
    out = pixels.to(torch.float32)
    if spec.scale:
        out.div_(255)
    return normalize_(out, spec)


# torch's modes for the spec's interpolations on arrays (torchvision's tensor resize uses the
# same); lanczos has none.
_TORCH_MODES: Final = {"nearest": "nearest", "bilinear": "bilinear", "bicubic": "bicubic"}


def array_transform(spec: Preprocessing, channels: int) -> Any:
    """The spec on a (B, C, H, W) batch of a uint8 array, already scaled (or not) to float:
    resize (antialiased, like Pillow's, except nearest), centre crop, channel order,
    normalisation.
    The array's channels are RGB (or one gray channel)."""
    if spec.num_channels != channels:
        raise DataError(
            f"the preprocessing asks for {spec.channels!r} ({spec.num_channels} channels) but "
            f"the array's samples have {channels}; register it with the matching channels"
        )

    if spec.interpolation not in _TORCH_MODES:
        raise DataError(
            f"interpolation {spec.interpolation!r} applies to images decoded by Pillow; uint8 "
            f"arrays are resized by torch: use one of {sorted(_TORCH_MODES)}"
        )
    mode = _TORCH_MODES[spec.interpolation]

    def transform(batch: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, H', W')
        size = spec.resized_size(batch.shape[2], batch.shape[3])
        if size != tuple(batch.shape[2:]):
            antialias = mode != "nearest"
            batch = F.interpolate(batch, size=size, mode=mode, antialias=antialias)
        if spec.center_crop is not None:
            top, left = crop_origin((batch.shape[2], batch.shape[3]), spec.center_crop)
            height, width = spec.center_crop
            batch = batch[:, :, top : top + height, left : left + width]
        if spec.channels == "bgr":
            batch = batch.flip(1)
        return normalize_(batch.contiguous(), spec)

    return transform


class _Decoder:
    """Decodes rows of a tar dataset to one uint8 (B, C, H, W) array; picklable, so that a
    loader process gets its own copy and opens the file itself."""

    def __init__(
        self, path: Path, index: TarIndex, spec: Preprocessing, shape: tuple[int, ...], max_px: int
    ) -> None:
        self.path, self.index, self.spec, self.shape, self.max_px = path, index, spec, shape, max_px

    def first_shape(self) -> tuple[int, ...]:
        with self.path.open("rb") as file:
            file.seek(int(self.index.offsets[0]))
            data = file.read(int(self.index.sizes[0]))
        try:
            return tuple(decode_image(data, self.index.keys[0], self.spec, self.max_px).shape)
        except ArrayFileError as exc:
            raise DataError(str(exc)) from exc

    def read(self, rows: npt.NDArray[np.int64]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoded bytes of ``rows``, undecoded, end to end in one uint8 tensor (sum L,)
        with each image's length (B,) int64: one tensor to cross from a loader process, not
        one shared-memory segment per image."""
        sizes = self.index.sizes[rows]
        flat = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        target = flat.numpy().data
        start = 0
        with self.path.open("rb") as file:
            for row, size in zip(rows.tolist(), sizes.tolist(), strict=True):
                file.seek(int(self.index.offsets[row]))
                got = file.readinto(target[start : start + size])
                if got != size:
                    raise DataError(
                        f"sample {self.index.keys[row]!r} ends early in the file ({got} of "
                        f"{size} bytes); upload the dataset again"
                    )
                start += size
        return flat, torch.from_numpy(sizes.astype(np.int64))

    def decode(self, rows: npt.NDArray[np.int64]) -> torch.Tensor:
        out = torch.empty((len(rows), *self.shape), dtype=torch.uint8)
        target = out.numpy()
        with self.path.open("rb") as file:
            for i, row in enumerate(rows.tolist()):
                key = self.index.keys[row]
                file.seek(int(self.index.offsets[row]))
                data = file.read(int(self.index.sizes[row]))
                try:
                    pixels = decode_image(data, key, self.spec, self.max_px)
                except ArrayFileError as exc:
                    raise DataError(str(exc)) from exc
                if pixels.shape != self.shape:
                    raise DataError(
                        f"sample {key!r} preprocesses to shape {list(pixels.shape)} but the "
                        f"dataset's samples have {list(self.shape)}; register it with a "
                        "preprocessing resize"
                    )
                target[i] = pixels
        return out


class _BatchSet(Dataset[Any]):
    """Batch ``i`` of a pass: what a loader process makes, uint8 pixels (B, C, H, W) or, with
    ``encoded``, the images' bytes undecoded (:meth:`_Decoder.read`)."""

    def __init__(
        self, decoder: _Decoder, rows: npt.NDArray[np.int64], batch_size: int, encoded: bool
    ) -> None:
        self.decoder, self.rows, self.batch_size = decoder, rows, batch_size
        self.encoded = encoded

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __getitem__(self, i: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows[i * self.batch_size : (i + 1) * self.batch_size]
        return self.decoder.read(rows) if self.encoded else self.decoder.decode(rows)


class ImageSamples:
    """Rows of a tar of images, as :class:`workers.passes.data.Samples` is of an array: a
    view that decodes (NOTE [ Decoding in loader processes ]) only the rows it loads."""

    def __init__(
        self,
        decoder: _Decoder,
        rows: npt.NDArray[np.int64],
        loader_processes: int,
        gpu_decode: bool = False,
    ) -> None:
        self.decoder, self.rows, self.loader_processes = decoder, rows, loader_processes
        # A pass on a CUDA device decodes the JPEGs there (NOTE [ Decoding on the GPU ] in
        # workers/passes/gpu_decoding.py); load() and batches() always decode on the CPU.
        self.gpu_decode = gpu_decode

    @classmethod
    def open(
        cls,
        path: Path,
        spec: Preprocessing,
        sample_shape: tuple[int, ...] | None,
        loader_processes: int,
        max_pixels: int,
        gpu_decode: bool = False,
    ) -> tuple[ImageSamples, npt.NDArray[np.int64] | None]:
        """The dataset's samples and class labels (None without labels)."""
        try:
            index = index_tar(path)
        except ArrayFileError as exc:
            raise DataError(str(exc)) from exc
        if sample_shape is None:  # a payload without the dataset's facts: the first image's
            sample_shape = _Decoder(path, index, spec, (), max_pixels).first_shape()
        decoder = _Decoder(path, index, spec, sample_shape, max_pixels)
        rows = np.arange(len(index.keys), dtype=np.int64)
        return cls(decoder, rows, loader_processes, gpu_decode), index.labels

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.decoder.shape)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, index: slice | torch.Tensor | npt.NDArray[np.int64]) -> ImageSamples:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"a samples view takes slices with step 1, got {step}")
            picked = self.rows[start:stop]
        else:
            chosen = index.numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
            picked = self.rows[chosen.astype(np.int64, copy=False)]
        return ImageSamples(self.decoder, picked, self.loader_processes, self.gpu_decode)

    def load(self) -> torch.Tensor:
        """The rows decoded and preprocessed: float32 (B, C, H, W), in this process."""
        return pixels_to_floats(self.decoder.decode(self.rows), self.spec)

    @property
    def spec(self) -> Preprocessing:
        return self.decoder.spec

    @property
    def max_pixels(self) -> int:
        return self.decoder.max_px

    def batches(self, batch_size: int, count: int) -> Iterator[torch.Tensor]:
        """The first ``count`` batches of ``batch_size`` rows in order, decoded by the loader
        processes (NOTE [ Decoding in loader processes ]), as float32 on the CPU."""
        return (pixels_to_floats(p, self.spec) for p in self.pixel_batches(batch_size, count))

    def pixel_batches(
        self, batch_size: int, count: int, pin: bool = False
    ) -> Iterator[torch.Tensor]:
        """:meth:`batches` before scaling: uint8 (B, C, H, W), in pinned memory with ``pin``
        when loader processes decode them."""
        yield from self._loaded(batch_size, count, pin, encoded=False)

    def encoded_batches(self, batch_size: int, count: int) -> Iterator[list[torch.Tensor]]:
        """The same batches' images undecoded: each a list of B uint8 tensors (L,) of the
        file's bytes, read by the loader processes (NOTE [ Decoding on the GPU ]); on the CPU,
        where the GPU decoder takes them."""
        for flat, sizes in self._loaded(batch_size, count, pin=False, encoded=True):
            yield list(flat.split(sizes.tolist()))  # views of one tensor, (L,) each

    def _loaded(self, batch_size: int, count: int, pin: bool, encoded: bool) -> Iterator[Any]:
        rows = self.rows[: count * batch_size]
        batch_set = _BatchSet(self.decoder, rows, batch_size, encoded)
        if self.loader_processes == 0 or count <= 1:
            for i in range(count):
                yield batch_set[i]
            return
        loaders = min(self.loader_processes, count)
        # NOTE [ Loader processes' memory ] in workers/passes/process_memory.py
        with loader_shares(loaders) as hold_loader:
            yield from DataLoader(
                batch_set,
                batch_size=None,
                num_workers=loaders,
                prefetch_factor=2,
                pin_memory=pin,
                worker_init_fn=hold_loader,
            )
