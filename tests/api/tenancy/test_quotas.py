"""Quotas per tenant (NOTE [ Tenant quotas ] in service/records/tenancy/quotas.py), on an API in
this process whose settings make every quota small: active jobs, stored bytes, open uploads, event
streams and the request rate, each answered 429 with Retry-After and a problem body naming the
limit; a tenant's own values (``bnadapt tenants set-quota``); counts that hold under racing
requests; and one token bucket shared by two API processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from harness.answers import created, problem
from harness.digits import digits, digits_npz
from harness.inprocess import InProcessApi, running_api
from harness.servers import stop_process, wait_for
from harness.stack import REPO, Client, npz_bytes
from service.client import ApiClientError
from service.client import Client as ApiClient
from service.errors import QuotaExceededError
from service.local.cli import main as cli_main
from service.local.embedded import free_port
from service.local.up import api_command
from service.records import keys
from service.records.aio import async_redis_client
from service.records.connection import redis_client
from service.records.sync import Records
from service.records.tenancy.quotas import AsyncTenantQuotas, parse_quota_value

MAX_ACTIVE_JOBS = 2
MAX_OPEN_UPLOADS = 2
MAX_STREAMS = 2
# Room for a few small datasets of digits_npz(n=32) (about 19 KiB each).
MAX_STORED_BYTES = 100_000


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    """The API with small quotas; no request rate limit unless a tenant is given one."""
    with running_api(
        tmp_path_factory.mktemp("quotas"),
        tenant_max_active_jobs=MAX_ACTIVE_JOBS,
        tenant_max_stored_bytes=MAX_STORED_BYTES,
        tenant_max_open_uploads=MAX_OPEN_UPLOADS,
        tenant_max_streams=MAX_STREAMS,
        tenant_rate_per_s=0,
    ) as running:
        yield running


def refused(response: httpx.Response, quota: str, *phrases: str) -> dict[str, Any]:
    """A 429 naming the quota, its setting and the phrases, with a Retry-After."""
    setting = f"BNADAPT_TENANT_{quota.upper()}"
    body = problem(response, 429, quota, setting, *phrases)
    assert int(response.headers["retry-after"]) >= 1
    return body


def set_quota(api: InProcessApi, tenant: str, name: str, value: str) -> None:
    """As an operator does: ``bnadapt tenants set-quota``, straight to Redis."""
    code = cli_main(["tenants", "set-quota", tenant, name, value, "--redis-url", api.redis.url])
    assert code == 0


def job_body(client: Client) -> dict[str, Any]:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=32)))
    return {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}


def test_active_jobs_are_bounded_and_free_again_when_one_ends(small: InProcessApi) -> None:
    client = small.client("active-jobs")
    body = job_body(client)
    jobs = [created(client.submit(body), 202) for _ in range(MAX_ACTIVE_JOBS)]
    refused(client.submit(body), "max_active_jobs", f"at most {MAX_ACTIVE_JOBS}", "cancel")
    assert len(client.http.get("/v1/jobs").json()["items"]) == MAX_ACTIVE_JOBS
    # Another tenant has quotas of its own.
    other = small.client("active-jobs-other")
    created(other.submit(job_body(other)), 202)
    # A job that ended stops counting.
    created(client.http.post(f"/v1/jobs/{jobs[0]['id']}:cancel"), 202)
    created(client.submit(body), 202)
    refused(client.submit(body), "max_active_jobs")
    # The tenant's own value wins over the setting; 0 means no limit.
    set_quota(small, "active-jobs", "max_active_jobs", "3")
    created(client.submit(body), 202)
    refused(client.submit(body), "max_active_jobs", "at most 3")
    set_quota(small, "active-jobs", "max_active_jobs", "0")
    created(client.submit(body), 202)
    set_quota(small, "active-jobs", "max_active_jobs", "default")
    refused(client.submit(body), "max_active_jobs", f"at most {MAX_ACTIVE_JOBS}")


def test_racing_submissions_never_pass_the_active_jobs_quota(small: InProcessApi) -> None:
    client = small.client("racing-jobs")
    body = job_body(client)
    statuses: list[int] = []
    start = threading.Barrier(8)

    def submit() -> None:
        own = Client(small.url, client.http.headers["authorization"].split(" ", 1)[1])
        start.wait()
        statuses.append(own.submit(body).status_code)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [202] * MAX_ACTIVE_JOBS + [429] * (8 - MAX_ACTIVE_JOBS)
    queued = client.http.get("/v1/jobs", params={"status": "queued"}).json()["items"]
    assert len(queued) == MAX_ACTIVE_JOBS


def distinct_npz(i: int) -> bytes:
    """A dataset of digits_npz(n=32)'s size whose bytes differ for each ``i``."""
    x, y = digits(n=32)
    return npz_bytes(x=x + np.float32(i + 1) * np.float32(1e-3), y=y)


def test_stored_bytes_count_models_and_datasets_until_deleted(small: InProcessApi) -> None:
    client = small.client("stored-bytes")
    size = len(distinct_npz(0))
    count = MAX_STORED_BYTES // size
    kept = [created(client.add_dataset(distinct_npz(i))) for i in range(count)]
    refused(client.add_dataset(distinct_npz(count)), "max_stored_bytes", str(MAX_STORED_BYTES))
    # A resumable or direct upload announcing its size is refused before any byte is sent.
    refused(client.http.post("/v1/uploads", json={"size_bytes": size}), "max_stored_bytes")
    assert client.http.delete(f"/v1/datasets/{kept[0]['id']}").status_code == 204
    created(client.add_dataset(distinct_npz(count)))
    # Models count too: with no room left, one is refused.
    set_quota(small, "stored-bytes", "max_stored_bytes", str(len(kept) * size))
    refused(client.add_model("digits_cnn", {"width": 4}), "max_stored_bytes")
    set_quota(small, "stored-bytes", "max_stored_bytes", str(10 * MAX_STORED_BYTES))
    model = created(client.add_model("digits_cnn", {"width": 4}))
    assert model["size_bytes"] > 0


def test_resources_from_before_quotas_are_counted_at_first_use(small: InProcessApi) -> None:
    """A deployment upgraded to quotas has no count for its tenants: the first read or change
    counts their models and datasets from the records (before, the count started at zero and
    a deletion drove it below)."""
    client = small.client("before-quotas")
    size = len(distinct_npz(0))
    old = [created(client.add_dataset(distinct_npz(i))) for i in range(3)]
    records = Records(redis_client(small.redis.url))
    tenant = records.find_tenant("before-quotas")
    assert tenant is not None
    forget_holdings(records, tenant)  # as before quotas
    assert records.quota_usage(tenant)["max_stored_bytes"] == 3 * size
    # With room for one more only, the old three count: the fifth is refused.
    set_quota(small, "before-quotas", "max_stored_bytes", str(4 * size))
    created(client.add_dataset(distinct_npz(3)))
    refused(client.add_dataset(distinct_npz(4)), "max_stored_bytes")
    # Deleting an old one frees its bytes, and only its bytes.
    forget_holdings(records, tenant)
    assert client.http.delete(f"/v1/datasets/{old[0]['id']}").status_code == 204
    assert records.quota_usage(tenant)["max_stored_bytes"] == 3 * size
    created(client.add_dataset(distinct_npz(4)))


def forget_holdings(records: Records, tenant: str) -> None:
    """The tenant as a release before holdings were counted left it: its old counter only."""
    records.client.delete(
        keys.tenant_held_sizes(tenant),
        keys.tenant_held_counts(tenant),
        keys.tenant_holders(tenant),
        keys.tenant_holdings_counted(tenant),
    )
    records.client.set(keys.tenant_stored_bytes(tenant), 12345)  # a stale count


def test_open_uploads_are_bounded_until_completed_or_deleted(small: InProcessApi) -> None:
    client = small.client("uploads")
    opened = [created(client.http.post("/v1/uploads", json={})) for _ in range(MAX_OPEN_UPLOADS)]
    refused(client.http.post("/v1/uploads", json={}), "max_open_uploads", "delete")
    assert client.http.delete(f"/v1/uploads/{opened[0]['id']}").status_code == 204
    last = created(client.http.post("/v1/uploads", json={}))
    refused(client.http.post("/v1/uploads", json={}), "max_open_uploads")
    # Completing one ends it.
    part = client.http.put(f"/v1/uploads/{last['id']}/parts/1", content=digits_npz(n=32))
    assert part.status_code == 200, part.text
    created(client.http.post(f"/v1/uploads/{last['id']}:complete", json={}))
    created(client.http.post("/v1/uploads", json={}))


def test_event_streams_are_bounded_and_released_when_the_client_leaves(
    small: InProcessApi,
) -> None:
    client = small.client("streams")
    set_quota(small, "streams", "max_active_jobs", "0")
    body = job_body(client)
    job = created(client.submit(body), 202)  # stays queued: no worker here
    path = f"/v1/jobs/{job['id']}/events"
    streams = []
    for _ in range(MAX_STREAMS):
        stream = httpx.Client(base_url=small.url, headers=dict(client.http.headers), timeout=10)
        response = stream.send(stream.build_request("GET", path), stream=True)
        assert response.status_code == 200
        # Keep the line iterator: dropping it half-read would close the connection.
        lines = response.iter_lines()
        assert next(lines).startswith("event: status")
        streams.append((stream, response, lines))
    refused(client.http.get(path), "max_streams", f"at most {MAX_STREAMS}", "close")
    # One client goes away: its stream's lease is given back.
    stream, response, _ = streams.pop()
    response.close()
    stream.close()

    def one_more() -> bool:
        with (
            httpx.Client(base_url=small.url, headers=dict(client.http.headers)) as again,
            again.stream("GET", path) as opened,
        ):
            return opened.status_code == 200

    wait_for(one_more, timeout_s=30, what="the closed stream's lease to be released")
    for stream, response, _ in streams:
        response.close()
        stream.close()


def test_a_stream_lease_of_a_dead_api_expires(small: InProcessApi) -> None:
    """An API process that dies holding streams never gives their leases back: they expire."""

    async def scenario() -> None:
        quotas = AsyncTenantQuotas(async_redis_client(small.redis.url))
        for lease in ("a", "b"):
            await quotas.open_stream("tenant-of-a-dead-api", lease, 2, lease_s=0.5)
        with pytest.raises(QuotaExceededError) as refused_now:
            await quotas.open_stream("tenant-of-a-dead-api", "c", 2, lease_s=0.5)
        assert "max_streams" in str(refused_now.value)
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                await quotas.open_stream("tenant-of-a-dead-api", "c", 2, lease_s=0.5)
                break
            except QuotaExceededError:
                assert asyncio.get_running_loop().time() < deadline, "leases never expired"
                await asyncio.sleep(0.1)
        await quotas.client.aclose()

    asyncio.run(scenario())


@pytest.fixture
def second_api(small: InProcessApi, tmp_path: Path) -> Iterator[str]:
    """Another API process over the same Redis: what a deployment with several runs."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "BNADAPT_REDIS_URL": small.redis.url,
        "BNADAPT_DATA_DIR": str(small.settings.data_dir),
        "BNADAPT_TENANT_RATE_PER_S": "0",
    }
    process = subprocess.Popen(api_command("127.0.0.1", port), env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout_s=60, what="the second API to answer /healthz")
        yield url
    finally:
        stop_process(process)


def test_the_request_rate_is_one_bucket_for_every_api_process(
    small: InProcessApi, second_api: str
) -> None:
    client = small.client("rate")
    key = client.http.headers["authorization"].split(" ", 1)[1]
    here, there = client, Client(second_api, key)
    # A burst of 4, refilled at one request per 1000 s: nothing refills during the test.
    set_quota(small, "rate", "rate_per_s", "0.001")
    set_quota(small, "rate", "rate_burst", "4")
    for api in (here, there, here, there):
        assert api.http.get("/v1/jobs").status_code == 200
    for api in (here, there):
        body = refused(api.http.get("/v1/jobs"), "rate_per_s", "requests per second")
        assert "0.001" in body["detail"]
        retry_after = int(api.http.get("/v1/models").headers["retry-after"])
        assert retry_after > 100  # a token comes back in ~1000 s, not at once
    # A status poll (its own lookup of key and job) is limited as well; others are not.
    assert here.http.get("/v1/jobs/job_missing").status_code == 429
    other = small.client("rate-other")
    assert (
        Client(second_api, other.http.headers["authorization"].split(" ", 1)[1])
        .http.get("/v1/jobs")
        .status_code
        == 200
    )
    # Anonymous routes are not a tenant's.
    assert here.http.get("/healthz").status_code == 200


def test_an_upload_waits_out_its_tenants_request_rate(small: InProcessApi, tmp_path: Path) -> None:
    """The client's resumable upload sends a request refused by the tenant's request rate
    again after its Retry-After; the other quotas' 429s it answers as errors at once."""
    client = small.client("paced")
    set_quota(small, "paced", "rate_per_s", "2")
    set_quota(small, "paced", "rate_burst", "2")
    path = tmp_path / "digits.npz"
    path.write_bytes(digits_npz(n=32))
    # One request to create, 5 parts, one to complete: 7 requests through a bucket of 2.
    dataset = client.api.upload_dataset(path, part_bytes=path.stat().st_size // 4)
    assert dataset.size_bytes == path.stat().st_size
    # A 429 that waiting does not cure (open uploads) is an error at once, not 5 waits.
    set_quota(small, "paced", "rate_per_s", "0")
    set_quota(small, "paced", "max_open_uploads", "1")
    opened = client.http.post("/v1/uploads", json={"size_bytes": 10})
    assert opened.status_code == 201, opened.text
    with pytest.raises(ApiClientError) as refusal:
        client.api.upload_dataset(path)
    assert refusal.value.status == 429
    assert "max_open_uploads" in refusal.value.detail


def test_the_clients_calls_wait_out_the_request_rate(small: InProcessApi) -> None:
    """Every resource call of the Python client sends a request refused by the tenant's
    request rate again after its Retry-After (a submission included: it was refused before
    anything was done, so it is done once); with ``rate_retries=0`` the 429 is the error."""
    client = small.client("paced-calls")
    body = job_body(client)
    set_quota(small, "paced-calls", "rate_per_s", "2")
    set_quota(small, "paced-calls", "rate_burst", "2")
    api = client.api
    job = api.submit("adapt", body["model_id"], body["dataset_id"])
    # Six calls through a bucket of 2 that refills 2 a second: some wait, none fails.
    for _ in range(3):
        assert api.job(job.id).id == job.id
        assert any(item.id == job.id for item in api.jobs().items)
    assert [item.id for item in api.jobs(page_size=100).items].count(job.id) == 1
    key = client.http.headers["Authorization"].removeprefix("Bearer ")
    impatient = ApiClient(small.url, key, rate_retries=0)

    def reads() -> None:
        for _ in range(4):  # past the bucket of 2 within a second
            impatient.job(job.id)

    with pytest.raises(ApiClientError) as refusal:
        reads()
    assert refusal.value.status == 429
    assert "rate_per_s" in refusal.value.detail
    with pytest.raises(ValueError, match="rate_retries"):
        ApiClient(small.url, "bna_x", rate_retries=-1)


def test_the_clients_streams_wait_out_the_request_rate_and_name_their_errors(
    small: InProcessApi, tmp_path: Path
) -> None:
    """A job's event stream and a weights download wait out the tenant's request rate like
    the other calls, and a streamed call refused for another reason raises ApiClientError
    with the API's own message (not httpx's complaint about an unread body)."""
    client = small.client("paced-streams")
    body = job_body(client)
    api = client.api
    job = api.submit("adapt", body["model_id"], body["dataset_id"])
    assert api.cancel(job.id).status.value == "canceled"
    set_quota(small, "paced-streams", "rate_per_s", "1")
    set_quota(small, "paced-streams", "rate_burst", "1")

    def spent() -> None:  # the bucket empty: the next request is refused for the rate
        while client.http.get(f"/v1/jobs/{job.id}").status_code != 429:
            pass

    spent()
    assert [name for name, _ in api.events(job.id)][-1] == "end"
    spent()
    path = api.download_weights(body["model_id"], tmp_path / "w.safetensors")
    assert path.stat().st_size > 0
    set_quota(small, "paced-streams", "rate_per_s", "default")
    set_quota(small, "paced-streams", "rate_burst", "default")
    with pytest.raises(ApiClientError) as missing:
        list(api.events("job_" + "A" * 22))
    assert missing.value.status == 404
    assert "job_" + "A" * 22 in missing.value.detail
    with pytest.raises(ApiClientError) as no_model:
        api.download_weights("mdl_" + "A" * 22, tmp_path / "none.safetensors")
    assert no_model.value.status == 404
    assert not (tmp_path / "none.safetensors.part").exists()


def test_the_cli_sets_and_shows_a_tenants_quotas(
    small: InProcessApi, capsys: pytest.CaptureFixture[str]
) -> None:
    client = small.client("cli-quotas")
    created(client.add_dataset(digits_npz(n=32)))
    set_quota(small, "cli-quotas", "max_streams", "7")
    assert cli_main(["tenants", "quotas", "cli-quotas", "--redis-url", small.redis.url]) == 0
    shown = capsys.readouterr().out
    streams = next(line for line in shown.splitlines() if line.startswith("max_streams"))
    assert streams.split()[1] == "7" and streams.split()[-1] == "tenant"
    stored = next(line for line in shown.splitlines() if line.startswith("max_stored_bytes"))
    assert stored.split()[2] == str(len(digits_npz(n=32)))
    assert stored.split()[-1] == "BNADAPT_TENANT_MAX_STORED_BYTES"
    # Mistakes say what is accepted.
    assert cli_main(["tenants", "set-quota", "cli-quotas", "max_jobs", "1"]) == 1
    assert "max_active_jobs" in capsys.readouterr().err
    assert (
        cli_main(
            [
                "tenants",
                "set-quota",
                "nobody-here",
                "max_streams",
                "1",
                "--redis-url",
                small.redis.url,
            ]
        )
        == 1
    )
    assert "no tenant" in capsys.readouterr().err
    with pytest.raises(ValueError, match="whole number"):
        parse_quota_value("max_streams", "1.5")
    assert parse_quota_value("rate_per_s", "0.5") == 0.5


@pytest.mark.slow
def test_direct_uploads_to_s3_count_as_open_uploads(s3_bucket: str, tmp_path: Path) -> None:
    """Direct uploads (an S3 store: SeaweedFS) and resumable ones share the open-uploads
    quota; completing a direct upload ends it, and its bytes count as stored."""
    with running_api(
        tmp_path,
        store_url=f"s3://{s3_bucket}/quotas",
        tenant_max_open_uploads=1,
        tenant_rate_per_s=0,
    ) as api:
        client = api.client("direct-uploads")
        content = digits_npz(n=64)
        announce = {"direct": True, "size": len(content)}
        started = created(client.http.post("/v1/direct-uploads", json=announce))
        records = api.records()
        tenant = records.find_tenant("direct-uploads")
        assert tenant is not None
        # Its declared size is reserved from the start (NOTE [ Tenant quotas ]).
        assert records.quota_usage(tenant)["max_stored_bytes"] == len(content)
        refused(client.http.post("/v1/direct-uploads", json=announce), "max_open_uploads")
        refused(client.http.post("/v1/uploads", json={}), "max_open_uploads")
        etags = []
        part = started["part_bytes"]
        for number, url in enumerate(started["part_urls"]):
            put = httpx.put(url, content=content[number * part : (number + 1) * part])
            assert put.status_code == 200, put.text
            etags.append(put.headers["etag"])
        created(client.http.post(started["complete_url"], json={"etags": etags}))
        # The dataset holds the bytes in place of the reservation: counted once.
        assert records.quota_usage(tenant)["max_stored_bytes"] == len(content)
        created(client.http.post("/v1/uploads", json={}))
        # No room left for the bytes a direct upload announces: refused before it starts.
        set_quota(api, "direct-uploads", "max_open_uploads", "0")
        set_quota(api, "direct-uploads", "max_stored_bytes", str(len(content) + 1))
        refused(client.http.post("/v1/direct-uploads", json=announce), "max_stored_bytes")
        # One that fits reserves its size: the next, though within the quota alone, does not.
        set_quota(api, "direct-uploads", "max_stored_bytes", str(2 * len(content) + 1))
        created(client.http.post("/v1/direct-uploads", json=announce))
        refused(client.http.post("/v1/direct-uploads", json=announce), "max_stored_bytes")
