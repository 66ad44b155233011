"""End to end over HTTP: a real Redis-compatible server, the API under uvicorn and a real worker
(RQ worker + inspector processes), each on free ports: the session's shared stack. The happy
paths (an adapt job and a train job, checked bitwise against the same computation in this
process) are in the quick tier; what only input checking needs is in tests/api/test_routes.py."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.stack import SHARED_STACK_THREADS, Client, Stack, job_payload
from service.store.local import LocalStore
from workers.kinds.changing import compute
from workers.models.architectures import build_model

WORKER_THREADS = SHARED_STACK_THREADS


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def store_of(stack: Stack) -> LocalStore:
    return LocalStore(stack.data_dir / "store")


def in_process(stack: Stack, job_id: str) -> dict[str, torch.Tensor]:
    """The same job function, run here on the same payload and on as many torch threads as
    the worker (training's reductions depend on the thread count): the reference result."""
    payload = job_payload(stack, job_id)
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        return compute(payload, store_of(stack)).state_dict
    finally:
        torch.set_num_threads(threads)


def test_adapt_job_end_to_end(stack: Stack) -> None:
    client = stack.client("adapt")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=3))
    assert model["source"] == "init"
    assert [layer["kind"] for layer in model["batchnorm_layers"]] == ["BatchNorm2d"] * 2
    dataset = created(client.add_dataset(digits_npz(shifted=True)))
    assert dataset["num_samples"] == 1797
    assert dataset["sample_shape"] == [1, 8, 8]
    assert dataset["label_kind"] == "class"
    submitted = client.submit(
        {
            "kind": "adapt",
            "model_id": model["id"],
            "dataset_id": dataset["id"],
            "params": {"batch_size": 100, "estimator": "cumulative"},
        }
    )
    job = created(submitted, 202)
    assert submitted.headers["location"] == f"/v1/jobs/{job['id']}"
    done = client.wait(job["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"]["done"] >= 1
    new_model = client.http.get(f"/v1/models/{done['result']['model_id']}").json()
    assert new_model["parent"] == model["id"]
    assert new_model["job_id"] == job["id"]

    download = client.http.get(done["result"]["weights_url"])
    assert download.status_code == 200
    assert download.headers["etag"] == f'"{new_model["sha256"]}"'
    cached = client.http.get(
        done["result"]["weights_url"], headers={"If-None-Match": download.headers["etag"]}
    )
    assert cached.status_code == 304
    state = safetensors.torch.load(download.content)
    built = build_model("digits_cnn", {"width": 8})
    built.load_state_dict(state, strict=True)
    expected = in_process(stack, job["id"])
    assert set(state) == set(expected)  # safetensors keeps no key order
    for key, value in expected.items():
        assert torch.equal(state[key], value), key

    report = client.http.get(done["result"]["report_url"]).json()
    assert report["torch_threads"] == WORKER_THREADS  # the worker's BNADAPT_WORKER_THREADS
    assert report["batches"] == 18  # ceil(1797 / 100)
    for layer in report["batchnorm"]:
        # cumulative resets first: the counter restarts at 0 and counts each batch once
        assert layer["adapted"]
        assert layer["reset"]
        assert layer["num_batches_tracked_after"] == report["batches"] == layer["batches_run"]
    assert report["metrics_before"]["num_samples"] == 1797
    assert report["metrics_after"]["accuracy"] is not None


def test_train_job_end_to_end(stack: Stack) -> None:
    client = stack.client("train")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=600)))
    job = created(
        client.submit(
            {
                "kind": "train",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                "params": {"epochs": 2, "batch_size": 50, "validation_fraction": 0.1},
            }
        ),
        202,
    )
    done = client.wait(job["id"])
    assert done["status"] == "succeeded", done
    report = client.http.get(done["result"]["report_url"]).json()
    assert [e["epoch"] for e in report["epochs"]] == [1, 2]
    for layer in report["batchnorm"]:
        grown = layer["num_batches_tracked_after"] - layer["num_batches_tracked_before"]
        assert grown == report["batches"] > 0
    state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
    expected = in_process(stack, job["id"])
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    # The trained weights register again, as an upload.
    again = created(client.add_model("digits_cnn", {"width": 8}, safetensors.torch.save(state)))
    assert again["source"] == "upload"
    assert (
        again["sha256"]
        == client.http.get(f"/v1/models/{done['result']['model_id']}").json()["sha256"]
    )


def weights_of(architecture: str, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in build_model(architecture, kwargs).state_dict().items()}


def object_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.array([{"a": 1}, None], dtype=object))
    return buffer.getvalue()


def long_train(client: Client) -> dict[str, Any]:
    model = created(client.add_model("resnet", {"in_channels": 1, "depth": 4, "width": 32}))
    dataset = created(client.add_dataset(digits_npz()))
    return {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"epochs": 50, "batch_size": 16},
    }


@pytest.mark.slow
def test_cancel_queued_and_running(stack: Stack) -> None:
    client = stack.client("cancel")
    body = long_train(client)
    running = created(client.submit(body), 202)
    queued = created(client.submit({**body, "params": {"epochs": 1}}), 202)
    from harness.servers import wait_for

    wait_for(
        lambda: client.http.get(f"/v1/jobs/{running['id']}").json()["status"] == "running",
        timeout_s=60,
        what="the long job to start",
    )
    assert client.http.get(f"/v1/jobs/{queued['id']}").json()["status"] == "queued"
    canceled = client.http.post(f"/v1/jobs/{queued['id']}:cancel")
    assert created(canceled, 202)["status"] == "canceled"
    asked = created(client.http.post(f"/v1/jobs/{running['id']}:cancel"), 202)
    assert asked["status"] in ("running", "canceled")
    assert client.wait(running["id"], timeout_s=60)["status"] == "canceled"
    problem(client.http.post(f"/v1/jobs/{running['id']}:cancel"), 409, "already canceled")
    problem(client.http.get(f"/v1/jobs/{running['id']}/report"), 409, "canceled")
    # Nothing was registered for either job.
    models = client.http.get("/v1/models").json()["items"]
    assert all(m["source"] != "job" for m in models)
    # The worker goes on serving.
    after = created(client.submit({**body, "params": {"epochs": 1, "batch_size": 512}}), 202)
    assert client.wait(after["id"], timeout_s=120)["status"] == "succeeded"


def test_service_does_not_import_torch() -> None:
    code = (
        "import sys, service.api.app, service.api.routes.jobs, service.records.sync; "
        "import service.local.embedded; "
        "service.api.app.create_app(); "
        "assert 'torch' not in sys.modules and 'workers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
