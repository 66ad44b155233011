"""A probe's change at work, run by the probe in its scratch copy (the current directory, first
on ``PYTHONPATH``): the API in process over a real Redis-compatible server
(harness/inprocess.py), and, where a job must run, a real RQ worker in this process taking it
from the queue. Each check asserts what it sees and writes the findings, one phrase each, as a
JSON list to ``FINDINGS``: they are the table's last column.

    python scripts/seam_probes/check.py kind|estimator|resource FINDINGS
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
from rq import SimpleWorker

import service
from harness.inprocess import InProcessApi, running_api
from harness.stack import Client, npz_bytes
from service.records.connection import redis_client
from service.settings import get_settings
from workers.models.architectures import build_model
from workers.processes.rq_worker import TurnQueue


class ProbeCheckError(Exception):
    """The change did not do what the probe expects of it."""


def expect(condition: bool, finding: str, seen: object) -> str:
    """``finding`` if ``condition`` holds, else an error with what was seen instead."""
    if not condition:
        raise ProbeCheckError(f"expected: {finding}; saw: {seen}")
    return finding


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


def submitted_and_run(
    api: InProcessApi, body: dict[str, Any], what: str
) -> tuple[Client, dict[str, Any], str]:
    """The job ``body`` asks for, on a new model and dataset, once a worker ran it; the
    finding that ``what`` was accepted, ran and succeeded."""
    client = api.client("probe")
    model_id, dataset_id = model_and_data(client)
    response = client.submit({**body, "model_id": model_id, "dataset_id": dataset_id})
    expect(response.status_code == 202, f"{what} is accepted (202)", response.text)
    run_queued(api)
    job: dict[str, Any] = client.http.get(f"/v1/jobs/{response.json()['id']}").json()
    ran = expect(
        job["status"] == "succeeded",
        f"{what} is accepted (202), run by a real RQ worker and succeeds",
        f"{job['status']}: {job.get('error')}",
    )
    return client, job, ran


def check_kind(api: InProcessApi) -> list[str]:
    document = api.anonymous().http.get("/openapi.json").json()
    description = document["paths"]["/v1/jobs"]["post"]["description"]
    _, _, ran = submitted_and_run(api, {"kind": "zero_bn"}, "a `zero_bn` job")
    return [
        expect(
            "ZeroBnJobCreate" in document["components"]["schemas"],
            "the OpenAPI document lists `ZeroBnJobCreate`",
            sorted(document["components"]["schemas"]),
        ),
        expect("zero_bn" in description, "the job description names the kind", description),
        ran,
    ]


def check_estimator(api: InProcessApi) -> list[str]:
    document = json.dumps(api.anonymous().http.get("/openapi.json").json())
    params = {"estimator": "ema_half", "batch_size": 8}
    client, job, ran = submitted_and_run(
        api, {"kind": "adapt", "params": params}, "an adapt job with it"
    )
    report = client.http.get(f"/v1/jobs/{job['id']}/report").json()
    return [
        expect("ema_half" in document, "the OpenAPI document names `ema_half`", "no mention"),
        ran,
        expect(report["estimator"] == "ema_half", "its report names it", report["estimator"]),
    ]


def check_resource(api: InProcessApi) -> list[str]:
    alice, bob = api.client("alice"), api.client("bob")
    made = alice.http.post("/v1/notes", json={"text": "hello"})
    note_id = made.json().get("id")
    own = alice.http.get(f"/v1/notes/{note_id}").status_code
    other = bob.http.get(f"/v1/notes/{note_id}").status_code
    listed = [n["id"] for n in alice.http.get("/v1/notes").json()["items"]]
    anonymous = api.anonymous().http.get("/v1/notes").status_code
    bad = alice.http.post("/v1/notes", json={"text": ""}).status_code
    return [
        expect(made.status_code == 201, "201 on create", made.text),
        expect(own == 200, "200 to its owner", own),
        expect(other == 404, "404 to another tenant", other),
        expect(listed == [note_id], "listed to its owner", listed),
        expect(anonymous == 401, "401 without a key", anonymous),
        expect(bad == 422, "422 for a bad body", bad),
    ]


CHECKS: dict[str, Callable[[InProcessApi], list[str]]] = {
    "kind": check_kind,
    "estimator": check_estimator,
    "resource": check_resource,
}


def main() -> None:
    name, findings = sys.argv[1], Path(sys.argv[2])
    # The code under test is the scratch copy's, not the checkout's the project is installed
    # from (PYTHONPATH puts the copy first).
    here = Path.cwd().resolve()
    loaded_from = Path(service.__file__).resolve()
    if not loaded_from.is_relative_to(here):
        raise ProbeCheckError(f"service was imported from {loaded_from}, not the copy at {here}")
    with tempfile.TemporaryDirectory() as scratch, running_api(Path(scratch)) as api:
        findings.write_text(json.dumps(CHECKS[name](api)))


if __name__ == "__main__":
    main()
