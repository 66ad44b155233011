"""The zoo over HTTP on the real stack (issue 28, point 7): for each family of
tests/zoo/families.py, random-initialised weights uploaded round-trip bitwise; a default adapt
job on a folder of photos with the model's own transform (``"preprocessing": "model"``)
succeeds (a model with no running statistics is refused at submission, naming `entropy`,
and the `entropy` job succeeds); a train job with the family's blocks checkpointed equals the
unwrapped computation in this process bit for bit. One stack serves every family."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchvision")
pytest.importorskip("timm")

import numpy as np
import safetensors.torch
import torch

from api_schemas import CheckpointPolicy
from harness.photos import photo_folder
from harness.stack import Client, Stack, job_payload, npz_bytes, running_stack
from service.client import Client as ApiClient
from service.store.local import LocalStore
from tests.zoo.families import FAMILIES, IMAGE_SIZE, NUM_CLASSES, Family
from workers.kinds.changing import compute
from workers.models.architectures import build_model
from workers.running.saving import weights_bytes

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

WORKER_THREADS = 1
SAMPLES = 8
BATCH = 4  # two batches


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    threads = {"BNADAPT_WORKER_THREADS": str(WORKER_THREADS)}
    with running_stack(tmp_path_factory.mktemp("zoo-stack"), threads) as running:
        yield running


def ok(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def succeeded(client: Client, job: dict[str, Any]) -> dict[str, Any]:
    done = client.wait(job["id"], timeout_s=300)
    assert done["status"] == "succeeded", done
    return done


def report_of(client: Client, done: dict[str, Any]) -> dict[str, Any]:
    return ok(client.http.get(done["result"]["report_url"]), 200)


def submit(client: Client, kind: str, model: str, data: str, **params: Any) -> Any:
    body = {"kind": kind, "model_id": model, "dataset_id": data, "params": params}
    return client.submit(body)


def unwrapped_reference(stack: Stack, job_id: str) -> dict[str, torch.Tensor]:
    """The job's computation in this process, with the same payload and seed but no
    checkpointing, on as many torch threads as the worker."""
    payload = job_payload(stack, job_id)
    params = payload.params.model_copy(update={"checkpoint": CheckpointPolicy(preset="none")})
    payload = payload.model_copy(update={"params": params})
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        return compute(payload, LocalStore(stack.data_dir / "store")).state_dict
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.architecture)
def test_zoo_family_over_http(stack: Stack, family: Family, tmp_path: Path) -> None:
    client = stack.client(f"zoo-{family.architecture}")
    torch.manual_seed(0)
    built = build_model(family.architecture, family.all_kwargs())
    with torch.no_grad():
        # Trained weights are not zero where an initialisation is (torchvision's ViT head):
        # from all-zero logits entropy minimisation has no gradient.
        for parameter in built.parameters():
            if parameter.dim() > 1 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    uploaded = weights_bytes({k: v.detach() for k, v in built.state_dict().items()})
    model = ok(client.add_model(family.architecture, family.all_kwargs(), uploaded), 201)
    assert bool(model["batchnorm_layers"]) == family.running_stats
    assert model["input_shape"][0] == 3
    # The weights round-trip bitwise: the download is the upload, byte for byte.
    download = client.http.get(f"/v1/models/{model['id']}/weights")
    assert download.status_code == 200 and download.content == uploaded

    # A default adapt job on a folder of photos, with the model's own evaluation transform
    # (the default estimator re-estimates running statistics).
    photos = ApiClient(stack.url, client.http.headers["Authorization"].removeprefix("Bearer "))
    folder = photos.upload_folder(
        photo_folder(tmp_path / "photos", 2, SAMPLES // 2),
        preprocessing={"resize_shorter": 40, "center_crop": [IMAGE_SIZE, IMAGE_SIZE]},
    )
    assert folder.has_labels and folder.num_samples == SAMPLES
    adapt = submit(client, "adapt", model["id"], folder.id, batch_size=BATCH, preprocessing="model")
    if family.running_stats:
        report = report_of(client, succeeded(client, ok(adapt, 202)))
        assert any(layer["adapted"] for layer in report["batchnorm"])
    else:
        refused = ok(adapt, 422)
        assert "entropy" in refused["detail"], refused["detail"]
        entropy = submit(
            client,
            "adapt",
            model["id"],
            folder.id,
            batch_size=BATCH,
            estimator="entropy",
            preprocessing="model",
        )
        report = report_of(client, succeeded(client, ok(entropy, 202)))
        assert report["affine"] and all(layer["changed"] for layer in report["affine"])
        assert {layer["kind"] for layer in report["affine"]} <= {"LayerNorm", "LayerNorm2d"}
    assert report["checkpoint"]["blocks_rule"] == "block_types"
    assert report["samples"] == SAMPLES
    assert report["preprocessing"] == model["preprocessing"] is not None

    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, SAMPLES).astype(np.int64)
    data = ok(client.add_dataset(npz_bytes(x=x, y=y)), 201)["id"]

    # A train job with the blocks checkpointed (the default policy) equals plain training.
    train = submit(
        client, "train", model["id"], data, batch_size=BATCH, validation_fraction=0.0, lr=0.01
    )
    done = succeeded(client, ok(train, 202))
    report = report_of(client, done)
    assert report["checkpoint"]["wrapped"] > 0 and report["checkpoint"]["note"] is None
    state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
    expected = unwrapped_reference(stack, done["id"])
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_cli_lists_the_zoo_by_family(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    from service.local.cli import main as cli_main

    key = stack.records().create_api_key("zoo-cli").key
    flags = ["--url", stack.url, "--key", key]
    catalog = stack.client("zoo-cli-2").api.architectures()
    capsys.readouterr()
    assert cli_main([*flags, "architectures"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) < len(catalog) / 4, "families, not one line per architecture"
    resnets = sum(1 for a in catalog if a.name.startswith("timm.resnet") and a.name[11].isdigit())
    family = next(line for line in lines if line.split()[0] == "timm.resnet")
    assert int(family.split()[1]) >= resnets
    assert any(line.startswith("digits_cnn") for line in lines), "built-ins one a line"
    assert "zoo architectures in" in out.err
    assert cli_main([*flags, "architectures", "timm.convnext_a*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("timm.convnext_a") for line in lines)
    atto = next(line for line in lines if line.split()[0] == "timm.convnext_atto")
    assert "input 3x*x*" in atto and "drop_path_rate=0.0" in atto
    assert cli_main([*flags, "architectures", "--all"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(catalog)


def test_a_model_without_blocks_runs_unwrapped_and_the_report_says_so(stack: Stack) -> None:
    """timm's DLA has neither known block classes nor repeated siblings (NOTE [ The blocks
    rule ]): the default train job runs without checkpointing and says so, not a failure."""
    client = stack.client("zoo-no-blocks")
    kwargs = {"num_classes": NUM_CLASSES}
    model = ok(client.add_model("timm.dla34", kwargs, seed=1), 201)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((SAMPLES, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, SAMPLES).astype(np.int64)
    data = ok(client.add_dataset(npz_bytes(x=x, y=y)), 201)["id"]
    train = submit(client, "train", model["id"], data, batch_size=BATCH, validation_fraction=0.0)
    report = report_of(client, succeeded(client, ok(train, 202)))
    checkpoint = report["checkpoint"]
    assert checkpoint["preset"] == "blocks" and checkpoint["blocks_rule"] == "none"
    assert checkpoint["wrapped"] == 0 and "found no repeated blocks" in checkpoint["note"]
