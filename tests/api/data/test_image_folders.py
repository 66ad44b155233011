"""Folders of images and .pth weights from the CLI and the Python client (issue 28, deliver 4
and 6), against the API in process: a folder streams as a tar (class subfolders are labels,
numbered as torchvision's ImageFolder numbers them; a flat folder is unlabelled), with the
preprocessing spec given; a .pth state_dict is converted on this side and the server renames
its keys. Parity with torchvision's ImageFolder itself: tests/zoo/test_preprocessing_zoo.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

from harness.inprocess import InProcessApi
from service.client import Client
from service.formats.image_folders import FolderError, plan_folder, tar_stream
from service.formats.images import index_tar
from service.store import open_store
from tests.e2e.test_e2e import weights_of
from workers.models.architectures import build_model

# Created in this order; ImageFolder numbers them sorted: Apple 0, mango 1, zebra 2.
CLASSES = ("zebra", "Apple", "mango")
SPEC = {"resize_shorter": 16, "center_crop": [12, 12], "interpolation": "bicubic"}


def photo(path: Path, width: int, height: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=90)


def labelled_folder(root: Path) -> Path:
    for i, name in enumerate(CLASSES):
        photo(root / name / "b.2.jpg", 30, 20, i)
        photo(root / name / "a.jpg", 20, 36, 10 + i)
        photo(root / name / "deeper" / "c.png", 24, 24, 20 + i)
    (root / "Apple" / "notes.txt").write_text("not an image")
    (root / "README.md").write_text("at the top: in no class")
    return root


def cli(api: InProcessApi, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.local.cli", "--url", api.url, "--key", key, *args],
        env=api.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def stored_index(api: InProcessApi, dataset: dict[str, Any]) -> tuple[list[str], list[int]]:
    index = index_tar(open_store(api.settings).local_path(dataset["sha256"]))
    labels = [] if index.labels is None else index.labels.tolist()
    return index.keys, labels


def test_cli_sends_a_labelled_folder_as_imagefolder_numbers_it(
    api: InProcessApi, tmp_path: Path
) -> None:
    root = labelled_folder(tmp_path / "photos")
    key = api.records().create_api_key("folder-cli").key
    done = cli(api, key, "datasets", "add", str(root), "--preprocessing", json.dumps(SPEC))
    assert done.returncode == 0, done.stderr
    dataset = json.loads(done.stdout)
    assert (dataset["num_samples"], dataset["num_classes"], dataset["has_labels"]) == (9, 3, True)
    assert dataset["sample_shape"] == [3, 12, 12]
    assert dataset["image_size"] is None  # three sizes, one shape after the spec
    assert dataset["preprocessing"]["resize_shorter"] == 16
    assert dataset["preprocessing"]["interpolation"] == "bicubic"
    assert dataset["name"] == "photos"
    keys, labels = stored_index(api, dataset)
    # Classes sorted (upper case first, as sorted() does), files sorted, subfolders walked.
    assert keys == [
        f"{name}/{file}"
        for name in ("Apple", "mango", "zebra")
        for file in ("a", "b_2", "deeper/c")
    ]
    assert labels == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert "left out 2 files" in done.stderr
    # The stored file is the stream's bytes: nothing was added or reordered on the way.
    streamed = b"".join(tar_stream(plan_folder(root)))
    assert dataset["sha256"] == hashlib.sha256(streamed).hexdigest()


def test_client_sends_a_flat_folder_unlabelled_in_several_parts(
    api: InProcessApi, tmp_path: Path
) -> None:
    root = tmp_path / "flat"
    for i in range(5):
        photo(root / f"shot{i}.jpg", 40 + 7 * i, 32, i)
    tenant = api.client("folder-flat")
    client = Client(api.url, tenant.api.http.headers["Authorization"].removeprefix("Bearer "))
    seen: list[tuple[int, int]] = []
    dataset = client.upload_folder(
        root,
        "flat",
        preprocessing={"resize_shorter": 24, "center_crop": [24, 24], "interpolation": "lanczos"},
        part_bytes=4096,
        on_progress=lambda done, total: seen.append((done, total)),
    )
    assert (dataset.num_samples, dataset.has_labels, dataset.num_classes) == (5, False, None)
    assert dataset.sample_shape == [3, 24, 24]
    assert len(seen) > 2 and seen[-1][0] == seen[-1][1]  # several parts, all of the tar
    upload = tenant.http.get(f"/v1/uploads/{client.last_upload_id}")
    assert upload.status_code == 404  # completed: the upload is gone, the dataset stays
    keys, labels = stored_index(api, dataset.model_dump())
    assert keys == [f"shot{i}" for i in range(5)] and labels == []


def test_a_folder_of_several_sizes_without_one_output_size_is_refused(
    api: InProcessApi, tmp_path: Path
) -> None:
    root = labelled_folder(tmp_path / "mixed")
    key = api.records().create_api_key("folder-mixed").key
    done = cli(api, key, "datasets", "add", str(root))
    assert done.returncode == 1
    assert "resize_shorter" in done.stderr and "center_crop" in done.stderr
    empty = tmp_path / "empty-class"
    photo(empty / "cat" / "a.jpg", 8, 8, 0)
    (empty / "dog").mkdir()
    done = cli(api, key, "datasets", "add", str(empty))
    assert done.returncode == 1 and "dog holds no .jpg" in done.stderr
    done = cli(api, key, "datasets", "add", str(root), "--preprocessing", "model")
    assert done.returncode == 1 and "give 'model' to a job" in done.stderr


def test_cli_converts_a_pth_checkpoint_and_the_server_renames_its_keys(
    api: InProcessApi, tmp_path: Path
) -> None:
    state = weights_of("digits_cnn", {})
    path = tmp_path / "checkpoint.pth"
    wrapped = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}
    torch.save(wrapped, path)
    key = api.records().create_api_key("pth").key
    done = cli(api, key, "models", "add", "digits_cnn", "--weights", str(path))
    assert done.returncode == 0, done.stderr
    model = json.loads(done.stdout)
    assert model["renamed_keys"]["stripped_prefixes"] == ["module."]
    assert f"renamed {len(state)} keys" in done.stderr
    client = Client(api.url, key)
    stored = safetensors.torch.load_file(
        str(client.download_weights(model["id"], tmp_path / "stored.safetensors"))
    )
    assert sorted(stored) == sorted(state)
    assert all(torch.equal(stored[k], state[k]) for k in state)


def test_cli_refuses_a_pickled_model_object(api: InProcessApi, tmp_path: Path) -> None:
    path = tmp_path / "whole-model.pt"
    torch.save(build_model("digits_cnn", {}), path)
    key = api.records().create_api_key("pth-object").key
    done = cli(api, key, "models", "add", "digits_cnn", "--weights", str(path))
    assert done.returncode == 1
    assert "weights_only=True" in done.stderr and "state_dict" in done.stderr


@pytest.mark.parametrize("spec", ['{"crop_pct": 0.875, "center_crop": [12, 16]}', "model"])
def test_cli_submits_a_jobs_preprocessing(api: InProcessApi, tmp_path: Path, spec: str) -> None:
    key = api.records().create_api_key(f"job-spec-{len(spec)}").key
    client = Client(api.url, key)
    model = client.add_model("resnet", {"in_channels": 3})
    root = tmp_path / "flat"
    photo(root / "a.jpg", 20, 20, 0)
    dataset = client.upload_folder(root)
    done = cli(
        api,
        key,
        "jobs",
        "submit",
        "adapt",
        "--model",
        model.id,
        "--dataset",
        dataset.id,
        "--preprocessing",
        spec,
    )
    assert done.returncode == 1
    if spec == "model":  # resnet (built in) has no evaluation transform of its own
        assert "architecture resnet has none" in done.stderr
    else:  # the spec reached the API, which checked it
        assert "crop_pct" in done.stderr and "square center_crop" in done.stderr


def test_the_tar_is_made_as_it_is_read(tmp_path: Path) -> None:
    """The stream reads a file only when it reaches it (no copy made first), and a file that
    changes size once the plan is made stops it rather than send a tar whose headers lie."""
    root = tmp_path / "growing"
    photo(root / "a.jpg", 16, 16, 0)
    photo(root / "b.jpg", 16, 16, 1)
    plan = plan_folder(root)
    stream = tar_stream(plan)
    first = next(stream)  # a.jpg's header: nothing of b.jpg read yet
    assert first[:5] == b"a.jpg"
    with (root / "b.jpg").open("ab") as file:
        file.write(b"more bytes")
    with pytest.raises(FolderError, match="changed while it was sent"):
        for _ in stream:
            pass
