"""Bounds on the real stack (issue 27, deliver 7): the worker publishes its memory and the API
refuses a batch that cannot fit it; a job that runs out of memory, diverges to NaN or runs
past its `timeout_s` fails after one attempt, saying why, while `max_attempts` allows more;
the worker goes on to run the next job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import Client, Stack, npz_bytes, running_stack
from service.records.job_life.capacity import WorkerMemory
from service.settings import MIB
from tests.api.jobs.test_job_bounds import strip_footprint
from tests.e2e.chaos.test_failures import small_job_succeeds
from tests.e2e.test_e2e import long_train

pytestmark = pytest.mark.slow

WORKER_MEMORY = 256 * MIB


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A worker that offers its jobs 256 MiB: it publishes that, and holds each job to it.
    overrides = {"BNADAPT_WORKER_MEMORY_BYTES": str(WORKER_MEMORY)}
    with running_stack(tmp_path_factory.mktemp("bounds"), env_overrides=overrides) as stack:
        yield stack


def _ended_once(client: Client, job_id: str, timeout_s: float = 300) -> dict[str, Any]:
    done = client.wait(job_id, timeout_s=timeout_s)
    assert done["status"] == "failed", done
    assert done["max_attempts"] == 3 and done["attempts"] == [], done  # not retried
    return done


def test_the_worker_publishes_its_memory_and_an_impossible_batch_is_refused(
    stack: Stack,
) -> None:
    wait_for(
        lambda: WorkerMemory(stack.records().client).smallest(stack_queue(stack)) is not None,
        timeout_s=60,
        what="the worker to publish its memory",
    )
    assert WorkerMemory(stack.records().client).smallest(stack_queue(stack)) == WORKER_MEMORY
    client = stack.client("bounds-e2e-memory")
    model = created(client.add_model("resnet", {"width": 8, "depth": 2}))
    images = np.zeros((8, 3, 8, 8), dtype=np.uint8)
    dataset = created(client.add_dataset(npz_bytes(x=images)))
    body = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 64, "preprocessing": {"resize": [512, 512]}},
    }
    refused = problem(
        client.submit(body), 422, "batch_size 64 at 3x512x512", "workers have 256.0 MiB"
    )
    fits = int(refused["detail"].split("use batch_size <= ")[1].split(",")[0])
    assert 1 <= fits < 64
    smaller = {**body, "params": {**body["params"], "batch_size": fits}}
    job = created(client.submit(smaller), 202)
    done = client.wait(job["id"], timeout_s=300)
    assert done["status"] == "succeeded", done["error"]


def stack_queue(stack: Stack) -> str:
    return "bnadapt-cpu"  # the stack's worker runs with --device cpu


def test_a_job_out_of_memory_fails_once_saying_so(stack: Stack) -> None:
    client = stack.client("bounds-e2e-oom")
    model = created(client.add_model("resnet", {"in_channels": 1, "width": 64, "depth": 4}))
    # A model registered before footprints were measured: the API cannot estimate its jobs,
    # so this one runs, and needs far more than the 256 MiB the worker holds it to.
    strip_footprint(stack.records().client, model["id"])
    dataset = created(client.add_dataset(digits_npz()))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 1797, "checkpoint": {"preset": "none"}},
    }
    job = created(client.submit(body), 202)
    done = _ended_once(client, job["id"])
    assert done["error"].startswith("the job ran out of memory ("), done["error"]
    assert "smaller batch_size" in done["error"]
    small_job_succeeds(client)


def test_a_job_that_diverges_fails_once(stack: Stack) -> None:
    client = stack.client("bounds-e2e-nan")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=512)))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"epochs": 20, "lr": 10.0, "momentum": 0.99, "batch_size": 16},
    }
    job = created(client.submit(body), 202)
    done = _ended_once(client, job["id"])
    assert "nan" in done["error"].lower() or "diverged" in done["error"].lower(), done["error"]


def test_a_job_past_its_timeout_fails_once_saying_it_timed_out(stack: Stack) -> None:
    client = stack.client("bounds-e2e-timeout")
    body = {**long_train(client), "timeout_s": 2}
    job = created(client.submit(body), 202)
    assert job["timeout_s"] == 2
    done = _ended_once(client, job["id"], timeout_s=120)
    assert done["error"].startswith("the job timed out: it ran past its timeout of 2 s")
    small_job_succeeds(client)
