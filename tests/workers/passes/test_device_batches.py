"""A pass's batches made on the device (NOTE [ Batches to the device ] in
workers/passes/transfer.py): images cross from the loader as uint8 and are scaled and
normalised on the device; on the CPU an image job's statistics are bit for bit those of the
float path it replaced (kept here: Pillow's pixels, numpy's float32 division, torch's
normalisation). On CUDA (``-m gpu``) the pinned, prefetched path gives the CPU's batches."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas import JobPayload, Preprocessing
from harness.photos import photo_jpeg
from service.formats.images import decode_image, index_tar
from service.settings import get_settings
from service.store.local import LocalStore
from workers.estimators.base import select_batchnorm
from workers.estimators.precise import precise_batchnorm
from workers.kinds.changing import compute
from workers.passes.data import Samples
from workers.passes.images import ImageSamples, pixels_to_floats
from workers.passes.transfer import device_batches
from workers.running.loading import load_model, open_dataset

SPEC = {
    "resize_shorter": 40,
    "center_crop": [32, 32],
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}
SAMPLES = 20  # batches of 8: the last one short
BATCH = 8
MAX_PIXELS = 1 << 26


@pytest.fixture
def loaders(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two loader processes, decoding on the CPU."""
    monkeypatch.setenv("BNADAPT_LOADER_PROCESSES", "2")
    monkeypatch.setenv("BNADAPT_DECODE", "cpu")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def photo_payload(tmp_path: Path, device: str = "cpu") -> tuple[JobPayload, LocalStore]:
    store = LocalStore(tmp_path / "store")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for i in range(SAMPLES):
            data = photo_jpeg(64 + 4 * (i % 3), 48, seed=i)
            info = tarfile.TarInfo(f"{i:03d}.jpg")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    sha = store.put_bytes(out.getvalue())
    torch.manual_seed(0)
    import safetensors.torch

    from workers.models.architectures import build_model

    kwargs = {"depth": 2, "width": 8}
    weights = store.put_bytes(
        safetensors.torch.save(dict(build_model("resnet", kwargs).state_dict()))
    )
    payload = JobPayload.model_validate(
        {
            "job_id": "job_device_batches",
            "tenant_id": "t",
            "kind": "adapt",
            "model": {
                "id": "m",
                "architecture": "resnet",
                "kwargs": kwargs,
                "weights_sha256": weights,
            },
            "dataset": {
                "id": "d",
                "sha256": sha,
                "format": "tar",
                "num_samples": SAMPLES,
                "sample_shape": [3, 32, 32],
                "dtype": "uint8",
                "has_labels": False,
                "preprocessing": SPEC,
            },
            "params": {"batch_size": BATCH, "estimator": "precise", "device": device},
        }
    )
    return payload, store


def float_path_batches(payload: JobPayload, store: LocalStore) -> list[torch.Tensor]:
    """The path the loader took before: Pillow's uint8 pixels, numpy's float32 division by 255
    on the CPU, then (x - mean) / std in torch; (B, 3, 32, 32) float32 each."""
    path = store.local_path(payload.dataset.sha256)
    index = index_tar(path)
    spec = Preprocessing.model_validate(SPEC)
    images = []
    with path.open("rb") as file:
        for key, offset, size in zip(index.keys, index.offsets, index.sizes, strict=True):
            file.seek(int(offset))
            images.append(decode_image(file.read(int(size)), key, spec, MAX_PIXELS))
    pixels = np.stack(images)  # (N, 3, 32, 32) uint8
    floats = np.empty(pixels.shape, dtype=np.float32)
    np.divide(pixels, np.float32(255), out=floats, dtype=np.float32)
    x = torch.from_numpy(floats)
    mean = torch.tensor(SPEC["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(SPEC["std"]).view(1, 3, 1, 1)
    x = (x - mean) / std
    return [x[i : i + BATCH] for i in range(0, SAMPLES, BATCH)]


@pytest.mark.usefixtures("loaders")
def test_a_cpu_image_job_is_bit_for_bit_the_float_loader_path(tmp_path: Path) -> None:
    payload, store = photo_payload(tmp_path)
    outcome = compute(payload, store, measure=False)
    reference = load_model(payload, store)
    layers = select_batchnorm(reference, ["*"], [])
    precise_batchnorm(reference, float_path_batches(payload, store), layers=layers)
    for key, value in reference.state_dict().items():
        assert torch.equal(outcome.state_dict[key], value), key


@pytest.mark.usefixtures("loaders")
def test_images_cross_from_the_loader_as_uint8_and_become_floats_on_the_device(
    tmp_path: Path,
) -> None:
    payload, store = photo_payload(tmp_path)
    images, _ = open_dataset(payload, store)
    assert isinstance(images, ImageSamples) and not images.gpu_decode
    assert images.loader_processes == 2
    crossed = list(images.pixel_batches(BATCH, 3))
    assert [b.dtype for b in crossed] == [torch.uint8] * 3
    assert [len(b) for b in crossed] == [8, 8, 4]
    made = list(device_batches(images, BATCH, None, torch.device("cpu")))
    expected = float_path_batches(payload, store)
    assert len(made) == len(expected) == 3
    for got, want in zip(made, expected, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    spec = Preprocessing.model_validate(SPEC)
    assert torch.equal(pixels_to_floats(crossed[0], spec), expected[0])
    last = list(device_batches(images, BATCH, None, torch.device("cpu"), channels_last=True))
    assert all(b.is_contiguous(memory_format=torch.channels_last) for b in last)
    assert all(torch.equal(a, b) for a, b in zip(last, expected, strict=True))


def test_array_batches_and_channels_last() -> None:
    x = torch.rand(10, 3, 6, 6)
    cpu = torch.device("cpu")
    made = list(device_batches(x, 4, 2, cpu, channels_last=True))
    assert [len(b) for b in made] == [4, 4]
    assert all(b.is_contiguous(memory_format=torch.channels_last) for b in made)
    assert torch.equal(torch.cat(made), x[:8])
    features = torch.rand(6, 5)  # (B, F): channels_last leaves them as they are
    assert torch.equal(torch.cat(list(device_batches(features, 4, None, cpu, True))), features)
    rows = (np.arange(2 * 3 * 4 * 4) % 251).astype(np.uint8).reshape(2, 3, 4, 4)
    (one,) = device_batches(Samples(rows), 2, None, torch.device("cpu"))
    assert torch.equal(one, Samples(rows).load())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("loaders")
def test_on_cuda_pinned_prefetched_batches_are_the_cpu_ones(tmp_path: Path) -> None:
    """Copies on a side stream, one batch ahead, conversion on the GPU: IEEE float32 division
    and subtraction, so the same numbers as the CPU's."""
    payload, store = photo_payload(tmp_path, device="cuda")
    images, _ = open_dataset(payload, store)
    assert isinstance(images, ImageSamples)
    cuda = torch.device("cuda")
    made = list(device_batches(images, BATCH, None, cuda))
    expected = float_path_batches(payload, store)
    assert len(made) == len(expected)
    for got, want in zip(made, expected, strict=True):
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), want)
    x = torch.rand(10, 3, 6, 6)
    arrays = list(device_batches(x, 4, None, cuda, channels_last=True))
    assert torch.equal(torch.cat(arrays).cpu(), x)
    assert os.environ["BNADAPT_DECODE"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_job_decoding_on_the_gpu_is_near_the_one_decoding_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Decoding on the GPU ]: the same job, its JPEGs decoded by nvJPEG or by Pillow;
    pixels within 2/255 give running statistics within 1e-2 of the layer's scale."""
    from tests.workers.estimators.test_adapt_precision import statistics_distance
    from workers.passes.gpu_decoding import gpu_decoding_available

    if not gpu_decoding_available(torch.device("cuda")):
        pytest.skip("torchvision's decode_jpeg does not decode on this GPU")
    payload, store = photo_payload(tmp_path, device="cuda")
    found = {}
    for mode in ("cpu", "gpu"):
        monkeypatch.setenv("BNADAPT_DECODE", mode)
        monkeypatch.setenv("BNADAPT_LOADER_PROCESSES", "2")
        get_settings.cache_clear()
        images, _ = open_dataset(payload, store)
        assert isinstance(images, ImageSamples) and images.gpu_decode == (mode == "gpu")
        found[mode] = compute(payload, store, measure=False).state_dict
    get_settings.cache_clear()
    distance = statistics_distance(found["gpu"], found["cpu"])
    assert 0 < distance < 1e-2, distance
