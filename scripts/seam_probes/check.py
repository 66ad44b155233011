"""A probe's change at work (scripts/seam_probes/*.sh run it in their scratch worktree): the API
in process over a real Redis-compatible server (harness/inprocess.py), and, where a job must
run, a real RQ worker in this process taking it from the queue.

    python scripts/seam_probes/check.py kind|estimator|resource
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
from rq import SimpleWorker

from harness.inprocess import InProcessApi, running_api
from harness.stack import Client, npz_bytes
from service.records.connection import redis_client
from service.settings import get_settings
from workers.models.architectures import build_model
from workers.processes.rq_worker import TurnQueue


def model_and_data(client: Client) -> tuple[str, str]:
    state = {k: v.contiguous() for k, v in build_model("digits_cnn", {}).state_dict().items()}
    model = client.add_model("digits_cnn", {}, safetensors.torch.save(state)).json()
    x = np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32)
    return model["id"], client.add_dataset(npz_bytes(x=x)).json()["id"]


def run_queued(api: InProcessApi) -> None:
    """Runs every queued job with RQ's own worker, as `bnadapt worker` would (the job's process
    reads its settings from the environment)."""
    os.environ["BNADAPT_REDIS_URL"] = api.redis.url
    os.environ["BNADAPT_DATA_DIR"] = str(api.settings.data_dir)
    get_settings.cache_clear()
    connection = redis_client(api.redis.url)
    # The worker's own dequeue: jobs wait in their tenant's queue (NOTE [ Fair turns ]).
    queue = TurnQueue(api.settings.queue, connection=connection, serializer="json")
    SimpleWorker([queue], connection=connection, serializer="json", queue_class=TurnQueue).work(
        burst=True
    )


def submitted_and_run(api: InProcessApi, body: dict[str, Any]) -> tuple[Client, dict[str, Any]]:
    """The job ``body`` asks for, on a new model and dataset, once a worker ran it."""
    client = api.client("probe")
    model_id, dataset_id = model_and_data(client)
    response = client.submit({**body, "model_id": model_id, "dataset_id": dataset_id})
    print(
        "POST /v1/jobs:", response.status_code, "" if response.status_code == 202 else response.text
    )
    run_queued(api)
    job: dict[str, Any] = client.http.get(f"/v1/jobs/{response.json()['id']}").json()
    print("job:", job["status"], job.get("error") or "")
    return client, job


def check_kind(api: InProcessApi) -> None:
    document = api.anonymous().http.get("/openapi.json").json()
    print("OpenAPI lists ZeroBnJobCreate:", "ZeroBnJobCreate" in json.dumps(document))
    print(
        "job description names it:",
        "zero_bn" in document["paths"]["/v1/jobs"]["post"]["description"],
    )
    submitted_and_run(api, {"kind": "zero_bn"})


def check_estimator(api: InProcessApi) -> None:
    document = api.anonymous().http.get("/openapi.json").json()
    print("OpenAPI names ema_half:", "ema_half" in json.dumps(document))
    params = {"estimator": "ema_half", "batch_size": 8}
    client, job = submitted_and_run(api, {"kind": "adapt", "params": params})
    report = client.http.get(f"/v1/jobs/{job['id']}/report").json()
    print("report estimator:", report["estimator"], "batches:", report["batches"])


def check_resource(api: InProcessApi) -> None:
    alice, bob = api.client("alice"), api.client("bob")
    made = alice.http.post("/v1/notes", json={"text": "hello"})
    print("POST:", made.status_code)
    note = made.json()
    print("GET by owner:", alice.http.get(f"/v1/notes/{note['id']}").status_code)
    print("GET by another tenant:", bob.http.get(f"/v1/notes/{note['id']}").status_code)
    listed = [n["id"] for n in alice.http.get("/v1/notes").json()["items"]]
    print("listed:", listed == [note["id"]])
    print("anonymous:", api.anonymous().http.get("/v1/notes").status_code)
    print("bad body:", alice.http.post("/v1/notes", json={"text": ""}).status_code)


CHECKS = {"kind": check_kind, "estimator": check_estimator, "resource": check_resource}


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch, running_api(Path(scratch)) as api:
        CHECKS[sys.argv[1]](api)


if __name__ == "__main__":
    main()
