"""Many machines, no shared filesystem: the API and two workers, each with a data directory of
its own, share only a Redis-compatible server and an S3 bucket (SeaweedFS, started on free
ports). Train, adapt, a sharded adapt, evaluate, cancel, a CUDA job that waits for a CUDA
worker, a machine lost mid-job, and a running job's dataset kept in a cache two workers share."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from rq import Queue

from harness.answers import created
from harness.digits import digits_npz
from harness.servers import S3Server, wait_for
from harness.stack import Client, Stack, job_payload, running_stack
from service.records import keys
from service.records.format import text
from service.records.tenancy.turns import turn_queue_name
from tests.e2e.test_e2e import long_train

pytestmark = pytest.mark.slow

PREFIX = "deploy"


@dataclass
class S3Stack:
    stack: Stack
    server: S3Server
    bucket: str

    def keys(self) -> list[str]:
        pages = self.server.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return sorted(e["Key"] for page in pages for e in page.get("Contents", ()))


@pytest.fixture(scope="module")
def s3_stack(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Stack]:
    bucket = s3_server.new_bucket()
    env = {
        **s3_server.env,
        "BNADAPT_STORE_URL": f"s3://{bucket}/{PREFIX}",
        "BNADAPT_WORKER_THREADS": "1",
    }
    root = tmp_path_factory.mktemp("machines")
    with running_stack(root, env, workers=2, separate_machines=True) as stack:
        yield S3Stack(stack, s3_server, bucket)


def job(kind: str, model: dict[str, Any], dataset: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {"kind": kind, "model_id": model["id"], "dataset_id": dataset["id"], "params": params}


def succeeded(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    submitted = created(client.submit(body), 202)
    done = client.wait(submitted["id"], timeout_s=300)
    assert done["status"] == "succeeded", done
    return done


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def test_jobs_on_machines_that_share_only_redis_and_a_bucket(s3_stack: S3Stack) -> None:
    stack = s3_stack.stack
    client = stack.client("machines")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=1))
    dataset = created(client.add_dataset(digits_npz(shifted=True)))
    trained = succeeded(client, job("train", model, dataset, epochs=1, batch_size=64))
    trained_model = {"id": trained["result"]["model_id"]}
    adapted = succeeded(client, job("adapt", trained_model, dataset, batch_size=100))
    sharded = succeeded(client, job("adapt", trained_model, dataset, batch_size=100, shards=3))
    evaluated = succeeded(client, job("evaluate", {"id": adapted["result"]["model_id"]}, dataset))
    report = client.http.get(evaluated["result"]["report_url"]).json()
    assert report["kind"] == "evaluate"

    # Weights come straight from the bucket: a redirect to a presigned URL.
    new_model = client.http.get(f"/v1/models/{sharded['result']['model_id']}").json()
    direct = client.http.get(sharded["result"]["weights_url"])
    assert direct.status_code == 307
    assert direct.headers["location"].startswith(s3_stack.server.endpoint_url)
    weights = client.http.get(sharded["result"]["weights_url"], follow_redirects=True)
    assert hashlib.sha256(weights.content).hexdigest() == new_model["sha256"]

    # The bucket holds only content-addressed objects; no machine keeps a store of its own.
    objects = s3_stack.keys()
    assert objects, "nothing in the bucket"
    assert all(key.startswith(f"{PREFIX}/objects/") for key in objects), objects
    for sha256 in (new_model["sha256"], dataset["sha256"]):
        assert f"{PREFIX}/objects/{sha256}" in objects
    machines = [stack.data_dir, *(stack.worker_data_dirs or [])]
    for machine in machines:
        # worker.log: what the test harness kept of the workers' output, not the service's.
        stored = {
            f
            for f in files_under(machine)
            if not f.startswith("cache/objects/") and f != "worker.log"
        }
        assert not stored, (machine, stored)
    # Each worker that ran a job has the dataset in its cache, checked by name.
    cached = [m for m in machines[1:] if (m / "cache" / "objects" / dataset["sha256"]).is_file()]
    assert cached


def test_cancel_and_a_cuda_job_waits_for_a_cuda_worker(s3_stack: S3Stack) -> None:
    stack = s3_stack.stack
    client = stack.client("devices")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=200)))
    cuda = created(client.submit(job("adapt", model, dataset, device="cuda:0")), 202)
    assert cuda["progress"]["phase"] == "waiting for a cuda worker"
    # Its tenant's queue among the CUDA jobs (NOTE [ Fair turns ] in
    # service/records/tenancy/turns.py).
    tenant = job_payload(stack, cuda["id"]).tenant_id
    cuda_queue = Queue(
        turn_queue_name("bnadapt-cuda", tenant, 0),
        connection=stack.records().client,
        serializer="json",
    )
    assert cuda_queue.job_ids == [cuda["id"]]
    # CPU workers serve CPU and `auto` jobs meanwhile, and leave the CUDA job alone.
    succeeded(client, job("adapt", model, dataset, device="cpu"))
    succeeded(client, job("adapt", model, dataset))
    waiting = client.http.get(f"/v1/jobs/{cuda['id']}").json()
    assert waiting["status"] == "queued"
    assert waiting["progress"]["phase"] == "waiting for a cuda worker"
    canceled = created(client.http.post(f"/v1/jobs/{cuda['id']}:cancel"), 202)
    assert canceled["status"] == "canceled"
    assert cuda_queue.job_ids == []

    running = created(client.submit(long_train(client)), 202)
    wait_for(
        lambda: client.http.get(f"/v1/jobs/{running['id']}").json()["status"] == "running",
        timeout_s=120,
        what="the long job to start",
    )
    created(client.http.post(f"/v1/jobs/{running['id']}:cancel"), 202)
    assert client.wait(running["id"], timeout_s=60)["status"] == "canceled"


def test_a_machine_lost_mid_job(s3_stack: S3Stack) -> None:
    stack = s3_stack.stack
    client = stack.client("lost")
    body = {**long_train(client), "max_attempts": 2}
    body["params"] = {"epochs": 3, "batch_size": 16}
    lost = created(client.submit(body), 202)

    def worker_name() -> str | None:
        name = stack.records().client.hget(keys.record("job", lost["id"]), "worker")
        return None if name is None else name.decode()

    name = wait_for(worker_name, timeout_s=120, what="the job to start")
    # `host:pid` of the job's process (RQ gives it a session of its own); its parent, the RQ
    # worker, is in the process group of its machine's supervisor.
    horse = int(name.rsplit(":", 1)[1])
    parent = int(Path(f"/proc/{horse}/stat").read_text().rsplit(")", 1)[1].split()[1])
    group = os.getpgid(parent)
    os.killpg(group, signal.SIGKILL)  # supervisor, RQ worker, inspector ...
    os.kill(horse, signal.SIGKILL)  # ... and the job: the whole machine at once
    supervisors = [p for p in [stack.worker, *stack.more_workers] if p is not None]
    victim = next(p for p in supervisors if p.pid == group)
    victim.wait()
    # The lost attempt is noticed by its missing heartbeat and the job runs again on the other
    # machine, which reads its inputs from the bucket.
    done = client.wait(lost["id"], timeout_s=300)
    assert done["status"] == "succeeded", done
    assert len(done["attempts"]) == 1
    assert "heartbeat" in done["attempts"][0]["reason"]
    # The other machine goes on serving.
    quick = {**body, "params": {"epochs": 1, "batch_size": 512}}
    succeeded(client, quick)


def test_direct_upload_and_import_bypass_the_api(s3_stack: S3Stack) -> None:
    stack = s3_stack.stack
    client = stack.client("direct")
    content = digits_npz(shifted=True)  # ~0.5 MiB: one part
    sha256 = hashlib.sha256(content).hexdigest()
    started = created(
        client.http.post("/v1/direct-uploads", json={"direct": True, "size": len(content)})
    )
    part = started["part_bytes"]
    etags = []
    for number, url in enumerate(started["part_urls"]):
        put = httpx.put(url, content=content[number * part : (number + 1) * part])
        assert put.status_code == 200, put.text
        etags.append(put.headers["etag"])
    dataset = created(client.http.post(started["complete_url"], json={"etags": etags}))
    assert (dataset["sha256"], dataset["size_bytes"], dataset["num_samples"]) == (
        sha256,
        len(content),
        1797,
    )
    again = client.http.post(started["complete_url"], json={"etags": etags})
    assert again.status_code == 404

    # A file already in a bucket the operator allowed: registered by reference, copied
    # server-side.
    s3_stack.server.client().put_object(Bucket=s3_stack.bucket, Key="incoming/d.npz", Body=content)
    tenant_id = text(stack.records().client.get(keys.tenant_by_name("direct")))
    stack.records().allow_import(tenant_id, f"s3://{s3_stack.bucket}/incoming/")
    imported = created(
        client.http.post(
            "/v1/datasets:import", json={"source": f"s3://{s3_stack.bucket}/incoming/d.npz"}
        )
    )
    assert (imported["sha256"], imported["name"]) == (sha256, "d.npz")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    succeeded(client, job("adapt", model, imported, batch_size=200))
    missing = client.http.post(
        "/v1/datasets:import", json={"source": f"s3://{s3_stack.bucket}/incoming/none.npz"}
    )
    assert missing.status_code == 404

    # A folder of images (a class a folder), registered without a tar and adapted on by a job.
    for number in range(6):
        pixels = np.random.default_rng(number).integers(0, 256, size=(8, 8), dtype=np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        key = f"incoming/digits/{number % 2}/{number}.png"
        s3_stack.server.client().put_object(Bucket=s3_stack.bucket, Key=key, Body=png.getvalue())
    folder = created(
        client.http.post(
            "/v1/datasets:import",
            json={
                "source": f"s3://{s3_stack.bucket}/incoming/digits/",
                "preprocessing": {"channels": "gray"},
            },
        )
    )
    assert (folder["format"], folder["sample_shape"], folder["num_classes"]) == (
        "tar",
        [1, 8, 8],
        2,
    )
    succeeded(client, job("adapt", model, folder, batch_size=3))

    # Announced size and sent bytes differ: the part URL, which signs its length, is refused
    # by the bucket, and nothing is registered (NOTE [ Direct upload parts ]).
    announced = {"direct": True, "size": len(content) + 1}
    short = created(client.http.post("/v1/direct-uploads", json=announced))
    put = httpx.put(short["part_urls"][0], content=content)
    assert put.status_code == 403, put.text
    bad = client.http.post(short["complete_url"], json={"etags": ['"0"']})
    assert bad.status_code == 422
    assert "never reached the bucket" in bad.json()["detail"]


def test_another_jobs_download_leaves_a_running_jobs_dataset(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Two workers on one machine share its cache, which holds nothing beyond what is in use
    (``BNADAPT_CACHE_MAX_BYTES=1``). A long job reads its dataset; its copy is aged past the
    10 minutes that "used lately" protects, as after an hour's run; a second job's download on
    the same machine then evicts every old copy but the one the running job pins (NOTE
    [ Pinned copies ] in service/store/cache.py)."""
    bucket = s3_server.new_bucket()
    env = {
        **s3_server.env,
        "BNADAPT_STORE_URL": f"s3://{bucket}/{PREFIX}",
        "BNADAPT_WORKER_THREADS": "1",
        "BNADAPT_CACHE_MAX_BYTES": "1",
    }
    with running_stack(tmp_path, env, workers=2) as stack:
        client = stack.client("pins")
        copies = stack.data_dir / "cache" / "objects"
        model = created(client.add_model("digits_cnn", {"width": 8}, seed=1))
        dataset = created(client.add_dataset(digits_npz()))
        other = created(client.add_dataset(digits_npz(shifted=True)))
        unused = created(client.add_dataset(digits_npz(n=300)))
        (copies / other["sha256"]).unlink()  # the second job downloads it
        long = created(client.submit(job("train", model, dataset, epochs=500, batch_size=16)), 202)

        def trained_a_batch() -> bool:
            progress = client.http.get(f"/v1/jobs/{long['id']}").json().get("progress") or {}
            return bool(progress.get("done"))

        wait_for(trained_a_batch, timeout_s=180, what="the long job to read its dataset")
        an_hour_ago = time.time() - 3600
        for copy in copies.iterdir():
            os.utime(copy, (an_hour_ago, an_hour_ago))
        succeeded(client, job("evaluate", model, other))
        assert not (copies / unused["sha256"]).exists()  # the download did evict
        assert (copies / dataset["sha256"]).exists(), "the running job's dataset was evicted"
        assert client.http.get(f"/v1/jobs/{long['id']}").json()["status"] == "running"
        canceled = client.http.post(f"/v1/jobs/{long['id']}:cancel")
        assert canceled.status_code in (200, 202), canceled.text
        assert client.wait(long["id"], timeout_s=120)["status"] == "canceled"
