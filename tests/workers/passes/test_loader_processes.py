"""How many processes decode a job's images (NOTE [ Decoding in loader processes ] in
workers/passes/images.py): chosen from the worker's cores unless BNADAPT_LOADER_PROCESSES
says."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_schemas import JobPayload
from harness.photos import photo_jpeg
from service.settings import get_settings
from service.store.local import LocalStore
from workers.passes.images import ImageSamples, auto_loader_processes
from workers.running.loading import open_dataset


def test_a_gpu_worker_decodes_on_all_cores_but_one_a_cpu_worker_on_half() -> None:
    assert [auto_loader_processes("cuda", cores) for cores in (1, 2, 8, 64)] == [1, 1, 7, 16]
    assert [auto_loader_processes("cpu", cores) for cores in (1, 2, 8, 64)] == [1, 1, 4, 16]


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def image_payload(tmp_path: Path) -> tuple[JobPayload, LocalStore]:
    store = LocalStore(tmp_path / "store")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for i in range(4):
            data = photo_jpeg(64, 48, seed=i)
            info = tarfile.TarInfo(f"{i}.jpg")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    sha = store.put_bytes(out.getvalue())
    spec = {"resize": [32, 32]}
    payload = JobPayload.model_validate(
        {
            "job_id": "job_loaders",
            "tenant_id": "t",
            "kind": "evaluate",
            "model": {"id": "m", "architecture": "resnet", "kwargs": {}, "weights_sha256": sha},
            "dataset": {
                "id": "d",
                "sha256": sha,
                "format": "tar",
                "num_samples": 4,
                "sample_shape": [3, 32, 32],
                "dtype": "uint8",
                "has_labels": False,
                "preprocessing": spec,
            },
            "params": {"batch_size": 2, "device": "cpu"},
        }
    )
    return payload, store


@pytest.mark.usefixtures("fresh_settings")
def test_the_setting_unset_chooses_from_the_cores_and_set_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload, store = image_payload(tmp_path)
    monkeypatch.delenv("BNADAPT_LOADER_PROCESSES", raising=False)
    x, _ = open_dataset(payload, store)
    assert isinstance(x, ImageSamples)
    assert x.loader_processes == auto_loader_processes("cpu", len(os.sched_getaffinity(0)))
    monkeypatch.setenv("BNADAPT_LOADER_PROCESSES", "3")
    get_settings.cache_clear()
    x, _ = open_dataset(payload, store)
    assert isinstance(x, ImageSamples) and x.loader_processes == 3
