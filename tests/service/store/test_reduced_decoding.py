"""NOTE [ Reduced-size JPEG decoding ] in service/formats/images.py: a JPEG at least twice the
target's size is decoded at 1/2, 1/4 or 1/8 of its size in the DCT domain, then resized
exactly; the pixels stay within a few levels of a full-size decode. Smaller targets, and
PNGs, decode at full size, bit for bit as before."""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from api_schemas.datasets import Preprocessing
from harness.photos import photo_jpeg
from service.formats.images import crop_origin, decode_image

MAX_PIXELS = 1 << 26
SPEC = Preprocessing(resize_shorter=256, center_crop=[224, 224], interpolation="bilinear")


def full_size(data: bytes, spec: Preprocessing) -> npt.NDArray[np.int64]:
    """Decoded at full size, then resized and cropped: (3, H, W)."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    height, width = spec.resized_size(image.height, image.width)
    image = image.resize((width, height), Image.Resampling.BILINEAR)
    assert spec.center_crop is not None
    top, left = crop_origin((height, width), spec.center_crop)
    crop = image.crop((left, top, left + spec.center_crop[1], top + spec.center_crop[0]))
    return np.asarray(crop).transpose(2, 0, 1).astype(np.int64)


@pytest.mark.parametrize(
    "size",
    [(1600, 1200), (1200, 1600), pytest.param((4000, 3000), marks=pytest.mark.slow)],
)
def test_a_large_jpeg_decodes_reduced_within_a_few_levels(size: tuple[int, int]) -> None:
    data = photo_jpeg(*size, seed=5)
    ours = decode_image(data, "photo", SPEC, MAX_PIXELS).astype(np.int64)
    reference = full_size(data, SPEC)
    assert ours.shape == reference.shape == (3, 224, 224)
    difference = np.abs(ours - reference)
    # Measured on these photo-like images (with pixel noise, the hardest case): at most 5
    # levels, under 0.8 of one on average.
    assert difference.max() <= 8 and difference.mean() <= 1.0, (difference.max(), difference.mean())
    assert difference.any(), "decoded at full size: the reduced decode was not taken"


def test_below_twice_the_target_and_pngs_decode_at_full_size_bit_for_bit() -> None:
    jpeg = photo_jpeg(500, 375, seed=1)  # 375 / 256 < 2: no reduced decode
    assert np.array_equal(decode_image(jpeg, "photo", SPEC, MAX_PIXELS), full_size(jpeg, SPEC))
    out = io.BytesIO()
    Image.open(io.BytesIO(photo_jpeg(1600, 1200, seed=2))).save(out, format="PNG")
    png = out.getvalue()
    assert np.array_equal(decode_image(png, "photo", SPEC, MAX_PIXELS), full_size(png, SPEC))
