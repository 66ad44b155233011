"""End to end over HTTP: a real Redis-compatible server, the API under uvicorn and a real worker
(RQ worker + inspector processes), each on free ports."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from sklearn.datasets import load_digits

from service.store.local import LocalStore
from tests.stack import Client, Stack, job_payload, npz_bytes, running_stack
from workers.models.architectures import build_model
from workers.running.compute import compute

pytestmark = pytest.mark.slow

MAX_DATASET_BYTES = 3 * 1024 * 1024
WORKER_THREADS = 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    limits = {
        "BNADAPT_MAX_DATASET_BYTES": str(MAX_DATASET_BYTES),
        "BNADAPT_WORKER_THREADS": str(WORKER_THREADS),
    }
    with running_stack(tmp_path_factory.mktemp("stack"), limits) as stack:
        yield stack


def digits(shifted: bool = False, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8) in [0, 1]
    if shifted:
        x = np.clip(x * 0.5 + 0.3, 0, 1).astype(np.float32)  # contrast down, brightness up
    y = data.target.astype(np.int64)
    return (x[:n], y[:n]) if n else (x, y)


def digits_npz(shifted: bool = False, n: int | None = None, labels: bool = True) -> bytes:
    x, y = digits(shifted, n)
    return npz_bytes(x=x, y=y) if labels else npz_bytes(x=x)


def created(response: Any, status: int = 201) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def problem(response: Any, status: int, *phrases: str) -> dict[str, Any]:
    """The response is a problem+json with ``status`` whose detail names each phrase."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    for phrase in phrases:
        assert phrase.lower() in body["detail"].lower(), body["detail"]
    return body


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


def test_architectures_catalog(stack: Stack) -> None:
    client = stack.client("catalog")
    names = {a["name"]: a for a in client.http.get("/v1/architectures").json()}
    assert {"digits_cnn", "resnet", "mlp"} <= set(names)
    assert names["digits_cnn"]["input_shape"] == [1, 8, 8]
    assert names["resnet"]["input_shape"][1:] == [None, None]
    ready = client.http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"redis": "ok", "workers": "ok", "store": "ok"}
    spec = client.http.get("/openapi.json").json()
    assert "/v1/jobs/{job_id}:cancel" in spec["paths"]
    assert client.http.get("/docs").status_code == 200


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


def test_bad_weights_are_refused_with_a_reason(stack: Stack, tmp_path: Path) -> None:
    client = stack.client("bad-weights")
    state = weights_of("digits_cnn", {})
    problem(client.add_model("digits_cnn", {}, pickle.dumps(state)), 422, "safetensors only")
    torch.save(state, tmp_path / "w.pt")
    pt = (tmp_path / "w.pt").read_bytes()
    problem(client.add_model("digits_cnn", {}, pt), 422, "safetensors only")
    good = safetensors.torch.save(state)
    problem(client.add_model("digits_cnn", {}, good[: len(good) // 2]), 422, "truncated")

    missing = dict(state)
    missing.pop("0.weight" if "0.weight" in state else next(iter(state)))
    body = problem(client.add_model("digits_cnn", {}, safetensors.torch.save(missing)), 422)
    assert "missing" in body["detail"]
    extra = {**state, "bogus.weight": torch.zeros(3)}
    body = problem(client.add_model("digits_cnn", {}, safetensors.torch.save(extra)), 422)
    assert "unexpected" in body["detail"]
    assert "bogus.weight" in body["detail"]
    problem(client.add_model("digits_cnn", {"width": 4}, good), 422, "mis-shaped", "strict=True")
    problem(client.add_model("no_such_net", {}), 422, "unknown architecture", "digits_cnn")
    problem(client.add_model("digits_cnn", {"depth": 3}), 422, "unknown kwargs")
    problem(client.add_model("digits_cnn", {"width": 0}), 422, "minimum")
    response = client.http.post("/v1/models", data={"meta": "{not json"})
    problem(response, 422, "meta")


def object_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.array([{"a": 1}, None], dtype=object))
    return buffer.getvalue()


def test_bad_datasets_are_refused_with_a_reason(stack: Stack) -> None:
    client = stack.client("bad-data")
    x, y = digits(n=20)
    problem(client.add_dataset(object_npz()), 422, "object")
    nan = x.copy()
    nan[3, 0, 2, 2] = np.nan
    problem(client.add_dataset(npz_bytes(x=nan, y=y)), 422, "non-finite", "NaN")
    inf = x.copy()
    inf[0, 0, 0, 0] = np.inf
    problem(client.add_dataset(npz_bytes(x=inf)), 422, "non-finite")
    problem(client.add_dataset(npz_bytes(x=x, y=y - 5)), 422, "negative")
    problem(client.add_dataset(npz_bytes(x=x, y=y[:10])), 422, "20", "10")
    problem(client.add_dataset(npz_bytes(x=x[:0], y=y[:0])), 422, "sample")
    problem(client.add_dataset(pickle.dumps({"x": x})), 422, "pickle")
    problem(client.add_dataset(safetensors.numpy.save({"x": x})[:-10], name="d.safetensors"), 422)
    big = np.zeros((MAX_DATASET_BYTES // 4 + 1024,), dtype=np.float32)
    problem(client.add_dataset(npz_bytes(x=big)), 413, "limit")
    # safetensors with labels works too
    ok = created(client.add_dataset(safetensors.numpy.save({"x": x, "y": y}), "d.safetensors"))
    assert ok["format"] == "safetensors"


def test_bad_jobs_are_refused_and_the_service_still_works(stack: Stack) -> None:
    client = stack.client("bad-jobs")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    labelled = created(client.add_dataset(digits_npz(n=64)))
    unlabelled = created(client.add_dataset(digits_npz(n=64, labels=False)))
    wrong_shape = created(client.add_dataset(npz_bytes(x=np.zeros((4, 1, 9, 9), np.float32))))
    x, _ = digits(n=64)
    targets = created(client.add_dataset(npz_bytes(x=x, y=np.linspace(0, 1, 64, dtype=np.float32))))

    def job(kind: str = "adapt", **overrides: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": kind,
            "model_id": model["id"],
            "dataset_id": labelled["id"],
            "params": {},
        }
        body.update(overrides)
        return body

    problem(client.submit(job(dataset_id=wrong_shape["id"])), 422, "[1, 9, 9]", "1x8x8")
    problem(client.submit(job("train", dataset_id=unlabelled["id"])), 422, "need labels")
    problem(
        client.submit(job("train", dataset_id=targets["id"], params={"loss": "cross_entropy"})),
        422,
        "class labels",
    )
    problem(client.submit(job(model_id="mdl_doesnotexist")), 404, "model")
    problem(client.submit(job(dataset_id="ds_doesnotexist")), 404, "dataset")
    body = problem(client.submit(job(params={"batch_size": 0})), 422, "batch_size")
    assert body["errors"][0]["loc"][-1] == "batch_size"
    problem(client.submit(job(params={"estimator": "magic"})), 422, "estimator")
    problem(client.submit(job(kind="finetune")), 422, "kind")
    problem(client.submit(job(params={"bogus": 1})), 422, "bogus")
    problem(client.http.get("/v1/jobs/job_doesnotexist"), 404, "job")
    problem(client.http.get("/v1/jobs/abc:cancel"), 405, "POST")  # not a job id
    problem(client.http.get("/v1/jobs/bad%20id"), 422)
    problem(client.http.get("/v1/models/..%2Fetc"), 404)
    problem(client.http.get("/v1/jobs", params={"page_token": "!!!"}), 422, "page_token")

    # After all of that, the API and the worker still serve a normal job.
    ok = created(client.submit(job(params={"batch_size": 32})), 202)
    assert client.wait(ok["id"])["status"] == "succeeded"


def test_auth_and_tenant_isolation(stack: Stack) -> None:
    alice = stack.client("alice")
    bob = stack.client("bob")
    model = created(alice.add_model("digits_cnn", {"width": 8}))
    dataset = created(alice.add_dataset(digits_npz(n=64)))
    job = created(
        alice.submit({"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}),
        202,
    )
    assert alice.wait(job["id"])["status"] == "succeeded"

    anonymous = Client(stack.url, None)
    problem(anonymous.http.get("/v1/models"), 401, "API key")
    assert anonymous.http.get("/v1/models").headers["www-authenticate"] == "Bearer"
    problem(Client(stack.url, "bna_0123456789abcdef_nope").http.get("/v1/models"), 401)
    problem(Client(stack.url, "garbage").http.get("/v1/jobs"), 401)
    assert anonymous.http.get("/healthz").status_code == 200

    routes = [
        ("GET", f"/v1/models/{model['id']}"),
        ("GET", f"/v1/models/{model['id']}/weights"),
        ("DELETE", f"/v1/models/{model['id']}"),
        ("GET", f"/v1/datasets/{dataset['id']}"),
        ("DELETE", f"/v1/datasets/{dataset['id']}"),
        ("GET", f"/v1/jobs/{job['id']}"),
        ("GET", f"/v1/jobs/{job['id']}/report"),
        ("POST", f"/v1/jobs/{job['id']}:cancel"),
    ]
    wrong_secret = Client(stack.url, alice.http.headers["Authorization"].split()[1] + "x")
    for method, path in routes:
        problem(bob.http.request(method, path), 404)
        assert anonymous.http.request(method, path).status_code == 401
        # A job route reads the key and the job at once: a wrong key still gets nothing.
        problem(wrong_secret.http.request(method, path), 401, "not valid")
        problem(Client(stack.url, "garbage").http.request(method, path), 401, "not valid")
    problem(
        bob.submit({"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}),
        404,
        "model",
    )
    for kind in ("models", "datasets", "jobs"):
        assert bob.http.get(f"/v1/{kind}").json()["items"] == []
    # Alice still has everything.
    assert alice.http.get(f"/v1/models/{model['id']}").status_code == 200
    assert alice.http.delete(f"/v1/datasets/{dataset['id']}").status_code == 204
    problem(alice.http.get(f"/v1/datasets/{dataset['id']}"), 404)


def test_pagination_idempotency_and_status_filter(stack: Stack) -> None:
    client = stack.client("pages")
    ids = [created(client.add_dataset(digits_npz(n=8), name=f"d{i}"))["id"] for i in range(5)]
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params: dict[str, Any] = {"page_size": 2}
        if token:
            params["page_token"] = token
        page = client.http.get("/v1/datasets", params=params).json()
        seen += [d["id"] for d in page["items"]]
        pages += 1
        token = page["next_page_token"]
        if token is None:
            break
    assert seen == ids[::-1]  # newest first, each once
    assert pages == 3

    model = created(client.add_model("digits_cnn", {"width": 8}))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": ids[0]}
    first = created(client.submit(body, **{"Idempotency-Key": "k-1"}), 202)
    again = created(client.submit(body, **{"Idempotency-Key": "k-1"}), 202)
    assert again["id"] == first["id"]
    other = {**body, "params": {"batch_size": 3}}
    problem(client.submit(other, **{"Idempotency-Key": "k-1"}), 422, "different request body")
    assert client.wait(first["id"])["status"] == "succeeded"
    listed = client.http.get("/v1/jobs", params={"status": "succeeded"}).json()["items"]
    assert [j["id"] for j in listed] == [first["id"]]
    assert client.http.get("/v1/jobs", params={"status": "failed"}).json()["items"] == []


def long_train(client: Client) -> dict[str, Any]:
    model = created(client.add_model("resnet", {"in_channels": 1, "depth": 4, "width": 32}))
    dataset = created(client.add_dataset(digits_npz()))
    return {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"epochs": 50, "batch_size": 16},
    }


def test_cancel_queued_and_running(stack: Stack) -> None:
    client = stack.client("cancel")
    body = long_train(client)
    running = created(client.submit(body), 202)
    queued = created(client.submit({**body, "params": {"epochs": 1}}), 202)
    from tests.servers import wait_for

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
