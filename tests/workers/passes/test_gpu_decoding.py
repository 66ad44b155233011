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
from harness.photos import JPEGS, photo_jpeg
from service.formats.images import decode_image
from workers.errors import DataError
from workers.passes.gpu_decoding import decode_on_gpu, gpu_decodes

TWO_LEVELS = 2
MAX_PIXELS = 1 << 26
SPECS = [
    {"resize_shorter": 256, "center_crop": [224, 224]},
    {"resize": [200, 260], "interpolation": "bicubic", "channels": "bgr"},
    {"resize_shorter": 300, "center_crop": [280, 280], "channels": "gray"},
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
    # NOTE [ Reduced-size JPEG decoding ]), of two sizes (resized in two groups), a PNG
    # (Pillow on the CPU here too) among them.
    datas = [JPEGS[(500, 375)], png(500, 375), JPEGS[(333, 500)], photo_jpeg(500, 375, seed=7)]
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


@pytest.mark.parametrize("processes", [0, 2])
def test_loader_processes_hand_over_each_batchs_bytes_undecoded(
    tmp_path: Path, processes: int
) -> None:
    """What the GPU decodes: each image's bytes as the file holds them, a batch at a time."""
    import tarfile

    from workers.passes.images import ImageSamples

    datas = [photo_jpeg(40 + i, 30, seed=i) for i in range(5)] + [png(20, 10)]
    path = tmp_path / "images.tar"
    with tarfile.open(path, "w") as archive:
        for i, data in enumerate(datas):
            info = tarfile.TarInfo(f"{i}.{'png' if i == 5 else 'jpg'}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    spec = Preprocessing(resize=[16, 16])
    images, _ = ImageSamples.open(path, spec, None, processes, MAX_PIXELS, gpu_decode=True)
    batches = list(images[1:].encoded_batches(2, 3))
    assert [len(b) for b in batches] == [2, 2, 1]
    assert [t.numpy().tobytes() for b in batches for t in b] == datas[1:]
