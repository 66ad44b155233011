"""Bounds at submission (issue 27, deliver 7), against the API in process: every job number
has an upper bound shown in the OpenAPI document, a job's timeout is its own `timeout_s` or
the service's default and never past the operator's cap, and a batch whose activations
cannot fit the workers' memory is refused with the batch_size that fits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
from rq.job import Job

from api_schemas.models import ModelPublic
from harness.answers import created, problem
from harness.digits import digits_npz
from harness.inprocess import InProcessApi, running_api
from harness.stack import Client, npz_bytes
from service.records import keys
from service.records.connection import redis_client
from service.records.job_life.capacity import WorkerMemory
from service.settings import GIB, MIB


def _digits_job(client: Client, kind: str = "adapt", **params: Any) -> dict[str, Any]:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=40)))
    return {"kind": kind, "model_id": model["id"], "dataset_id": dataset["id"], "params": params}


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("adapt", "steps", 1_000_001),
        ("adapt", "max_batches", 1_000_001),
        ("adapt", "measure_batches", 1_000_001),
        ("adapt", "lr", 10.5),
        ("adapt", "prior_strength", 1e10),
        ("adapt", "batch_size", 65537),
        ("adapt", "shards", 257),
        ("train", "epochs", 1001),
        ("train", "lr", 11.0),
        ("train", "weight_decay", 2.0),
        ("evaluate", "batch_size", 65537),
    ],
)
def test_every_job_number_has_an_upper_bound(
    api: InProcessApi, kind: str, field: str, value: float
) -> None:
    client = api.client(f"bounds-{kind}-{field}")
    body = _digits_job(client, kind, **{field: value})
    refused = problem(client.submit(body), 422)
    assert any(field in item["loc"] for item in refused["errors"]), refused


def test_preprocessing_values_and_timeout_are_bounded(api: InProcessApi) -> None:
    client = api.client("bounds-preprocessing")
    body = _digits_job(client)
    spec = {"scale": False, "channels": "gray", "mean": [1e6], "std": [1.0]}
    problem(client.submit({**body, "params": {"preprocessing": spec}}), 422)
    spec = {**spec, "mean": [0.5], "std": [1e6]}
    problem(client.submit({**body, "params": {"preprocessing": spec}}), 422)
    refused = problem(client.submit({**body, "timeout_s": 8 * 24 * 3600}), 422)
    assert any("timeout_s" in item["loc"] for item in refused["errors"]), refused


def test_bounds_are_in_the_openapi_document(api: InProcessApi) -> None:
    document = Client(api.url, None).http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for schema, field in [
        ("AdaptParams", "steps"),
        ("AdaptParams", "lr"),
        ("AdaptParams", "max_batches"),
        ("TrainParams", "epochs"),
        ("TrainParams", "lr"),
        ("AdaptJobCreate", "timeout_s"),
        ("TrainJobCreate", "timeout_s"),
        ("EvaluateJobCreate", "timeout_s"),
    ]:
        prop = schemas[schema]["properties"][field]
        flat = str(prop)
        assert "maximum" in flat, (schema, field, prop)
        assert prop.get("description"), (schema, field, prop)
    batch = schemas["AdaptParams"]["properties"]["batch_size"]
    assert batch["maximum"] == 65536 and "65536" in batch["description"]


def test_a_job_runs_under_its_own_timeout_or_the_default(api: InProcessApi) -> None:
    client = api.client("bounds-timeout")
    body = _digits_job(client)
    default = created(client.submit(body), 202)
    assert default["timeout_s"] == 6 * 3600 == api.settings.job_timeout_s
    own = created(client.submit({**body, "timeout_s": 90}), 202)
    assert own["timeout_s"] == 90
    assert client.http.get(f"/v1/jobs/{own['id']}").json()["timeout_s"] == 90
    connection = redis_client(api.redis.url)
    assert Job.fetch(own["id"], connection=connection, serializer="json").timeout == 90
    assert Job.fetch(default["id"], connection=connection, serializer="json").timeout == 6 * 3600
    refused = problem(client.submit({**body, "timeout_s": 3 * 24 * 3600}), 422, "timeout_s")
    assert "172800" in refused["detail"]  # the cap (48 h by default) and what to use


def test_models_carry_their_activation_footprint(api: InProcessApi) -> None:
    client = api.client("bounds-footprint")
    model = created(client.add_model("resnet", {"width": 8, "depth": 2}))
    footprint = model["activations"]
    # A (2, 3, 64, 64) probe: every module's output kept for backward outweighs one module's.
    assert footprint["backward_bytes_per_element"] > footprint["forward_bytes_per_element"] > 4
    assert client.http.get(f"/v1/models/{model['id']}").json()["activations"] == footprint


def _image_job(client: Client, resize: int, batch_size: int, device: str) -> dict[str, Any]:
    model = created(client.add_model("resnet", {"width": 8, "depth": 2}))
    images = np.zeros((4, 3, 8, 8), dtype=np.uint8)
    dataset = created(client.add_dataset(npz_bytes(x=images)))
    spec = {"resize": [resize, resize]}
    return {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": batch_size, "device": device, "preprocessing": spec},
    }


@pytest.fixture(scope="module")
def small_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    """An API whose operator said workers have 64 GiB, and capped timeouts at 1 h."""
    with running_api(
        tmp_path_factory.mktemp("small-workers"),
        worker_memory_bytes=64 * GIB,
        job_timeout_max_s=3600,
    ) as api:
        yield api


def test_an_impossible_batch_is_refused_saying_what_fits(small_workers: InProcessApi) -> None:
    client = small_workers.client("bounds-memory")
    # No worker has published: the API goes by BNADAPT_WORKER_MEMORY_BYTES (64 GiB).
    body = _image_job(client, 8192, 4096, "auto")
    refused = problem(client.submit(body), 422, "batch_size 4096 at 3x8192x8192", "TiB", "64.0 GiB")
    fits = int(refused["detail"].split("use batch_size <= ")[1].split(",")[0])
    assert 1 <= fits < 4096
    assert "resize" in refused["detail"]
    # The batch it named fits; one more does not.
    created(client.submit({**body, "params": {**body["params"], "batch_size": fits}}), 202)
    problem(client.submit({**body, "params": {**body["params"], "batch_size": fits + 1}}), 422)
    # A small resize of the same batch fits.
    created(client.submit(_image_job(client, 64, 4096, "auto")), 202)
    # The cap on timeouts is the operator's.
    problem(client.submit({**body, "timeout_s": 3601}), 422, "3600")


def test_the_workers_published_memory_is_what_counts(small_workers: InProcessApi) -> None:
    client = small_workers.client("bounds-published")
    body = _image_job(client, 256, 64, "mps")
    created(client.submit(body), 202)  # 64 GiB by the setting
    memory = WorkerMemory(redis_client(small_workers.redis.url))
    queue = small_workers.settings.job_queue("mps")
    memory.publish([queue], "w-big", 8 * GIB, ttl_s=60)
    memory.publish([queue], "w-small", 64 * MIB, ttl_s=60)
    try:
        refused = problem(client.submit(body), 422, "batch_size 64 at 3x256x256", "64.0 MiB")
        assert "use batch_size <= " in refused["detail"]
        # A worker that stopped publishing no longer counts.
        memory.publish([queue], "w-small", 64 * MIB, ttl_s=-1)
        created(client.submit(body), 202)
    finally:
        memory.withdraw([queue], "w-big")
        memory.withdraw([queue], "w-small")


def test_a_model_without_a_footprint_is_not_checked(small_workers: InProcessApi) -> None:
    client = small_workers.client("bounds-old-model")
    body = _image_job(client, 16384, 4096, "auto")
    problem(client.submit(body), 422, "batch_size 4096")
    # A model registered before its footprint was measured: its record lacks the field.
    strip_footprint(small_workers.records().client, body["model_id"])
    assert client.http.get(f"/v1/models/{body['model_id']}").json()["activations"] is None
    created(client.submit(body), 202)


def strip_footprint(connection: redis.Redis, model_id: str) -> None:
    """Makes a model's record what releases before the footprint wrote: no ``activations``."""
    record = keys.record("model", model_id)
    raw = connection.hget(record, "data")
    assert raw is not None
    data = json.loads(raw)
    del data["activations"]
    ModelPublic.model_validate(data)  # an older record still reads
    connection.hset(record, "data", json.dumps(data))
