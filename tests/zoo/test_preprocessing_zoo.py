"""The preprocessing spec against the libraries' own evaluation transforms, on real JPEGs:
``decode_image`` (what a job decodes) within 1/255 per pixel of torchvision's and timm's
transforms, and the spec each architecture resolves to (``"preprocessing": "model"``).
Runs in the zoo environment (torchvision and timm); skipped without them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from api_schemas.datasets import Preprocessing
from service.formats.images import decode_image

torch = pytest.importorskip("torch")
transforms = pytest.importorskip("torchvision.transforms")
torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")
timm_data = pytest.importorskip("timm.data")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.zoo

ONE_LEVEL = 1 / 255 + 1e-6
MAX_PIXELS = 1 << 26


def photo_jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth gradients plus noise), quality 90."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(xx / (17 + seed)) * np.cos(yy / 23),
            255 * xx / width,
            255 * (1 - yy / height) * (0.5 + 0.5 * np.sin((xx + yy) / 41)),
        ],
        axis=-1,
    )
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=90)
    return out.getvalue()


JPEGS = {(500, 375): photo_jpeg(500, 375, 1), (333, 500): photo_jpeg(333, 500, 2)}


def ours(data: bytes, spec: Preprocessing) -> torch.Tensor:
    """What a job makes of the image: decode_image, then scale and normalise as the worker
    does (workers/passes/images.py)."""
    pixels = torch.from_numpy(decode_image(data, "photo", spec, MAX_PIXELS).copy())
    x = pixels.float() / 255
    if spec.mean is not None and spec.std is not None:
        mean = torch.tensor(spec.mean).view(-1, 1, 1)
        std = torch.tensor(spec.std).view(-1, 1, 1)
        x = (x - mean) / std
    return x


def assert_within_one_level(
    data: bytes, spec: Preprocessing, theirs: torch.Tensor, std: list[float]
) -> None:
    got = ours(data, spec)
    assert got.shape == theirs.shape
    # Compared in pixel units: (normalised difference) * std is the difference in [0, 1].
    scale = torch.tensor(std).view(-1, 1, 1)
    worst = float(((got - theirs).abs() * scale).max())
    assert worst <= ONE_LEVEL, f"largest difference {worst * 255:.3f} / 255"


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


@pytest.mark.parametrize("size", sorted(JPEGS))
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic", "lanczos"])
def test_resize_shorter_and_crop_match_torchvision(
    size: tuple[int, int], interpolation: str
) -> None:
    mode = transforms.InterpolationMode(interpolation)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    theirs = transforms.Compose(
        [
            transforms.Resize(256, interpolation=mode, antialias=True),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )(pil(JPEGS[size]))
    spec = Preprocessing(
        resize_shorter=256,
        center_crop=[224, 224],
        interpolation=interpolation,
        mean=mean,
        std=std,
    )
    assert_within_one_level(JPEGS[size], spec, theirs, std)


@pytest.mark.parametrize("size", sorted(JPEGS))
def test_tensor_path_of_torchvision_agrees_within_one_level(size: tuple[int, int]) -> None:
    """torchvision's tensor resize (antialias=True), as its weights' transforms run on
    decoded tensors: Pillow's filter and torch's agree within a level too."""
    weights = torchvision.models.get_model_weights("resnet18").DEFAULT
    image = torchvision.transforms.functional.pil_to_tensor(pil(JPEGS[size]))
    theirs = weights.transforms()(image)
    spec = Preprocessing(
        resize_shorter=256,
        center_crop=[224, 224],
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
    )
    got = ours(JPEGS[size], spec)
    scale = torch.tensor(spec.std).view(-1, 1, 1)
    assert float(((got - theirs).abs() * scale).max()) <= ONE_LEVEL


@pytest.mark.parametrize("size", sorted(JPEGS))
@pytest.mark.parametrize(("name", "crop_pct"), [("resnet50", 0.95), ("efficientnet_b0", 0.875)])
def test_crop_pct_matches_timm(size: tuple[int, int], name: str, crop_pct: float) -> None:
    config = timm_data.resolve_data_config(
        {}, model=timm.create_model(name, pretrained=False, num_classes=10)
    )
    config["crop_pct"] = crop_pct
    theirs = timm_data.create_transform(**config)(pil(JPEGS[size]))
    height, width = config["input_size"][1:]
    spec = Preprocessing(
        crop_pct=crop_pct,
        center_crop=[height, width],
        interpolation=config["interpolation"],
        mean=list(config["mean"]),
        std=list(config["std"]),
    )
    assert_within_one_level(JPEGS[size], spec, theirs, list(config["std"]))


def test_decode_from_a_written_file(tmp_path: Path) -> None:
    """The bytes a tar member holds are the file's bytes: decoding one read back is the same."""
    path = tmp_path / "photo.jpg"
    path.write_bytes(JPEGS[(500, 375)])
    spec = Preprocessing(resize_shorter=64, center_crop=[56, 56], interpolation="bicubic")
    assert np.array_equal(
        decode_image(path.read_bytes(), "photo", spec, MAX_PIXELS),
        decode_image(JPEGS[(500, 375)], "photo", spec, MAX_PIXELS),
    )
