"""The routes and the contract, in process: the app object under uvicorn over a real
Redis-compatible server, with the model inspector in a thread and no worker
(``harness/inprocess.py``). Jobs are accepted and stay queued; what running them does is in
tests/e2e/."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from harness.answers import created, problem
from harness.digits import digits, digits_npz
from harness.inprocess import MAX_DATASET_BYTES, InProcessApi
from harness.stack import Client, npz_bytes
from tests.e2e.test_e2e import object_npz, weights_of


def test_architectures_catalog(api: InProcessApi) -> None:
    client = api.client("catalog")
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


def test_bad_weights_are_refused_with_a_reason(api: InProcessApi, tmp_path: Path) -> None:
    client = api.client("bad-weights")
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


def test_bad_datasets_are_refused_with_a_reason(api: InProcessApi) -> None:
    client = api.client("bad-data")
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


def test_bad_jobs_are_refused_and_the_service_still_works(api: InProcessApi) -> None:
    client = api.client("bad-jobs")
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

    # After all of that, the API still takes a normal job.
    ok = created(client.submit(job(params={"batch_size": 32})), 202)
    assert client.http.get(f"/v1/jobs/{ok['id']}").json()["status"] == "queued"


def test_auth_and_tenant_isolation(api: InProcessApi) -> None:
    alice = api.client("alice")
    bob = api.client("bob")
    model = created(alice.add_model("digits_cnn", {"width": 8}))
    dataset = created(alice.add_dataset(digits_npz(n=64)))
    job = created(
        alice.submit({"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}),
        202,
    )

    anonymous = Client(api.url, None)
    problem(anonymous.http.get("/v1/models"), 401, "API key")
    assert anonymous.http.get("/v1/models").headers["www-authenticate"] == "Bearer"
    problem(Client(api.url, "bna_0123456789abcdef_nope").http.get("/v1/models"), 401)
    problem(Client(api.url, "garbage").http.get("/v1/jobs"), 401)
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
    wrong_secret = Client(api.url, alice.http.headers["Authorization"].split()[1] + "x")
    for method, path in routes:
        problem(bob.http.request(method, path), 404)
        assert anonymous.http.request(method, path).status_code == 401
        # A job route reads the key and the job at once: a wrong key still gets nothing.
        problem(wrong_secret.http.request(method, path), 401, "not valid")
        problem(Client(api.url, "garbage").http.request(method, path), 401, "not valid")
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


def test_pagination_idempotency_and_status_filter(api: InProcessApi) -> None:
    client = api.client("pages")
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
    # No worker runs here: the job stays queued.
    listed = client.http.get("/v1/jobs", params={"status": "queued"}).json()["items"]
    assert [j["id"] for j in listed] == [first["id"]]
    assert client.http.get("/v1/jobs", params={"status": "succeeded"}).json()["items"] == []


def test_a_queued_job_through_its_life_without_a_worker(api: InProcessApi) -> None:
    client = api.client("life")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=32)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    job = created(client.submit(body), 202)
    path = f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued"
    assert client.http.get(path).json()["status"] == "queued"
    problem(client.http.delete(path), 409, "cancel it")
    problem(client.http.get(f"{path}/report"), 409)
    assert client.http.get(f"{path}/logs").json()["items"] == []

    canceled = created(client.http.post(f"{path}:cancel"), 202)
    assert canceled["status"] == "canceled"
    problem(client.http.post(f"{path}:cancel"), 409, "already canceled")
    problem(client.http.get(f"{path}/report"), 409, "canceled")
    # The event stream of an ended job says so and ends.
    events = client.http.get(f"{path}/events")
    assert events.headers["content-type"].startswith("text/event-stream")
    assert events.text.startswith("event: status\ndata: {") and "event: end\n" in events.text
    listed = client.http.get("/v1/jobs", params={"status": "canceled"}).json()["items"]
    assert [j["id"] for j in listed] == [job["id"]]
    assert client.http.delete(path).status_code == 204
    problem(client.http.get(path), 404)


def test_models_and_datasets_read_download_and_delete(api: InProcessApi) -> None:
    client = api.client("resources")
    state = weights_of("digits_cnn", {"width": 4})
    model = created(client.add_model("digits_cnn", {"width": 4}, safetensors.torch.save(state)))
    assert model["source"] == "upload"
    assert client.http.get(f"/v1/models/{model['id']}").json() == model
    download = client.http.get(f"/v1/models/{model['id']}/weights")
    assert download.headers["etag"] == f'"{model["sha256"]}"'
    loaded = safetensors.torch.load(download.content)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    dataset = created(client.add_dataset(digits_npz(n=16)))
    assert client.http.get(f"/v1/datasets/{dataset['id']}").json() == dataset
    assert [d["id"] for d in client.http.get("/v1/datasets").json()["items"]] == [dataset["id"]]
    for resource, found in (("models", model), ("datasets", dataset)):
        assert client.http.delete(f"/v1/{resource}/{found['id']}").status_code == 204
        problem(client.http.get(f"/v1/{resource}/{found['id']}"), 404)
        assert client.http.get(f"/v1/{resource}").json()["items"] == []


def test_the_ui_docs_and_metrics_are_served(api: InProcessApi) -> None:
    anonymous = api.anonymous()
    assert anonymous.http.get("/").headers["location"] == "/ui/"
    page = anonymous.http.get("/ui/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert anonymous.http.get("/ui/app.js").status_code == 200
    assert "swagger-ui" in anonymous.http.get("/docs").text
    client = api.client("metrics")
    client.http.get("/v1/jobs")
    text = anonymous.http.get("/metrics").text
    assert 'route="/v1/jobs",status="200"' in text
    assert "bnadapt_queue_depth " in text
