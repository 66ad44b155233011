"""Quotas that hold under load and bytes counted while anything holds them (NOTE [ Tenant
quotas ] in service/records/tenancy/quotas.py), on the real API in this process over a real
Redis-compatible server, through HTTP: many concurrent submitters of one tenant get only 202
and 429 and leave the active-job count exact; a dataset's bytes stay counted while a job that
used it is kept; the same bytes count once; open uploads reserve their size until they end or
expire; a job that registers a model is refused while the tenant has no room for one; an
import (on SeaweedFS) takes an open-upload slot while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.answers import created, problem
from harness.digits import digits
from harness.inprocess import InProcessApi, running_api
from harness.servers import S3Server
from harness.stack import Client, Stack, npz_bytes
from service.records import keys
from service.records.sync import Records


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    """No limit by default (each test gives its tenant its own values), no request rate."""
    with running_api(
        tmp_path_factory.mktemp("holdings"),
        tenant_max_active_jobs=0,
        tenant_max_stored_bytes=0,
        tenant_max_open_uploads=0,
        tenant_rate_per_s=0,
    ) as running:
        yield running


def dataset_bytes(i: int) -> bytes:
    """A small labelled dataset; the same size for every ``i``, other bytes."""
    x, y = digits(n=32)
    return npz_bytes(x=x + np.float32(i + 1) * np.float32(1e-3), y=y)


def tenant(api: InProcessApi, name: str) -> tuple[Records, str, Client]:
    records = api.records()
    key = records.create_api_key(name)
    return records, key.tenant_id, Client(api.url, key.key)


def stored(records: Records, tenant_id: str) -> float:
    return records.quota_usage(tenant_id)["max_stored_bytes"]


def submit_all(
    api: InProcessApi, key: str, body: dict[str, Any], threads: int, each: int
) -> list[int]:
    """``threads`` clients of one key, each with its own connection, submit ``each`` jobs at
    once; every status they got."""
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def run() -> None:
        own = Client(api.url, key)
        start.wait()
        for _ in range(each):
            status = own.submit(body).status_code
            with lock:
                statuses.append(status)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return statuses


def active_jobs(client: Client) -> list[str]:
    """The ids of the tenant's queued and running jobs, from the API."""
    found: list[str] = []
    for status in ("queued", "running"):
        token: str | None = None
        while True:
            params: dict[str, Any] = {"status": status, "page_size": 200}
            if token:
                params["page_token"] = token
            page = client.http.get("/v1/jobs", params=params).json()
            found += [job["id"] for job in page["items"]]
            token = page.get("next_page_token")
            if not token:
                break
    return found


@pytest.mark.slow
def test_64_concurrent_submitters_get_only_202_and_429_and_the_count_stays_exact(
    api: InProcessApi,
) -> None:
    records, tenant_id, client = tenant(api, "sixty-four")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(dataset_bytes(0)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    limit = 100  # enough writers racing that WATCH gave up (500) before the scripts
    records.set_quota(tenant_id, "max_active_jobs", limit)
    key = client.http.headers["authorization"].split(" ", 1)[1]
    statuses = submit_all(api, key, body, threads=64, each=3)
    assert set(statuses) <= {202, 429}, sorted(statuses)
    assert statuses.count(202) == limit
    active = active_jobs(client)
    assert len(active) == limit
    assert records.quota_usage(tenant_id)["max_active_jobs"] == limit
    # Ten end: exactly ten more are taken, by as many racing clients.
    for job_id in active[:10]:
        created(client.http.post(f"/v1/jobs/{job_id}:cancel"), 202)
    assert records.quota_usage(tenant_id)["max_active_jobs"] == limit - 10
    statuses = submit_all(api, key, body, threads=64, each=1)
    assert set(statuses) <= {202, 429}, sorted(statuses)
    assert statuses.count(202) == 10
    assert len(active_jobs(client)) == limit
    assert records.quota_usage(tenant_id)["max_active_jobs"] == limit


@pytest.mark.slow
def test_16_concurrent_submitters_without_a_quota_get_no_5xx(api: InProcessApi) -> None:
    records, tenant_id, client = tenant(api, "sixteen")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(dataset_bytes(0)))
    body = {"kind": "evaluate", "model_id": model["id"], "dataset_id": dataset["id"]}
    key = client.http.headers["authorization"].split(" ", 1)[1]
    statuses = submit_all(api, key, body, threads=16, each=8)
    assert statuses == [202] * (16 * 8), sorted(statuses)
    assert len(active_jobs(client)) == 16 * 8
    assert records.quota_usage(tenant_id)["max_active_jobs"] == 16 * 8


def test_a_deleted_datasets_bytes_count_while_a_job_that_used_it_is_kept(
    api: InProcessApi,
) -> None:
    records, tenant_id, client = tenant(api, "held-by-jobs")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    size = len(dataset_bytes(0))
    base = stored(records, tenant_id)
    assert base == model["size_bytes"]

    def round_trip(i: int) -> str:
        """Upload a dataset, submit a job on it, cancel the job, delete the dataset."""
        dataset = created(client.add_dataset(dataset_bytes(i)))
        # evaluate: a job that registers no model, so none is refused for want of room.
        body = {"kind": "evaluate", "model_id": model["id"], "dataset_id": dataset["id"]}
        job = created(client.submit(body), 202)
        created(client.http.post(f"/v1/jobs/{job['id']}:cancel"), 202)
        assert client.http.delete(f"/v1/datasets/{dataset['id']}").status_code == 204
        return str(job["id"])

    job_id = round_trip(0)
    assert stored(records, tenant_id) == base + size  # the job still holds the dataset
    # Counted again from the records (a tenant from before holdings were kept), the same.
    records.client.delete(
        keys.tenant_held_sizes(tenant_id),
        keys.tenant_held_counts(tenant_id),
        keys.tenant_holders(tenant_id),
        keys.tenant_holdings_counted(tenant_id),
        keys.tenant_stored_bytes(tenant_id),
    )
    assert stored(records, tenant_id) == base + size
    assert client.http.delete(f"/v1/jobs/{job_id}").status_code == 204
    assert stored(records, tenant_id) == base
    # Over and over: the count grows with what the kept jobs hold, up to the quota.
    records.set_quota(tenant_id, "max_stored_bytes", base + 2 * size)
    round_trip(1)
    round_trip(2)
    assert stored(records, tenant_id) == base + 2 * size
    body = problem(client.add_dataset(dataset_bytes(3)), 429, "max_stored_bytes")
    assert "DELETE /v1/jobs" in body["detail"]


def test_the_same_bytes_count_once(api: InProcessApi) -> None:
    records, tenant_id, client = tenant(api, "same-bytes")
    data = dataset_bytes(0)
    first = created(client.add_dataset(data))
    second = created(client.add_dataset(data))
    assert first["id"] != second["id"] and first["sha256"] == second["sha256"]
    assert stored(records, tenant_id) == len(data)
    # Room for exactly those bytes: other bytes do not fit.
    records.set_quota(tenant_id, "max_stored_bytes", len(data))
    problem(client.add_dataset(dataset_bytes(1)), 429, "max_stored_bytes")
    assert client.http.delete(f"/v1/datasets/{first['id']}").status_code == 204
    assert stored(records, tenant_id) == len(data)
    # Another tenant's copy of the same bytes is its own.
    other_records, other_id, other = tenant(api, "same-bytes-other")
    created(other.add_dataset(data))
    assert stored(other_records, other_id) == len(data)


def test_open_uploads_reserve_their_bytes_until_they_end_or_expire(api: InProcessApi) -> None:
    records, tenant_id, client = tenant(api, "reserved")
    data = dataset_bytes(0)
    size = len(data)
    # Announced: the size counts from the start, and leaves when the upload is deleted.
    upload = created(client.http.post("/v1/uploads", json={"size_bytes": size}))
    assert stored(records, tenant_id) == size
    assert client.http.delete(f"/v1/uploads/{upload['id']}").status_code == 204
    assert stored(records, tenant_id) == 0
    # Completed: the dataset holds the bytes in place of the reservation (counted once).
    upload = created(client.http.post("/v1/uploads", json={"size_bytes": size}))
    part = client.http.put(f"/v1/uploads/{upload['id']}/parts/1", content=data)
    assert part.status_code == 200, part.text
    dataset = created(client.http.post(f"/v1/uploads/{upload['id']}:complete", json={}))
    assert stored(records, tenant_id) == size
    assert client.http.delete(f"/v1/datasets/{dataset['id']}").status_code == 204
    assert stored(records, tenant_id) == 0
    # Not announced: each part counts as it lands, within the quota.
    records.set_quota(tenant_id, "max_stored_bytes", size + size // 2)
    upload = created(client.http.post("/v1/uploads", json={}))
    half = size // 2
    part = client.http.put(f"/v1/uploads/{upload['id']}/parts/1", content=data[:half])
    assert part.status_code == 200, part.text
    assert stored(records, tenant_id) == half
    problem(client.http.post("/v1/uploads", json={"size_bytes": size + 1}), 429, "max_stored_bytes")
    part = client.http.put(f"/v1/uploads/{upload['id']}/parts/2", content=data[half:])
    assert part.status_code == 200, part.text
    assert stored(records, tenant_id) == size
    # An upload nobody ends stops counting when it expires, without a sweep.
    records.client.zadd(keys.tenant_uploads(tenant_id), {upload["id"]: time.time() - 1})
    assert stored(records, tenant_id) == 0
    assert records.quota_usage(tenant_id)["max_open_uploads"] == 0
    created(client.http.post("/v1/uploads", json={"size_bytes": size}))


def test_jobs_that_register_a_model_are_refused_over_the_stored_bytes_quota(
    api: InProcessApi,
) -> None:
    records, tenant_id, client = tenant(api, "no-room")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(dataset_bytes(0)))
    used = stored(records, tenant_id)
    records.set_quota(tenant_id, "max_stored_bytes", used)  # full: no room for a new model
    for kind in ("adapt", "train"):
        body = {"kind": kind, "model_id": model["id"], "dataset_id": dataset["id"]}
        answer = problem(client.submit(body), 429, "max_stored_bytes", "BNADAPT_TENANT_")
        assert int(client.submit(body).headers["retry-after"]) >= 1, answer
    body = {"kind": "evaluate", "model_id": model["id"], "dataset_id": dataset["id"]}
    created(client.submit(body), 202)
    # With room for one model, the adapt job is taken.
    records.set_quota(tenant_id, "max_stored_bytes", used + model["size_bytes"])
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    created(client.submit(body), 202)


@pytest.mark.slow
def test_an_import_takes_an_open_upload_slot_until_it_ends(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an S3 store (SeaweedFS): an import counts against max_open_uploads while it runs,
    and gives its slot back when it ends, registered or refused."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    store_bucket, source_bucket = s3_server.new_bucket(), s3_server.new_bucket()
    data = dataset_bytes(0)
    s3_server.client().put_object(Bucket=source_bucket, Key="mine/d.npz", Body=data)
    with running_api(
        tmp_path, store_url=f"s3://{store_bucket}/store/", tenant_rate_per_s=0
    ) as s3_api:
        records, tenant_id, client = tenant(s3_api, "importer")
        records.allow_import(tenant_id, f"s3://{source_bucket}/mine")
        records.set_quota(tenant_id, "max_open_uploads", 1)
        source = {"source": f"s3://{source_bucket}/mine/d.npz"}
        upload = created(client.http.post("/v1/uploads", json={}))
        problem(client.http.post("/v1/datasets:import", json=source), 429, "max_open_uploads")
        assert client.http.delete(f"/v1/uploads/{upload['id']}").status_code == 204
        dataset = created(client.http.post("/v1/datasets:import", json=source))
        assert records.quota_usage(tenant_id)["max_open_uploads"] == 0
        assert stored(records, tenant_id) == dataset["size_bytes"] == len(data)
        missing = {"source": f"s3://{source_bucket}/mine/none.npz"}
        assert client.http.post("/v1/datasets:import", json=missing).status_code == 404
        assert records.quota_usage(tenant_id)["max_open_uploads"] == 0
        created(client.http.post("/v1/uploads", json={}))


@pytest.mark.slow
def test_a_model_a_job_registered_counts_and_its_input_stays_counted_while_the_job_is_kept(
    shared_stack: Stack,
) -> None:
    """On the whole stack (a real worker runs the job)."""
    client = shared_stack.client("job-outputs")
    records = shared_stack.records()
    tenant_id = records.find_tenant("job-outputs")
    assert tenant_id is not None
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(dataset_bytes(0)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    job = client.wait(str(created(client.submit(body), 202)["id"]))
    assert job["status"] == "succeeded", job
    adapted = created(client.http.get(f"/v1/models/{job['result']['model_id']}"), 200)
    assert adapted["sha256"] != model["sha256"]
    inputs = model["size_bytes"] + dataset["size_bytes"]
    assert stored(records, tenant_id) == inputs + adapted["size_bytes"]
    # The input model deleted: the job still holds its weights.
    assert client.http.delete(f"/v1/models/{model['id']}").status_code == 204
    assert stored(records, tenant_id) == inputs + adapted["size_bytes"]
    assert client.http.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert stored(records, tenant_id) == dataset["size_bytes"] + adapted["size_bytes"]
