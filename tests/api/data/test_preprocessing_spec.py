"""The preprocessing spec's resize_shorter, interpolation and crop_pct at the API, in process:
what registration and job submission accept, the shapes they compute, and what they refuse
with a reason (issue 28, deliver 5). Parity with torchvision's and timm's transforms:
tests/zoo/test_preprocessing_zoo.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.answers import created, problem
from harness.inprocess import InProcessApi
from harness.stack import npz_bytes
from service.client import Client
from tests.api.data.test_image_folders import photo


def register(client: Any, content: bytes, spec: dict[str, Any]) -> Any:
    return client.api.request(
        "POST",
        "/v1/datasets",
        files={"file": ("d.npz", content)},
        data={"preprocessing": json.dumps(spec)},
    )


@pytest.mark.parametrize(
    ("spec", "phrases"),
    [
        ({"resize": [8, 8], "resize_shorter": 8}, ("resize and resize_shorter", "give one")),
        ({"resize_shorter": 8, "crop_pct": 0.9}, ("resize_shorter and crop_pct",)),
        ({"crop_pct": 0.9}, ("square center_crop",)),
        ({"crop_pct": 0.9, "center_crop": [4, 6]}, ("square center_crop",)),
        ({"crop_pct": 1.5, "center_crop": [4, 4]}, ("crop_pct",)),
        ({"resize_shorter": 4, "center_crop": [6, 6]}, ("larger than resize_shorter",)),
        ({"interpolation": "area"}, ("interpolation",)),
        ({"resize_shorter": 6, "interpolation": "lanczos"}, ("lanczos", "torch")),
    ],
)
def test_bad_specs_are_refused_with_the_reason(
    api: InProcessApi, spec: dict[str, Any], phrases: tuple[str, ...]
) -> None:
    client = api.client("bad-spec")
    x = np.zeros((4, 3, 8, 12), dtype=np.uint8)
    problem(register(client, npz_bytes(x=x), spec), 422, *phrases)


def test_a_uint8_array_takes_resize_shorter(api: InProcessApi) -> None:
    client = api.client("array-shorter")
    x = np.random.default_rng(0).integers(0, 256, (4, 3, 8, 12), dtype=np.uint8)
    spec = {"resize_shorter": 6, "interpolation": "bicubic"}
    dataset = created(register(client, npz_bytes(x=x), spec))
    assert dataset["sample_shape"] == [3, 6, 9]  # 12 * 6 / 8
    spec = {"crop_pct": 0.875, "center_crop": [6, 6], "interpolation": "nearest"}
    assert created(register(client, npz_bytes(x=x), spec))["sample_shape"] == [3, 6, 6]


def test_a_job_spec_on_images_of_several_sizes_needs_one_output_size(
    api: InProcessApi, tmp_path: Path
) -> None:
    tenant = api.client("job-spec-sizes")
    client = Client(api.url, tenant.api.http.headers["Authorization"].removeprefix("Bearer "))
    for i, (width, height) in enumerate([(20, 16), (16, 24)]):
        photo(tmp_path / "two" / f"{i}.jpg", width, height, i)
    dataset = client.upload_folder(tmp_path / "two", preprocessing={"resize": [16, 16]})
    assert dataset.image_size is None
    model = client.add_model("resnet", {"in_channels": 3})

    def submit(spec: dict[str, Any]) -> Any:
        body = {
            "kind": "adapt",
            "model_id": model.id,
            "dataset_id": dataset.id,
            "params": {"preprocessing": spec},
        }
        return client.request("POST", "/v1/jobs", json=body)

    problem(submit({"resize_shorter": 12}), 422, "several sizes", "resize_shorter")
    job = created(submit({"resize_shorter": 12, "center_crop": [10, 10]}), 202)
    assert job["params"]["preprocessing"]["resize_shorter"] == 12
    created(submit({"crop_pct": 0.9, "center_crop": [10, 10], "interpolation": "bicubic"}), 202)
