"""Every job ends terminal within a stated bound, whatever process dies when: real kills of
real processes of the running stack (harness/stack.py), observed over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from rq import Worker
from rq.job import Job

from api_schemas import parse_job_create
from harness.answers import created, problem
from harness.digits import digits_npz
from harness.servers import stop_process, wait_for
from harness.stack import REPO, Client, Stack, npz_bytes, running_stack
from service.jobs import idempotency
from service.local.embedded import RedisServer, free_port
from service.local.up import api_command
from service.records import keys
from service.records.connection import redis_client
from service.records.job_life.shards import ChildState, ShardRecords, child_job_id
from tests.e2e.test_shards_e2e import SHARDS, registered_by_jobs, shard_process
from workers.faults import FAULT_DEQUEUE_STOP_ENV, FAULT_START_DELAY_ENV

pytestmark = pytest.mark.slow

# harness/stack.py runs the stack with BNADAPT_HEARTBEAT_TIMEOUT_S=4 (NOTE [ Heartbeat bound ]).
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
    # One attempt: the interruption ends the job (retries: test_interrupted_job_is_retried...).
    return str(created(client.submit({**body, "max_attempts": 1}), 202)["id"])


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
    body_sha256 = idempotency.body_sha256(parse_job_create(body))
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


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as stack:
        yield stack


def medium_job(client: Client) -> dict[str, Any]:
    """A train job of some seconds: long enough to be interrupted mid-run."""
    model = created(client.add_model("digits_cnn", {"width": 16}))
    dataset = created(client.add_dataset(digits_npz()))
    return {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"epochs": 8, "batch_size": 32},
    }


def started_job(stack: Stack, client: Client, body: dict[str, Any]) -> tuple[str, int]:
    """Submits ``body`` and returns the job's id and its process's pid once it has run a
    step."""
    job_id = str(created(client.submit(body), 202)["id"])

    def stepping() -> bool:
        job = client.http.get(f"/v1/jobs/{job_id}").json()
        progress = job.get("progress") or {}
        return job["status"] == "running" and progress.get("phase") == "train"

    wait_for(stepping, timeout_s=180, what="the job to train")
    worker = stack.records().client.hget(f"bnadapt:job:{job_id}", "worker")
    assert worker is not None
    return job_id, int(worker.decode().rsplit(":", 1)[1])


def job_models(client: Client, job_id: str) -> list[dict[str, Any]]:
    return [m for m in client.http.get("/v1/models").json()["items"] if m["job_id"] == job_id]


def test_interrupted_job_is_retried_and_registers_one_model(stack: Stack) -> None:
    client = stack.client("retried")
    job_id, pid = started_job(stack, client, medium_job(client))
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    # The whole job runs again after the backoff: generous for a loaded machine.
    done = client.wait(job_id, timeout_s=600)
    assert done["status"] == "succeeded", done
    assert done["max_attempts"] == 3
    [attempt] = done["attempts"]
    assert attempt["attempt"] == 1
    assert "process died (signal 9" in attempt["reason"]
    assert attempt["worker"].endswith(f":{pid}")
    [model] = job_models(client, job_id)
    assert done["result"]["model_id"] == model["id"]
    # The report of the retried run names the one model.
    report = client.http.get(f"/v1/jobs/{job_id}/report").json()
    assert report["output_model_id"] == model["id"]


def test_job_rides_out_a_short_redis_outage(stack: Stack) -> None:
    client = stack.client("outage")
    job_id, _ = started_job(stack, client, medium_job(client))
    port, password = stack.redis.port, stack.redis.password
    stack.redis.kill()  # SIGKILL; the AOF keeps what was acknowledged a second ago
    time.sleep(3)  # the outage (longer than the test stack's heartbeat TTL of 2.7 s)
    stack.redis = RedisServer(stack.data_dir / "redis", port=port, password=password)
    stack.redis.start()
    # The job runs on (its 8 epochs took 1.5 min here alone, 3.4 min on a loaded machine).
    done = client.wait(job_id, timeout_s=600)
    assert done["status"] == "succeeded", done
    assert done["attempts"] == []  # the same run went on: no retry was needed
    assert len(job_models(client, job_id)) == 1


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: it exited
    except FileNotFoundError:
        return True


def test_killed_supervisor_takes_its_children_along(stack: Stack) -> None:
    assert stack.worker is not None
    supervisor = stack.worker.pid
    kids = wait_for(
        lambda: children(supervisor) if len(children(supervisor)) == 2 else None,
        timeout_s=30,
        what="the RQ worker and the inspector",
    )
    os.kill(supervisor, signal.SIGKILL)
    stack.worker.wait()
    stack.worker = None
    wait_for(lambda: all(_gone(pid) for pid in kids), timeout_s=60, what="the orphans to end")
    # A new supervisor is then the only worker.
    stack.start_worker()
    client = redis_client(stack.redis.url)
    wait_for(lambda: len(Worker.all(connection=client)) == 1, timeout_s=60, what="one RQ worker")
    client_ = stack.client("after-supervisor")
    job_id = submit_small_job(client_)
    assert client_.wait(job_id)["status"] == "succeeded"


def test_killed_api_parent_takes_its_workers_along(stack: Stack) -> None:
    port = free_port()
    argv = api_command("127.0.0.1", port, processes=2)

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    parent = subprocess.Popen(argv, env=stack.env, cwd=REPO)
    try:
        wait_for(healthy, timeout_s=60, what="the API to answer")
        workers = wait_for(
            lambda: [p for p in children(parent.pid) if b"spawn" in _cmdline(p)] or None,
            timeout_s=30,
            what="uvicorn's worker processes",
        )
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: all(_gone(p) for p in workers), timeout_s=60, what="the orphans to end")
    finally:
        stop_process(parent)
    restarted = subprocess.Popen(argv, env=stack.env, cwd=REPO)
    try:
        wait_for(healthy, timeout_s=60, what="the restarted API to bind its port and answer")
        assert restarted.poll() is None
    finally:
        stop_process(restarted)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except FileNotFoundError:
        return b""


def is_stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def stopped_rq_worker(stack: Stack) -> int:
    """The pid of the one RQ worker once it stopped itself with the job it took
    (``FAULT_DEQUEUE_STOP_ENV``)."""
    client = redis_client(stack.redis.url)

    def stopped() -> int | None:
        pids = [w.pid for w in Worker.all(connection=client) if w.pid is not None]
        return next((pid for pid in pids if is_stopped(pid)), None)

    return wait_for(stopped, timeout_s=120, what="the RQ worker to stop with the job it took")


def ended_attempts(client: Client, job_id: str) -> list[dict[str, Any]] | None:
    attempts = client.http.get(f"/v1/jobs/{job_id}").json()["attempts"]
    return list(attempts) or None


@pytest.mark.parametrize(
    ("moment", "why"),
    [
        ("taken", "no worker took it on"),
        ("held", "its worker is gone"),
        ("execution", "its worker is gone"),
    ],
)
def test_worker_tree_lost_with_a_job_it_took_from_the_queue(
    tmp_path: Path, moment: str, why: str
) -> None:
    """NOTE [ Dequeued and lost ]: the RQ worker took the job from its queue and stops itself
    (SIGSTOP, a test-only hook) before the job is marked started: right after RQ's pop, after
    recording that it holds the job, or once RQ recorded the execution; then its whole tree is
    SIGKILLed. The attempt ends within the heartbeat bound (not at RQ's 90 s registry expiry,
    nor never), and the next attempt succeeds on a new worker with one model."""
    with running_stack(tmp_path, {FAULT_DEQUEUE_STOP_ENV: moment}) as stack:
        client = stack.client("dequeued")
        model = created(client.add_model("digits_cnn", {"width": 4}))
        dataset = created(client.add_dataset(digits_npz(n=32)))
        body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
        job_id = str(created(client.submit(body), 202)["id"])  # max_attempts: the default, 3
        stopped_rq_worker(stack)
        assert client.http.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        stack.kill_worker_group()
        attempts = wait_for(
            lambda: ended_attempts(client, job_id),
            timeout_s=HEARTBEAT_TIMEOUT_S + SLACK_S,
            what="the sweep to end the lost attempt",
        )
        assert len(attempts) == 1
        assert "took it from the queue" in attempts[0]["reason"]
        assert why in attempts[0]["reason"]
        stack.env_overrides = {}
        stack.start_worker()
        done = client.wait(job_id, timeout_s=120)
        assert done["status"] == "succeeded", done
        assert len(done["attempts"]) == 1
        models = client.http.get("/v1/models").json()["items"]
        assert [m["job_id"] for m in models if m["source"] == "job"] == [job_id]


BOUND_S = HEARTBEAT_TIMEOUT_S + SLACK_S


def test_a_shard_lost_with_its_whole_worker_is_run_again_and_its_job_succeeds_once(
    tmp_path: Path,
) -> None:
    """NOTE [ Retried children ]: the one worker's whole tree (supervisor, RQ worker, and the
    shard's own process) is SIGKILLed while a shard runs: no RQ worker is left to see it die.
    The sweep puts the shard back on its queue within the heartbeat bound, a new worker runs
    it, and the job succeeds once, with one model and no failed attempt."""
    with running_stack(tmp_path) as stack:
        client = stack.client("lost-tree")
        model = created(client.add_model("resnet", {"in_channels": 1, "depth": 4, "width": 32}))
        x = np.random.default_rng(0).random((1024, 1, 32, 32), dtype=np.float32)
        dataset = created(client.add_dataset(npz_bytes(x=x)))
        body = {
            **sharded_body(model, dataset),
            "params": {"estimator": "precise", "batch_size": 8, "shards": 2},
        }
        job_id = str(created(client.submit(body), 202)["id"])
        shard_records = ShardRecords(stack.records().client)

        def running() -> tuple[str, int] | None:
            for child in SHARDS[:2]:
                pid = shard_process(shard_records, job_id, child)
                if pid is not None:
                    return child, pid
            return None

        found = wait_for(running, timeout_s=300, what="a shard to start")
        assert found is not None
        child, pid = found
        stack.kill_worker_group()
        os.kill(pid, signal.SIGKILL)  # in a process group of its own, as RQ forks it
        wait_for(
            lambda: (shard_records.children(job_id) or {}).get(child) is ChildState.QUEUED,
            timeout_s=BOUND_S,
            what=f"the sweep to queue {child} again",
        )
        stack.start_worker()
        done = client.wait(job_id, timeout_s=600)
        assert done["status"] == "succeeded", done
        assert done["attempts"] == []
        assert int(shard_records.processes(job_id)[child].rsplit(":", 1)[1]) != pid
        assert len(registered_by_jobs(client)) == 1
        report = client.http.get(done["result"]["report_url"]).json()
        assert [(s["index"], s["batches"]) for s in report["shards"]] == [(0, 64), (1, 64)]


def test_a_shard_taken_from_the_queue_by_a_lost_worker_is_run_again(tmp_path: Path) -> None:
    """NOTE [ Dequeued and lost ]: the worker took a shard from its queue and stops itself
    once RQ recorded the execution, before the fork (a test-only hook); its whole tree is
    SIGKILLed. The sweep puts the shard back at the front of its queue within the heartbeat
    bound, and the job succeeds once on a new worker."""
    with running_stack(tmp_path, {FAULT_DEQUEUE_STOP_ENV: "execution:-shard-"}) as stack:
        client, job_id = small_sharded_job(stack, "lost-dequeue")
        redis = stack.records().client
        worker = wait_for(
            lambda: next(
                (w for w in Worker.all(connection=redis) if w.pid and is_stopped(w.pid)), None
            ),
            timeout_s=120,
            what="the RQ worker to stop with the shard it took",
        )
        assert worker is not None
        rq_id = next(
            child_job_id(job_id, c)
            for c in SHARDS[:2]
            if redis.exists(keys.rq_job_holder(child_job_id(job_id, c)))
        )
        origin = Job.fetch(rq_id, connection=redis, serializer="json").origin
        stack.kill_worker_group()
        wait_for(
            lambda: redis.lpos(f"rq:queue:{origin}", rq_id) is not None,
            timeout_s=BOUND_S,
            what="the sweep to put the shard back on its queue",
        )
        stack.env_overrides = {}
        stack.start_worker()
        done = client.wait(job_id, timeout_s=300)
        assert done["status"] == "succeeded", done
        assert done["attempts"] == []
        assert len(registered_by_jobs(client)) == 1


def sharded_body(model: dict[str, Any], dataset: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}


def small_sharded_job(stack: Stack, tenant: str) -> tuple[Client, str]:
    """A ``cumulative`` adapt job in 2 shards of 2 batches on 64 digits, submitted by
    ``tenant``: the client and the job's id."""
    client = stack.client(tenant)
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=64)))
    body = {
        **sharded_body(model, dataset),
        "params": {"estimator": "cumulative", "batch_size": 16, "shards": 2},
    }
    return client, str(created(client.submit(body), 202)["id"])


def test_a_shard_killed_before_it_claims_itself_is_run_again(tmp_path: Path) -> None:
    """NOTE [ Retried children ]: a shard's process is SIGKILLed after RQ forked it and before
    it claimed the shard (every shard's process here waits 5 s in that window: a test-only hook).
    The RQ worker sees it die; the shard, still queued, runs again by RQ's retry instead of
    failing the job (as it did: seen by the chaos bench), and the job succeeds once."""
    with running_stack(tmp_path, {FAULT_START_DELAY_ENV: "5:-shard-"}) as stack:
        client, job_id = small_sharded_job(stack, "unclaimed")
        redis = stack.records().client

        def shard_horse() -> tuple[str, int] | None:
            for worker in Worker.all(connection=redis):
                rq_id = worker.get_current_job_id()
                if rq_id and "-shard-" in rq_id and worker.pid is not None:
                    forked = children(worker.pid)
                    if forked:
                        return rq_id, forked[0]
            return None

        found = wait_for(shard_horse, timeout_s=120, what="RQ to fork a shard's process")
        assert found is not None
        rq_id, pid = found
        child = rq_id.removeprefix(f"{job_id}-")
        assert (ShardRecords(redis).children(job_id) or {})[child] is ChildState.QUEUED
        os.kill(pid, signal.SIGKILL)
        done = client.wait(job_id, timeout_s=300)
        assert done["status"] == "succeeded", done
        assert done["attempts"] == []
        assert len(registered_by_jobs(client)) == 1
