"""A pass's batches on the job's device, converted there.

# NOTE [ Batches to the device ]
What a pass's model sees is float32 (B, C, H, W), but what crosses from the loader to the
device is as small as it can be:

- Images (a tar) cross as uint8 pixels, a quarter of their float bytes, or, decoded on the
  GPU (NOTE [ Decoding on the GPU ] in workers/passes/gpu_decoding.py), as the JPEGs' own
  bytes. Scaling by 1/255 and the spec's mean and std run on the device
  (:func:`~workers.passes.images.pixels_to_floats`). On the CPU that is the same float32
  arithmetic the loader's numpy path does, so a CPU job's statistics are bit for bit what they
  were when the loader made floats (tests/workers/passes/test_device_batches.py).
- Arrays cross as the float32 rows :class:`~workers.passes.data.Samples` makes: their
  preprocessing (a resize of uint8 arrays) is torch's on the CPU, and stays there so that a
  job's numbers do not depend on its device.
- On CUDA the loader processes pin the batches (DataLoader's ``pin_memory``; array batches are
  pinned here), every copy is ``non_blocking``, and the next batch is copied and converted on
  a side stream while the model runs on the current one: the job's stream waits for the side
  stream before it uses a batch, and the batch's memory is recorded on the job's stream so
  that the caching allocator does not hand it out while the model still reads it. One batch
  ahead is enough: the copy of a batch takes far less than its forward.
- ``channels_last`` (the job's param) gives the batch that memory format on the device, as the
  model's weights have it during the pass (workers/passes/precision.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import torch

from workers.passes.data import Batches, Data, iter_batches
from workers.passes.gpu_decoding import decode_on_gpu
from workers.passes.images import ImageSamples, pixels_to_floats

__all__ = ["device_batches"]

# Batches staged ahead of the one the model runs on CUDA (NOTE [ Batches to the device ]).
_AHEAD: Final = 1


def device_batches(
    x: Data,
    batch_size: int,
    max_batches: int | None,
    device: torch.device,
    channels_last: bool = False,
) -> Iterator[torch.Tensor]:
    """The batches ``x[i : i + batch_size]`` in order (as :func:`iter_batches`), each float32
    (B, ...) on ``device``; NOTE [ Batches to the device ]. Arguments are checked now."""
    count = len(Batches(x, batch_size, max_batches))
    cuda = device.type == "cuda"

    def formatted(batch: torch.Tensor) -> torch.Tensor:
        # 4-D batches only: channels-last has no meaning for (B, F) features.
        if channels_last and batch.dim() == 4:
            return batch.contiguous(memory_format=torch.channels_last)
        return batch

    staged: Iterator[torch.Tensor]
    if isinstance(x, ImageSamples):
        # Formatted as uint8, a quarter of the float bytes; the float conversion and the
        # in-place normalisation keep the format.
        images, spec = x, x.spec
        if cuda and images.gpu_decode:
            staged = (
                pixels_to_floats(
                    formatted(decode_on_gpu(jpegs, spec, images.max_pixels, device)), spec
                )
                for jpegs in images.encoded_batches(batch_size, count)
            )
        else:
            staged = (
                pixels_to_floats(formatted(p.to(device, non_blocking=cuda)), spec)
                for p in images.pixel_batches(batch_size, count, pin=cuda)
            )
    else:
        staged = (
            formatted((b.pin_memory() if cuda else b).to(device, non_blocking=cuda))
            for b in iter_batches(x, batch_size, max_batches)
        )
    return _ahead_on_side_stream(staged, device) if cuda else staged


def _ahead_on_side_stream(
    staged: Iterator[torch.Tensor], device: torch.device
) -> Iterator[torch.Tensor]:
    """``staged``'s batches, each made on a side stream while the model runs on the current
    stream on the batch before (NOTE [ Batches to the device ])."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    pending: list[torch.Tensor] = []

    def stage() -> bool:
        with torch.cuda.stream(side):
            batch = next(staged, None)
        if batch is None:
            return False
        pending.append(batch)
        return True

    for _ in range(_AHEAD):
        stage()
    while pending:
        batch = pending.pop(0)
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)
        batch.record_stream(current)
        stage()  # queued on the side stream: it runs while the model runs on `batch`
        yield batch
