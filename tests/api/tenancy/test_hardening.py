"""Hostile or careless input over HTTP gets a 4xx that says what to do, never a 500, and never
a job that "succeeds" with NaN. Input checks run against the API in process
(harness/inprocess.py); the jobs that must fail run on the shared stack's real worker
(harness/stack.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import safetensors.torch
import torch

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.inprocess import InProcessApi
from harness.stack import Client, Stack, npz_bytes
from tests.e2e.test_e2e import weights_of


@pytest.fixture(scope="module")
def client(api: InProcessApi) -> Client:
    return api.client("hardening")


@pytest.fixture(scope="module")
def worker_client(shared_stack: Stack) -> Client:
    return shared_stack.client("hardening")


@pytest.mark.parametrize("resource", ["jobs", "models", "datasets"])
@pytest.mark.parametrize("token", ["%C3%A9", "%FF%FE", "%00", "a%3Ab", "____"])
def test_any_page_token_is_a_4xx(client: Client, resource: str, token: str) -> None:
    response = client.http.get(f"/v1/{resource}?page_token={token}")
    problem(response, 422, "page_token")


def test_odd_bytes_in_ids_and_headers_are_4xx(api: InProcessApi, client: Client) -> None:
    for path in ("/v1/jobs/%C3%A9", "/v1/models/%FF", "/v1/datasets/a%00b"):
        assert client.http.get(path).status_code == 422, path
    anonymous = api.anonymous()
    for key in (b"bna_\xe9\xe9_\xff", b"bna_ab_\xc3\xa9", b"\xff\xfe"):
        response = anonymous.http.get("/v1/jobs", headers={"Authorization": b"Bearer " + key})
        problem(response, 401, "not valid")
    raw = client.http.post(
        "/v1/jobs", json={"kind": "adapt"}, headers={"Idempotency-Key": b"\xc3\xa9t\xc3\xa9"}
    )
    assert raw.status_code == 422


def test_get_on_cancel_is_405(client: Client) -> None:
    response = client.http.get("/v1/jobs/job_abc:cancel")
    problem(response, 405, "POST")
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_other_methods_on_an_upload_complete_are_405(client: Client, method: str) -> None:
    # GET and DELETE exist on /v1/uploads/{id}: without its own route, ":complete" would be
    # taken for part of an id and answer 422.
    response = client.http.request(method, "/v1/uploads/up_abc:complete")
    problem(response, 405, "POST")
    assert response.headers["allow"] == "POST"


def test_job_params_are_not_coerced(client: Client) -> None:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=32)))
    base = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    for params in ({"batch_size": "64"}, {"batch_size": 64.0}, {"layerwise": "true"}):
        body = problem(client.submit({**base, "params": params}), 422)
        assert body["errors"][0]["loc"][-1] in params
    meta = problem(client.add_model("digits_cnn", {"width": 4}, seed="1"), 422)  # type: ignore[arg-type]
    assert "seed" in meta["detail"]


def test_compressed_npz_that_inflates_is_413_before_it_is_read(client: Client) -> None:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, x=np.zeros((17_000, 1000), np.float32))  # 68 MB of zeros
    assert len(buffer.getvalue()) < 1 << 20
    body = problem(client.add_dataset(buffer.getvalue()), 413, "BNADAPT_MAX_NPZ_RATIO")
    assert "times its compressed size" in body["detail"]
    # The same data saved uncompressed is a matter for the upload size limit only.
    small = io.BytesIO()
    np.savez_compressed(small, x=np.zeros((64, 1, 8, 8), np.float32))
    created(client.add_dataset(small.getvalue()))


def test_non_finite_or_lossy_weights_are_refused(client: Client) -> None:
    state = weights_of("digits_cnn", {"width": 4})
    nan = {**state, "block1.conv.weight": torch.full_like(state["block1.conv.weight"], torch.nan)}
    body = problem(
        client.add_model("digits_cnn", {"width": 4}, safetensors.torch.save(nan)),
        422,
        "non-finite",
    )
    assert any("block1.conv.weight" in str(e["loc"]) for e in body["errors"])
    for dtype in (torch.int8, torch.bool, torch.float64):
        key = "head.weight"
        cast = {**state, key: state[key].to(dtype)}
        body = problem(
            client.add_model("digits_cnn", {"width": 4}, safetensors.torch.save(cast)),
            422,
            "dtype",
        )
        assert [e["loc"] for e in body["errors"]] == [["weights", key]]
    # float16 widens to float32 without loss; num_batches_tracked stays an integer.
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    created(client.add_model("digits_cnn", {"width": 4}, safetensors.torch.save(half)))


@pytest.mark.slow
def test_adaptation_with_non_finite_statistics_fails_naming_the_layer(
    worker_client: Client,
) -> None:
    client = worker_client
    model = created(client.add_model("digits_cnn", {"width": 4}))
    huge = np.full((16, 1, 8, 8), 3e38, np.float32)  # finite, but the convolutions overflow
    dataset = created(client.add_dataset(npz_bytes(x=huge)))
    job = created(
        client.submit(
            {
                "kind": "adapt",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                "params": {"estimator": "cumulative", "batch_size": 8},
            }
        ),
        202,
    )
    done = client.wait(job["id"])
    assert done["status"] == "failed"
    assert "non-finite" in done["error"]
    assert "BatchNorm layer '" in done["error"]
    assert done["attempts"] == []  # the job's own failure: not retried
    assert not [m for m in client.http.get("/v1/models").json()["items"] if m["job_id"]]


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["ema", "entropy"])
def test_one_sample_last_batch_in_train_mode_says_what_to_do(
    worker_client: Client, estimator: str
) -> None:
    client = worker_client
    model = created(client.add_model("mlp", {"in_features": 8, "hidden": 8}))
    x = np.random.default_rng(0).random((17, 8), dtype=np.float32)
    dataset = created(client.add_dataset(npz_bytes(x=x)))
    job = created(
        client.submit(
            {
                "kind": "adapt",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                "params": {"estimator": estimator, "batch_size": 16},
            }
        ),
        202,
    )
    done = client.wait(job["id"])
    assert done["status"] == "failed"
    assert "last batch holds one sample (17 samples in batches of 16)" in done["error"]
    assert "max_batches=1" in done["error"]
