"""Every job ends terminal within a stated bound, whatever process dies when: real kills of
real processes of the running stack (tests/stack.py), observed over HTTP."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rq import Worker

from api_schemas import parse_job_create
from service.redis_conn import redis_client
from service.routes.jobs import _body_sha256
from tests.servers import wait_for
from tests.stack import Client, Stack, running_stack
from tests.test_e2e import created, digits_npz, problem

pytestmark = pytest.mark.slow

# tests/stack.py runs the stack with BNADAPT_HEARTBEAT_TIMEOUT_S=4 (NOTE [ Heartbeat bound ]).
HEARTBEAT_TIMEOUT_S = 4.0
SLACK_S = 10.0
# Long enough that the test kills the job's process inside the window.
START_DELAY_S = "120"


@pytest.fixture
def slow_start(tmp_path: Path) -> Iterator[Stack]:
    """A stack whose job processes wait between RQ's fork and marking the job running."""
    with running_stack(tmp_path, {"BNADAPT_FAULT_START_DELAY_S": START_DELAY_S}) as stack:
        yield stack


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command may hold spaces and parentheses: the fields follow the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def forked_job_process(stack: Stack) -> int:
    """The pid of the process RQ forked for the one job in progress (its work horse)."""
    client = redis_client(stack.redis.url)

    def horse() -> int | None:
        workers = [w for w in Worker.all(connection=client) if w.get_current_job_id()]
        if not workers or workers[0].pid is None:
            return None
        forked = children(workers[0].pid)
        return forked[0] if forked else None

    return wait_for(horse, timeout_s=60, what="RQ to fork a process for the job")


def submit_small_job(client: Client) -> str:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=32)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    return str(created(client.submit(body), 202)["id"])


def test_job_process_killed_before_it_marks_itself_running(slow_start: Stack) -> None:
    client = slow_start.client("forked")
    job_id = submit_small_job(client)
    pid = forked_job_process(slow_start)
    assert client.http.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    os.kill(pid, signal.SIGKILL)
    done = client.wait(job_id, timeout_s=SLACK_S)  # at once: the RQ worker saw it die
    assert done["status"] == "failed"
    assert "process died (signal 9" in done["error"]


def test_machine_lost_before_the_job_marks_itself_running(slow_start: Stack) -> None:
    client = slow_start.client("lost-queued")
    job_id = submit_small_job(client)
    pid = forked_job_process(slow_start)
    # Everything of the worker dies at once, the forked job process too (it runs in a session
    # of its own): nothing is left to report, only the sweep of the API can end the job.
    slow_start.kill_worker_group()
    os.kill(pid, signal.SIGKILL)
    # The bound is the heartbeat timeout from the kill; the wait allows it plus slack for
    # this test's own polling and a loaded machine, far below the old "forever".
    done = client.wait(job_id, timeout_s=HEARTBEAT_TIMEOUT_S + SLACK_S)
    assert done["status"] == "failed"
    assert "never marked the job running" in done["error"]


LEASE_S = 2.0


@pytest.fixture
def short_lease(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path, {"BNADAPT_IDEMPOTENCY_LEASE_S": str(LEASE_S)}) as stack:
        yield stack


def test_idempotency_key_of_a_crashed_request_is_free_after_the_lease(short_lease: Stack) -> None:
    client = short_lease.client("crashed-request")
    tenant = wait_for(lambda: _tenant_of(short_lease, client), what="the tenant")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=32)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    # The first step of a request, done through the same Records call the API makes, and then
    # nothing: the API process "died" before it wrote the job.
    records = short_lease.records()
    body_sha256 = _body_sha256(parse_job_create(body))
    records.remember_idempotency(tenant, "crash-1", body_sha256, "job_neverwritten", LEASE_S)
    leased = client.submit(body, **{"Idempotency-Key": "crash-1"})
    problem(leased, 409, "still being processed")
    assert int(leased.headers["retry-after"]) >= 1
    # After the lease, a retry makes the job; once made, the key answers it for 24 hours.
    job = wait_for(
        lambda: _accepted(client.submit(body, **{"Idempotency-Key": "crash-1"})),
        timeout_s=LEASE_S + SLACK_S,
        interval_s=0.25,
        what="a retry after the lease to be accepted",
    )
    again = created(client.submit(body, **{"Idempotency-Key": "crash-1"}), 202)
    assert again["id"] == job["id"]
    ttl = records.client.ttl(f"bnadapt:idem:{tenant}:crash-1")
    assert ttl > 23 * 3600
    assert client.wait(job["id"])["status"] == "succeeded"


def _accepted(response: Any) -> dict[str, Any] | None:
    if response.status_code == 409:
        return None
    return created(response, 202)


def _tenant_of(stack: Stack, client: Client) -> str | None:
    key = client.http.headers["authorization"].removeprefix("Bearer ")
    return stack.records().tenant_for_key(key)
