"""JPEGs decoded, resized and cropped on the GPU (nvJPEG through torchvision).

# NOTE [ Decoding on the GPU ]
On a CUDA worker a JPEG's decode is the CPU's largest cost per image, and the GPU decodes a
batch of them (torchvision's ``decode_jpeg(device="cuda")``, batched nvJPEG) for a few
percent of a ResNet-50 forward. So an image dataset's pass on a CUDA worker, by default, has
its loader processes read each batch's JPEG bytes only, and the job's process decodes them on
the GPU, resizes them there (torch's antialiased ``interpolate``: Pillow's filters, as
torchvision's resize on tensors), rounds to uint8 as Pillow does, crops the centre and
normalises (NOTE [ Batches to the device ] in workers/passes/transfer.py).

Which path, ``BNADAPT_DECODE`` (a worker setting: how a worker decodes is the operator's
choice, not a tenant's): ``auto`` (the default) decodes on the GPU when the job's device is
CUDA, torchvision imports and a JPEG decodes on that device (:func:`gpu_decoding_available`),
and on the CPU otherwise; ``cpu`` always on the CPU; ``gpu`` on the GPU or the job fails
saying why. torchvision is imported only here and only when asked: a worker image without it
decodes on the CPU. Images that are not JPEGs (PNG members), and a spec whose interpolation
torch lacks (``lanczos``), decode on the CPU in the job's process whatever the setting.

How close: on the same images within 2/255 per pixel of the CPU path (Pillow) where the CPU
decodes at full size (tests/workers/passes/test_gpu_decoding.py; the differences are the IDCTs' and
the resize filters' rounding). Where the CPU path decodes a large JPEG reduced in the DCT
domain (NOTE [ Reduced-size JPEG decoding ] in service/formats/images.py) the GPU decodes it
whole, and on photos the two are more than 2 levels apart. Averaging the whole decode down by
the CPU's scale before the resize, to imitate the reduced decode, brings them closer but not
within 2 (undoing the chroma upsampling's smoothing as well: no closer): what is left is the
rounding and clipping of each pixel before the average, which no linear step after the decode
undoes, so it is not done (bench/history/2026-12-07-bytes-uploads-below-requests.md, "Issue 30,
once more on the 2/255").
"""

from __future__ import annotations

import functools
import importlib
import io
from typing import Any, Final

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from api_schemas.datasets import Preprocessing
from service.errors import ArrayFileError
from service.formats.images import crop_origin, decode_image
from workers.errors import DataError

__all__ = ["DecodeMode", "decode_on_gpu", "gpu_decodes", "gpu_decoding_available"]

DecodeMode = str  # "auto" | "cpu" | "gpu": service.settings.Settings.decode

_JPEG_MAGIC: Final = b"\xff\xd8"
# torch's modes for the spec's interpolations (lanczos has none: those specs decode on the CPU).
_TORCH_MODES: Final = {"nearest": "nearest", "bilinear": "bilinear", "bicubic": "bicubic"}


def _torchvision_io() -> Any:
    """torchvision.io, or None where torchvision does not import."""
    try:
        return importlib.import_module("torchvision.io")
    except Exception:  # noqa: BLE001 - any import failure means: decode on the CPU
        return None


@functools.lru_cache(maxsize=8)
def gpu_decoding_available(device: torch.device) -> bool:
    """Whether torchvision imports and decodes a JPEG on ``device`` (a CUDA device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    tv_io = _torchvision_io()
    if tv_io is None:
        return False
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 100, 50)).save(out, format="JPEG")
    data = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    try:
        tv_io.decode_jpeg([data], mode=tv_io.ImageReadMode.RGB, device=device)
    except Exception:  # noqa: BLE001 - a build without nvJPEG, a driver that refuses it
        return False
    return True


def gpu_decodes(mode: DecodeMode, device: torch.device, spec: Preprocessing) -> bool:
    """Whether a job on ``device`` decodes its JPEGs on the GPU under the worker's ``mode``
    (NOTE [ Decoding on the GPU ]); :class:`DataError` for ``gpu`` where it cannot."""
    if mode == "cpu" or (mode == "auto" and device.type != "cuda"):
        return False
    fits = spec.interpolation in _TORCH_MODES
    available = fits and gpu_decoding_available(device)
    if mode == "gpu" and not available:
        if device.type != "cuda":
            why = f"the job's device is {device}, not CUDA"
        elif not fits:
            why = f"interpolation {spec.interpolation!r} has no GPU resize"
        else:
            why = "torchvision's decode_jpeg does not import, or does not decode on it"
        raise DataError(
            f"BNADAPT_DECODE is 'gpu' but this job cannot decode on the GPU: {why}; set "
            "BNADAPT_DECODE to 'auto' (the GPU where it can, else the CPU) or 'cpu'"
        )
    return available


def decode_on_gpu(
    encoded: list[torch.Tensor], spec: Preprocessing, max_pixels: int, device: torch.device
) -> torch.Tensor:
    """A batch of images' bytes (B tensors (L,) uint8 on the CPU) decoded and preprocessed by
    ``spec`` up to its crop: uint8 (B, C, H, W) on ``device``. JPEGs decode on ``device``, other
    images with Pillow on the CPU (NOTE [ Decoding on the GPU ])."""
    tv_io = _torchvision_io()
    assert tv_io is not None, "gpu_decodes() said torchvision imports"
    jpeg_at = [i for i, data in enumerate(encoded) if bytes(data[:2].tolist()) == _JPEG_MAGIC]
    out: list[torch.Tensor | None] = [None] * len(encoded)
    if jpeg_at:
        try:
            decoded = tv_io.decode_jpeg(
                [encoded[i] for i in jpeg_at], mode=tv_io.ImageReadMode.RGB, device=device
            )
        except RuntimeError as exc:
            raise DataError(
                f"a batch's JPEGs did not decode on {device} ({exc}); one is damaged or in a "
                "form nvJPEG does not take: re-encode it, or set BNADAPT_DECODE=cpu"
            ) from exc
        # Images of one size are resized together: one kernel launch for the group, not one
        # per image (a batch of ImageNet-size photos shares a few sizes).
        groups: dict[tuple[int, ...], list[int]] = {}
        for k, image in enumerate(decoded):  # (3, H, W) uint8
            groups.setdefault(tuple(image.shape), []).append(k)
        for members in groups.values():
            resized = _resized(torch.stack([decoded[k] for k in members]), spec)
            for k, image in zip(members, resized, strict=True):
                out[jpeg_at[k]] = image
    for i, data in enumerate(encoded):
        if out[i] is None:  # not a JPEG: Pillow, then the device
            try:
                pixels = decode_image(data.numpy().tobytes(), f"#{i}", spec, max_pixels)
            except ArrayFileError as exc:
                raise DataError(str(exc)) from exc
            out[i] = torch.from_numpy(np.ascontiguousarray(pixels)).to(device)
    shapes = {tuple(t.shape) for t in out if t is not None}
    if len(shapes) != 1:
        raise DataError(
            f"a batch's images preprocess to shapes {sorted(shapes)}; register the dataset "
            "with a preprocessing resize that gives them one shape"
        )
    return torch.stack([t for t in out if t is not None])  # (B, C, H, W)


def _luma(rgb: torch.Tensor) -> torch.Tensor:
    """(G, 3, H, W) -> (G, 1, H, W) uint8 by Pillow's own integer formula for RGB to "L"
    (ITU-R 601-2 luma), so gray images match the CPU path's ``convert("L")``; a JPEG decoded
    to gray directly gives its Y channel, a few levels away from that."""
    wide = rgb.to(torch.int32)
    luma = (wide[:, 0] * 19595 + wide[:, 1] * 38470 + wide[:, 2] * 7471 + 0x8000) >> 16
    return luma.to(torch.uint8).unsqueeze(1)


def _resized(images: torch.Tensor, spec: Preprocessing) -> torch.Tensor:
    """Decoded RGB images of one size (G, 3, H, W) uint8 in the spec's channels, resized,
    rounded and cropped, in the order the CPU path does them: (G, C, H', W') uint8."""
    if spec.channels == "gray":
        images = _luma(images)
    height, width = spec.resized_size(int(images.shape[2]), int(images.shape[3]))
    if (height, width) != tuple(images.shape[2:]):
        mode = _TORCH_MODES[spec.interpolation]
        floats = F.interpolate(
            images.to(torch.float32), size=(height, width), mode=mode, antialias=mode != "nearest"
        )
        images = floats.round_().clamp_(0, 255).to(torch.uint8)
    if spec.center_crop is not None:
        top, left = crop_origin((height, width), spec.center_crop)
        crop_h, crop_w = spec.center_crop
        images = images[:, :, top : top + crop_h, left : left + crop_w]
    if spec.channels == "bgr":
        images = images.flip(1)
    return images
