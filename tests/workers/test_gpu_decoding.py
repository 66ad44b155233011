"""JPEGs decoded by torchvision, resized and cropped by torch (NOTE [ Decoding on the GPU ] in
workers/passes/gpu_decoding.py) against the CPU path (Pillow, service/formats/images.py): within
2/255 per pixel on the same images. On CUDA (``-m gpu``) with nvJPEG; in the zoo environment
(``-m zoo``, torchvision importable) the same code on the CPU's libjpeg, so the resize, rounding
and crop are checked where no GPU is lent. Which path a worker takes is checked everywhere."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from api_schemas import Preprocessing
from service.formats.images import decode_image
from tests.zoo.photos import JPEGS, photo_jpeg
from workers.errors import DataError
from workers.passes.gpu_decoding import decode_on_gpu, gpu_decodes

TWO_LEVELS = 2
MAX_PIXELS = 1 << 26
SPECS = [
    {"resize_shorter": 256, "center_crop": [224, 224]},
    {"resize": [200, 260], "interpolation": "bicubic", "channels": "bgr"},
    {"resize_shorter": 300, "channels": "gray"},
]


def torchvision_decodes() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # noqa: BLE001 - not importable in the project's .venv
        return False
    return True


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 90)).save(out, format="PNG")
    return out.getvalue()


def compare_on(device: torch.device, spec_fields: dict[str, object]) -> None:
    spec = Preprocessing.model_validate(spec_fields)
    # JPEGs whose targets are more than half their size (the CPU decodes them at full size,
    # NOTE [ Reduced-size JPEG decoding ]), a PNG (Pillow on the CPU here too) in the middle.
    datas = [JPEGS[(500, 375)], png(500, 375), photo_jpeg(500, 375, seed=7)]
    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    got = decode_on_gpu(encoded, spec, MAX_PIXELS, device)  # (B, C, H, W) uint8
    assert got.dtype == torch.uint8 and got.device.type == device.type
    want = np.stack([decode_image(d, f"#{i}", spec, MAX_PIXELS) for i, d in enumerate(datas)])
    assert tuple(got.shape) == want.shape
    diff = (got.cpu().to(torch.int16) - torch.from_numpy(want).to(torch.int16)).abs()
    assert int(diff.max()) <= TWO_LEVELS, int(diff.max())
    assert int(diff[1].max()) == 0  # the PNG decodes on the CPU, as the CPU path


@pytest.mark.zoo
@pytest.mark.skipif(not torchvision_decodes(), reason="needs torchvision (the zoo environment)")
@pytest.mark.parametrize("spec", SPECS)
def test_torchvision_decode_and_torch_resize_are_within_two_levels_on_the_cpu(
    spec: dict[str, object],
) -> None:
    compare_on(torch.device("cpu"), spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not torchvision_decodes(), reason="needs torchvision")
@pytest.mark.parametrize("spec", SPECS)
def test_nvjpeg_decoding_is_within_two_levels_of_the_cpu_path(spec: dict[str, object]) -> None:
    cuda = torch.device("cuda")
    assert gpu_decodes("auto", cuda, Preprocessing.model_validate(spec))
    compare_on(cuda, spec)


def test_which_path_a_worker_takes(tmp_path: Path) -> None:
    spec = Preprocessing(resize=[32, 32])
    cpu = torch.device("cpu")
    assert not gpu_decodes("auto", cpu, spec)  # a CPU job decodes on the CPU
    assert not gpu_decodes("cpu", cpu, spec)
    with pytest.raises(DataError, match=r"BNADAPT_DECODE is 'gpu' but .* device is cpu, not CUDA"):
        gpu_decodes("gpu", cpu, spec)
    if torch.cuda.is_available():
        lanczos = Preprocessing(resize=[32, 32], interpolation="lanczos")
        assert not gpu_decodes("auto", torch.device("cuda"), lanczos)
        assert not gpu_decodes("cpu", torch.device("cuda"), spec)
