"""A sharded job's records and the reaper's verdicts on it, on a real Redis-compatible server with
real RQ jobs (no worker takes them: each test plays the children's part itself)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from rq import Queue
from rq.job import Job
from rq.job import JobStatus as RQStatus

from api_schemas import (
    AdaptParams,
    JobPayload,
    JobPublic,
    JobStatus,
    Progress,
    new_id,
    utc_now,
)
from harness.stack import npz_bytes
from service.records import keys
from service.records.connection import redis_client
from service.records.job_life.dequeues import DequeueHolds
from service.records.job_life.shards import FINISH, MERGE, ChildState, ShardRecords, child_job_id
from service.records.sync import Records
from service.records.tenancy.turns import Turns, turn_queue_name
from service.settings import Settings
from service.store.local import LocalStore
from service.upkeep.reaper import enqueue_ready_children, reap_stale_jobs
from tests.workers.test_shards import adapt_payload
from workers.running.runtime import JobRuntime
from workers.sharding.jobs import start_shards

TENANT = "tn_shards"
# Where the children wait: their tenant's queue (NOTE [ Fair turns ] in
# service/records/tenancy/turns.py).
QUEUE = turn_queue_name("shard-tests", TENANT, 0)
TIMEOUT_S = 0.5  # heartbeat timeout: short, so the tests can outwait it


@pytest.fixture
def records(redis_url: str) -> Records:
    return Records(redis_client(redis_url))


def new_job(
    records: Records, store: LocalStore, params: AdaptParams, labels: bool = False
) -> JobPayload:
    """A job record, as the API makes it, marked running as the worker that takes it does."""
    rng = np.random.default_rng(0)
    x = rng.random((20, 1, 8, 8), dtype=np.float32)
    data = npz_bytes(x=x, y=rng.integers(0, 10, 20)) if labels else npz_bytes(x=x)
    job_id = new_id("job")
    payload = adapt_payload(store, data, params, 4, job_id, TENANT)
    public = JobPublic(
        id=job_id,
        kind="adapt",
        status=JobStatus.QUEUED,
        model_id=payload.model.id,
        dataset_id=payload.dataset.id,
        params=params,
        created_at=utc_now(),
    )
    records.create_job(TENANT, public, payload)
    assert records.mark_started(job_id, "test")
    return payload


def dispatched(records: Records, redis_url: str, tmp_path: Path, labels: bool) -> JobPayload:
    """A running job of 20 samples in 5 batches, split into 2 shards (3 + 2 batches) and
    dispatched by the real start_shards: its children wait in a queue no worker serves."""
    store = LocalStore(tmp_path / "store")
    params = AdaptParams(estimator="precise", batch_size=4, shards=2)
    job = new_job(records, store, params, labels)
    settings = Settings(redis_url=redis_url, data_dir=tmp_path, queue="shard-tests")
    with JobRuntime(records, job.job_id, TIMEOUT_S) as runtime:
        answer = start_shards(job, records, store, runtime, settings)
    assert answer == {"job_id": job.job_id, "status": "running", "shards": "2"}
    return job


@pytest.fixture
def sharded(records: Records, redis_url: str, tmp_path: Path) -> JobPayload:
    return dispatched(records, redis_url, tmp_path, labels=False)


@pytest.fixture
def labelled(records: Records, redis_url: str, tmp_path: Path) -> JobPayload:
    """As ``sharded``, on data with labels: evaluation children and a finish follow the merge."""
    return dispatched(records, redis_url, tmp_path, labels=True)


def rq_status(records: Records, job_id: str, child: str) -> str:
    job = Job.fetch(child_job_id(job_id, child), connection=records.client, serializer="json")
    return str(job.get_status().value)


def test_children_wait_in_their_tenants_queue_of_the_jobs_priority(
    records: Records, redis_url: str, tmp_path: Path
) -> None:
    """NOTE [ Fair turns ] in service/records/tenancy/turns.py: a sharded job's children take the
    turns of its tenant, at its priority."""
    store = LocalStore(tmp_path / "store")
    params = AdaptParams(estimator="precise", batch_size=4, shards=2)
    job = new_job(records, store, params).model_copy(update={"priority": 3})
    settings = Settings(redis_url=redis_url, data_dir=tmp_path, queue="shard-tests")
    with JobRuntime(records, job.job_id, TIMEOUT_S) as runtime:
        start_shards(job, records, store, runtime, settings)
    own = turn_queue_name("shard-tests", TENANT, 3)
    assert Queue(own, connection=records.client, serializer="json").job_ids == [
        child_job_id(job.job_id, "shard-0"),
        child_job_id(job.job_id, "shard-1"),
    ]
    assert Turns(records.client).queue_names("shard-tests") == [own]


def test_dispatch_records_the_plan_and_queues_the_children(
    records: Records, sharded: JobPayload
) -> None:
    shard_records = ShardRecords(records.client)
    children = shard_records.children(sharded.job_id)
    assert children == {"shard-0": "queued", "shard-1": "queued", MERGE: "queued"}
    assert [rq_status(records, sharded.job_id, c) for c in children] == [
        "queued",
        "queued",
        "deferred",  # the merge waits for both shards
    ]
    job = records.get_job(TENANT, sharded.job_id)
    assert job is not None
    assert job.status is JobStatus.RUNNING
    assert job.progress is not None
    assert (job.progress.done, job.progress.total, job.progress.phase) == (0, 5, "adapt")
    # Shard jobs are no jobs of the tenant's.
    assert [j.id for j in records.list_jobs(TENANT, 10, None).items] == [sharded.job_id]


def test_queued_shards_keep_their_job_running(
    records: Records, sharded: JobPayload, tmp_path: Path
) -> None:
    # A plain job without a heartbeat, for comparison: the same sweep reaps it.
    plain = new_job(records, LocalStore(tmp_path / "store"), AdaptParams())
    records.client.hset(f"bnadapt:job:{plain.job_id}", "started_at", "2000-01-01T00:00:00+00:00")
    time.sleep(TIMEOUT_S * 2)  # the dispatching process's heartbeat is long gone
    assert not records.heartbeat_alive(sharded.job_id)
    assert reap_stale_jobs(records, TIMEOUT_S) == [plain.job_id]
    assert records.job_status(sharded.job_id) is JobStatus.RUNNING
    assert records.job_status(plain.job_id) is JobStatus.FAILED


def test_a_dead_shard_fails_its_job_and_cancels_the_queued_ones(
    records: Records, sharded: JobPayload
) -> None:
    shard_records = ShardRecords(records.client)
    assert shard_records.claim(sharded.job_id, "shard-0", "host:1", TIMEOUT_S) is None
    assert shard_records.claim(sharded.job_id, "shard-0", "host:2", TIMEOUT_S) == (
        "shard-0 is running"
    )
    assert reap_stale_jobs(records, TIMEOUT_S) == []  # its heartbeat is alive
    time.sleep(TIMEOUT_S * 2)  # the process that claimed it died: no beat since
    assert reap_stale_jobs(records, TIMEOUT_S) == [sharded.job_id]
    job = records.get_job(TENANT, sharded.job_id)
    assert job is not None
    assert job.status is JobStatus.FAILED
    assert job.error is not None
    assert job.error.startswith("shard 1 of 2 stopped sending heartbeats for 0.5 s")
    assert shard_records.children(sharded.job_id) == {
        "shard-0": "running",  # as its dead process left it
        "shard-1": "canceled",
        MERGE: "canceled",
    }
    assert rq_status(records, sharded.job_id, "shard-1") == "canceled"
    assert rq_status(records, sharded.job_id, MERGE) == "canceled"
    assert shard_records.claim(sharded.job_id, "shard-1", "host:3", TIMEOUT_S) == (
        "the job is failed"
    )


def test_a_shard_lost_with_its_whole_worker_is_queued_again(
    records: Records, sharded: JobPayload
) -> None:
    """NOTE [ Retried children ]: the worker took shard 1 from the queue, RQ marked it started,
    its process claimed it; then the whole worker died (no beat of the shard, none of the
    worker's holds key). The sweep puts it back at the front of its queue with one RQ retry
    used, and the job goes on running."""
    shard_records = ShardRecords(records.client)
    rq_id = child_job_id(sharded.job_id, "shard-0")
    queue = Queue(QUEUE, connection=records.client, serializer="json")
    assert records.client.lpop(queue.key) == rq_id.encode()
    rq_job = Job.fetch(rq_id, connection=records.client, serializer="json")
    rq_job.retries_left = retries = 2  # as for a job of max_attempts 3 (NOTE [ Retried children ])
    rq_job.save()
    rq_job.set_status(RQStatus.STARTED)
    DequeueHolds(records.client).hold("worker-1", rq_id, TIMEOUT_S)
    assert shard_records.claim(sharded.job_id, "shard-0", "host:1", TIMEOUT_S) is None
    assert reap_stale_jobs(records, TIMEOUT_S) == []
    assert shard_records.children(sharded.job_id) == {
        "shard-0": "running",
        "shard-1": "queued",
        MERGE: "queued",
    }
    time.sleep(TIMEOUT_S * 2)  # the worker and the shard's process died: no beat since
    assert reap_stale_jobs(records, TIMEOUT_S) == []
    assert records.job_status(sharded.job_id) is JobStatus.RUNNING
    assert shard_records.children(sharded.job_id) == {
        "shard-0": "queued",
        "shard-1": "queued",
        MERGE: "queued",
    }
    assert records.client.lrange(queue.key, 0, -1) == [
        rq_id.encode(),
        child_job_id(sharded.job_id, "shard-1").encode(),
    ]
    rq_job = Job.fetch(rq_id, connection=records.client, serializer="json")
    assert rq_job.get_status() == RQStatus.QUEUED
    assert rq_job.retries_left == retries - 1
    assert shard_records.claim(sharded.job_id, "shard-0", "host:2", TIMEOUT_S) is None


def test_a_shard_taken_from_the_queue_by_a_lost_worker_is_queued_again(
    records: Records, sharded: JobPayload
) -> None:
    rq_id = child_job_id(sharded.job_id, "shard-1")
    queue = Queue(QUEUE, connection=records.client, serializer="json")
    assert records.client.lrem(queue.key, 0, rq_id) == 1
    DequeueHolds(records.client).hold("worker-1", rq_id, TIMEOUT_S)
    assert reap_stale_jobs(records, TIMEOUT_S) == []
    assert records.client.lrange(queue.key, 0, -1) == [
        child_job_id(sharded.job_id, "shard-0").encode()
    ]
    time.sleep(TIMEOUT_S * 2)  # the worker died before it started it
    assert reap_stale_jobs(records, TIMEOUT_S) == []
    assert records.client.lrange(queue.key, 0, -1) == [
        rq_id.encode(),
        child_job_id(sharded.job_id, "shard-0").encode(),
    ]
    assert not records.client.exists(keys.rq_job_holder(rq_id))
    assert records.job_status(sharded.job_id) is JobStatus.RUNNING


def test_a_cancel_with_no_shard_running_cancels_the_job(
    records: Records, sharded: JobPayload
) -> None:
    records.request_cancel(sharded.job_id)
    assert reap_stale_jobs(records, TIMEOUT_S) == [sharded.job_id]
    assert records.job_status(sharded.job_id) is JobStatus.CANCELED
    children = ShardRecords(records.client).children(sharded.job_id)
    assert children == dict.fromkeys(("shard-0", "shard-1", MERGE), ChildState.CANCELED)
    assert {rq_status(records, sharded.job_id, c) for c in children} == {"canceled"}


def test_a_shard_lost_from_the_queue_fails_its_job(records: Records, sharded: JobPayload) -> None:
    Job.fetch(
        child_job_id(sharded.job_id, "shard-1"), connection=records.client, serializer="json"
    ).delete()
    assert reap_stale_jobs(records, TIMEOUT_S) == [sharded.job_id]
    job = records.get_job(TENANT, sharded.job_id)
    assert job is not None
    assert job.error is not None
    assert job.error.startswith("shard 2 of 2 will never run: its queue entry is gone")


def test_a_failed_shard_whose_error_was_lost_fails_its_job(
    records: Records, sharded: JobPayload
) -> None:
    shard_records = ShardRecords(records.client)
    assert shard_records.claim(sharded.job_id, "shard-1", "host:1", TIMEOUT_S) is None
    shard_records.finish(sharded.job_id, "shard-1", ChildState.FAILED)
    assert reap_stale_jobs(records, TIMEOUT_S) == [sharded.job_id]
    job = records.get_job(TENANT, sharded.job_id)
    assert job is not None
    assert job.error is not None
    assert job.error.startswith("shard 2 of 2 failed before the job finished")


def progress(done: int, total: int, eta: float | None) -> Progress:
    return Progress(
        done=done,
        total=total,
        unit="batches",
        samples_per_second=10.0 if done < total else 0.0,
        eta_seconds=eta,
        phase="adapt",
        updated_at=utc_now(),
    )


def test_the_job_progress_sums_its_shards(records: Records, sharded: JobPayload) -> None:
    shard_records = ShardRecords(records.client)

    def shown() -> tuple[int, int, float, float | None]:
        job = records.get_job(TENANT, sharded.job_id)  # what GET /v1/jobs/{id} reads
        assert job is not None
        assert job.progress is not None
        p = job.progress
        return p.done, p.total, p.samples_per_second, p.eta_seconds

    shard_records.publish_progress(sharded.job_id, "shard-0", progress(1, 3, 4.0))
    assert shown() == (1, 5, 10.0, None)  # shard-1 has not started: no ETA yet
    shard_records.publish_progress(sharded.job_id, "shard-1", progress(2, 2, 0.0))
    assert shown() == (3, 5, 10.0, 4.0)
    shard_records.publish_progress(sharded.job_id, "shard-0", progress(3, 3, 0.0))
    assert shown() == (5, 5, 0.0, 0.0)


def test_labelled_data_adds_evaluation_children_after_the_merge(
    records: Records, labelled: JobPayload
) -> None:
    shard_records = ShardRecords(records.client)
    children = shard_records.children(labelled.job_id)
    order = ["shard-0", "shard-1", MERGE, "eval-0", "eval-1", FINISH]
    assert children == dict.fromkeys(order, ChildState.QUEUED)
    assert [rq_status(records, labelled.job_id, c) for c in order] == [
        "queued",
        "queued",
        *["deferred"] * 4,  # the merge waits for the shards, they for it, the finish for them
    ]
    # The shards and the merge done, one evaluation waiting for a worker: still running.
    for child in ("shard-0", "shard-1", MERGE):
        assert shard_records.claim(labelled.job_id, child, "host:1", TIMEOUT_S) is None
        shard_records.finish(labelled.job_id, child, ChildState.DONE, "{}")
    merged = "ab" * 32  # the merged weights wait in the store, referenced by the merge
    shard_records.hold_weights(labelled.job_id, merged)
    merge_id = child_job_id(labelled.job_id, MERGE)
    assert records.client.smembers(keys.sha_refs(merged)) == {merge_id.encode()}
    time.sleep(TIMEOUT_S * 2)
    assert reap_stale_jobs(records, TIMEOUT_S) == []
    # An evaluation child that dies fails the job, naming it; the rest never run.
    assert shard_records.claim(labelled.job_id, "eval-1", "host:2", TIMEOUT_S) is None
    time.sleep(TIMEOUT_S * 2)
    assert reap_stale_jobs(records, TIMEOUT_S) == [labelled.job_id]
    job = records.get_job(TENANT, labelled.job_id)
    assert job is not None and job.error is not None
    assert job.error.startswith("evaluation 2 of 2 stopped sending heartbeats for 0.5 s")
    children = shard_records.children(labelled.job_id)
    assert children is not None
    assert (children["eval-0"], children[FINISH]) == ("canceled", "canceled")
    assert rq_status(records, labelled.job_id, FINISH) == "canceled"
    # Every child's hand-over is deleted with the job's end, and the weights released.
    assert shard_records.result(labelled.job_id, MERGE) is None
    assert records.client.smembers(keys.sha_refs(merged)) == set()
    assert records.client.zscore(keys.STORE_RELEASED, merged) is not None
    # A merge that gets this far after the job ended holds nothing (it would never be let go).
    late = "cd" * 32
    assert shard_records.hold_weights(labelled.job_id, late) == "failed"
    assert records.client.exists(keys.sha_refs(late)) == 0


def test_evaluation_children_count_into_the_job_progress(
    records: Records, labelled: JobPayload
) -> None:
    shard_records = ShardRecords(records.client)
    # What the merge's runtime writes when it hands over: all 5 batches still to measure.
    records.write_progress(
        labelled.job_id, progress(0, 5, None).model_copy(update={"phase": "evaluate after"})
    )
    shard_records.count_evaluated(labelled.job_id, 3)  # eval-0: 12 samples in batches of 4
    job = records.get_job(TENANT, labelled.job_id)
    assert job is not None and job.progress is not None
    assert (job.progress.phase, job.progress.done, job.progress.total) == ("evaluate after", 3, 5)
    shard_records.count_evaluated(labelled.job_id, 3)  # never past the total
    job = records.get_job(TENANT, labelled.job_id)
    assert job is not None and job.progress is not None
    assert job.progress.done == 5


def test_children_rq_is_still_moving_keep_their_job_running(
    records: Records, labelled: JobPayload
) -> None:
    # Between "dependencies done" and "in the queue" RQ 3 parks a child in states of its own;
    # a worker that loses the race to move it leaves it there for RQ's next cleanup pass.
    eval_job = Job.fetch(
        child_job_id(labelled.job_id, "eval-1"), connection=records.client, serializer="json"
    )
    for status in (RQStatus.READY_TO_ENQUEUE, RQStatus.CREATED, RQStatus.RATE_LIMITED):
        eval_job.set_status(status)
        assert reap_stale_jobs(records, TIMEOUT_S) == [], status
        assert records.job_status(labelled.job_id) is JobStatus.RUNNING
    eval_job.set_status(RQStatus.FAILED)  # RQ gave up on it: the job cannot finish
    assert reap_stale_jobs(records, TIMEOUT_S) == [labelled.job_id]


def test_children_rq_left_ready_are_moved_to_the_queue(
    records: Records, labelled: JobPayload
) -> None:
    # As RQ leaves a dependent when its move to the queue loses a race: ready, not queued.
    queue = Queue(QUEUE, connection=records.client, serializer="json")
    child = Job.fetch(
        child_job_id(labelled.job_id, "eval-0"), connection=records.client, serializer="json"
    )
    with records.client.pipeline() as pipe:
        queue.ready_job_registry.register_jobs([child], pipeline=pipe)
        pipe.execute()
    assert child.get_status() == RQStatus.READY_TO_ENQUEUE
    assert child.id not in queue.job_ids
    assert enqueue_ready_children(records.client, QUEUE) == 1
    assert child.get_status() == RQStatus.QUEUED
    assert child.id in queue.job_ids
    assert enqueue_ready_children(records.client, QUEUE) == 0  # nothing left to move
