"""Training-time augmentation of image batches: random resized crop and horizontal flip,
drawn from a generator of the batch's own (NOTE [ Augmentation draws ]).

NOTE [ Augmentation draws ]
Each micro-batch's draws come from a ``torch.Generator`` seeded from (the job's seed, the
epoch, the micro-batch's index in the epoch), not from a generator that runs on through the
job: the same batch is augmented the same way whichever process decodes it (a loader process
or the job's own, so ``loader_workers`` changes nothing), and a resumed job needs no
augmentation state in its checkpoint.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.nn import functional as F  # noqa: N812 - torch's own convention

from api_schemas.jobs.train import Augmentation

__all__ = ["augment", "batch_generator"]

# torchvision's RandomResizedCrop draws up to 10 boxes before it falls back to a centre crop.
_CROP_TRIES = 10


def batch_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The generator of micro-batch ``batch`` (from 0) of ``epoch`` (from 1)."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{batch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _crop_box(
    height: int, width: int, spec: Augmentation, generator: torch.Generator
) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a box of a random area fraction and aspect ratio, as torchvision's
    RandomResizedCrop draws it (a centre crop of the clamped ratio when no box fits)."""
    area = height * width
    log_low, log_high = math.log(spec.crop_ratio[0]), math.log(spec.crop_ratio[1])
    for _ in range(_CROP_TRIES):
        u = torch.rand(4, generator=generator, dtype=torch.float64).tolist()
        target = area * (spec.crop_scale[0] + u[0] * (spec.crop_scale[1] - spec.crop_scale[0]))
        ratio = math.exp(log_low + u[1] * (log_high - log_low))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = min(int(u[2] * (height - h + 1)), height - h)
            left = min(int(u[3] * (width - w + 1)), width - w)
            return top, left, h, w
    ratio = width / height
    if ratio < spec.crop_ratio[0]:
        w, h = width, round(width / spec.crop_ratio[0])
    elif ratio > spec.crop_ratio[1]:
        h, w = height, round(height * spec.crop_ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def augment(batch: torch.Tensor, spec: Augmentation, generator: torch.Generator) -> torch.Tensor:
    """``batch`` (B, C, H, W) float, augmented sample by sample: each crop resized back to
    (H, W) (bilinear), then each sample flipped left-right with probability 1/2. A new
    tensor; the draws are the generator's only."""
    _, _, height, width = batch.shape
    if spec.random_resized_crop:
        crops = []
        for sample in batch:  # (C, H, W)
            top, left, h, w = _crop_box(height, width, spec, generator)
            crop = sample[None, :, top : top + h, left : left + w]  # (1, C, h, w)
            crops.append(F.interpolate(crop, size=(height, width), mode="bilinear"))
        batch = torch.cat(crops)
    if spec.horizontal_flip:
        flip = torch.rand(batch.shape[0], generator=generator) < 0.5  # (B,)
        batch = torch.where(flip.view(-1, 1, 1, 1), batch.flip(-1), batch)
    return batch
