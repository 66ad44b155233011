"""A job's memory is the job's, however many processes it has (issue 41, point 3; NOTE [ A
job's memory among its processes ] in workers/training/ranks.py): on a worker that holds its
jobs to 1 GiB, a 2-process train job whose ranks each allocate 768 MiB (within the whole cap,
past a rank's share) fails as out of memory, saying the share, once (not retried), and the
worker goes on to run other jobs; without that allocation a 2-process job runs under the same
cap."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.answers import created
from harness.digits import digits_npz
from harness.stack import Client, Stack, running_stack
from service.settings import GIB, MIB
from tests.e2e.chaos.test_failures import small_job_succeeds
from workers.faults import FAULT_RANK_ALLOCATE_ENV

pytestmark = pytest.mark.slow

WORKER_MEMORY = GIB
# Each rank's share is at most half the cap: this fits the whole cap, not a share.
RANK_ALLOCATION = 768 * MIB


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    overrides = {
        "BNADAPT_WORKER_MEMORY_BYTES": str(WORKER_MEMORY),
        "BNADAPT_WORKER_THREADS": "1",
        FAULT_RANK_ALLOCATE_ENV: f"{RANK_ALLOCATION}:",  # every job's ranks
    }
    with running_stack(tmp_path, overrides) as stack:
        yield stack


def two_process_job(client: Client) -> str:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=200)))
    params = {"epochs": 1, "batch_size": 20, "processes": 2, "validation_fraction": 0.0}
    body = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    job = created(client.submit({**body, "params": params, "max_attempts": 3}), 202)
    return str(job["id"])


def test_a_rank_past_its_share_fails_the_job_once_and_the_worker_goes_on(stack: Stack) -> None:
    assert stack.worker is not None
    worker_pid = stack.worker.pid
    client = stack.client("ranks-memory")
    job_id = two_process_job(client)
    done = client.wait(job_id, timeout_s=300)
    assert done["status"] == "failed", done
    assert done["attempts"] == [], done["attempts"]  # its own failure: not retried
    error = done["error"]
    assert error.startswith("the job ran out of memory (rank "), error
    assert "of 2 needed more than its share of the job's memory" in error, error
    share_mib = int(error.split("share of the job's memory, ")[1].split(" MiB")[0])
    assert 0 < share_mib <= WORKER_MEMORY // MIB // 2, error
    assert "BNADAPT_WORKER_MEMORY_BYTES" in error and "fewer processes" in error, error
    assert "smaller batch_size" in error, error

    # The worker goes on: another tenant's job runs on it next.
    small_job_succeeds(stack.client("ranks-memory-neighbour"))
    assert stack.worker.pid == worker_pid and stack.worker.poll() is None

    # Under the same cap, a 2-process job whose ranks stay within their shares runs.
    stack.stop_worker()
    stack.env_overrides = {
        k: v for k, v in stack.env_overrides.items() if k != FAULT_RANK_ALLOCATE_ENV
    }
    stack.start_worker()
    honest = client.wait(two_process_job(client), timeout_s=300)
    assert honest["status"] == "succeeded", honest
