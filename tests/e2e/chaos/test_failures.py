"""A job is never left `running` when its process dies, and the service recovers from a lost
worker or a restarted Redis."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_schemas import JobStatus
from harness.answers import created
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import Client, Stack, running_stack
from service.local.embedded import RedisServer
from tests.e2e.test_e2e import long_train

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as stack:
        yield stack


def running_job(stack: Stack, client: Client, max_attempts: int = 1) -> str:
    """A long job, running; with one attempt, an interruption fails it (no retry)."""
    job = created(client.submit({**long_train(client), "max_attempts": max_attempts}), 202)
    wait_for(
        lambda: client.http.get(f"/v1/jobs/{job['id']}").json()["status"] == "running",
        timeout_s=60,
        what="the job to start",
    )
    return str(job["id"])


def small_job_succeeds(client: Client) -> None:
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=64)))
    job = created(
        client.submit({"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}),
        202,
    )
    # Generous: after a Redis restart the supervisor starts the RQ worker again with a growing
    # delay, and a worker's start (torch's import) takes tens of seconds on a loaded machine.
    assert client.wait(job["id"], timeout_s=600)["status"] == "succeeded"


def job_pid(stack: Stack, job_id: str) -> int:
    """The pid of the process running the job (RQ's forked work horse)."""
    worker = stack.records().client.hget(f"bnadapt:job:{job_id}", "worker")
    assert worker is not None
    return int(worker.decode().rsplit(":", 1)[1])


def test_killed_job_process_fails_the_job_at_once(stack: Stack) -> None:
    client = stack.client("oom")
    job_id = running_job(stack, client)
    os.kill(job_pid(stack, job_id), signal.SIGKILL)  # as the OOM killer would
    done = client.wait(job_id, timeout_s=30)
    assert done["status"] == "failed"
    assert "process died" in done["error"]
    small_job_succeeds(client)


def test_lost_worker_fails_the_job_within_the_heartbeat_timeout(stack: Stack) -> None:
    client = stack.client("lost")
    job_id = running_job(stack, client)
    # Every process of the worker dies, as when its machine is lost. (RQ's job process runs in
    # a session of its own, so it outlives a killed worker: it is killed separately.)
    pid = job_pid(stack, job_id)
    stack.kill_worker_group()
    os.kill(pid, signal.SIGKILL)
    done = client.wait(job_id, timeout_s=30)  # heartbeat timeout 4 s + reaper every 5 s
    assert done["status"] == "failed"
    assert "heartbeats" in done["error"]
    stack.start_worker()
    small_job_succeeds(client)


def test_redis_restart_loses_nothing_and_service_recovers(stack: Stack) -> None:
    client = stack.client("restart")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    port, password = stack.redis.port, stack.redis.password
    stack.redis.kill()  # SIGKILL; AOF everysec keeps what was acknowledged a second ago
    down = client.http.get("/v1/models")
    assert down.status_code == 503
    assert "Redis" in down.json()["detail"]
    stack.redis = RedisServer(stack.data_dir / "redis", port=port, password=password)
    stack.redis.start()
    wait_for(
        lambda: client.http.get(f"/v1/models/{model['id']}").status_code == 200,
        timeout_s=120,
        what="the API to see the model again",
    )
    small_job_succeeds(client)


def test_a_job_failed_elsewhere_stops_its_process(stack: Stack) -> None:
    # A partitioned worker's job is failed by the reaper; when the job sees its record is no
    # longer running it stops at its next batch instead of training on for nobody.
    client = stack.client("abandoned")
    job_id = running_job(stack, client)
    pid = job_pid(stack, job_id)
    assert stack.records().mark_finished(job_id, JobStatus.FAILED, error="lost (test)")
    wait_for(lambda: not _alive(pid), timeout_s=30, what="the job's process to stop")
    assert client.http.get(f"/v1/jobs/{job_id}").json()["status"] == "failed"
    models = client.http.get("/v1/models").json()["items"]
    assert all(m["source"] != "job" for m in models)
    small_job_succeeds(client)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A finished child may linger as a zombie until RQ reaps it.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
