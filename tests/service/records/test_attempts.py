"""A job's attempts (NOTE [ Job attempts ] in service/records/job_life/retries.py) on a real
Redis-compatible server, with real RQ jobs that no worker takes: the sweep's part is played by
calling it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from rq import Queue
from rq.job import Job

from api_schemas import AdaptParams, JobPublic, JobStatus, new_id, utc_now
from harness.stack import npz_bytes
from service.records import keys
from service.records.connection import redis_client
from service.records.job_life.dequeues import DequeueHolds
from service.records.job_life.queue import enqueue_run
from service.records.job_life.retries import RETRY_BACKOFF_BASE_S
from service.records.sync import Records
from service.records.tenancy.turns import turn_queue_name
from service.settings import Settings
from service.store.local import LocalStore
from service.upkeep.reaper import heartbeat_key_ttl_s, reap_lost_queued_jobs
from tests.workers.test_shards import adapt_payload

TENANT = "tn_attempts"


@pytest.fixture
def records(redis_url: str) -> Records:
    return Records(redis_client(redis_url))


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, data_dir=tmp_path, queue="attempt-tests")


def queued_job(records: Records, settings: Settings, max_attempts: int) -> str:
    """A job as the API writes it: the record and its first RQ job, in one MULTI."""
    store = LocalStore(settings.store_path)
    job_id = new_id("job")
    x = npz_bytes(x=np.zeros((4, 1, 8, 8), np.float32))
    payload = adapt_payload(store, x, AdaptParams(), 4, job_id, TENANT)
    public = JobPublic(
        id=job_id,
        kind="adapt",
        status=JobStatus.QUEUED,
        model_id=payload.model.id,
        dataset_id=payload.dataset.id,
        params=payload.params,
        created_at=utc_now(),
        max_attempts=max_attempts,
    )
    queue = Queue(settings.queue, connection=records.client, serializer="json")
    records.create_job(
        TENANT,
        public,
        payload,
        enqueue=lambda pipe: enqueue_run(
            queue, payload.model_dump(mode="json"), job_id, 60, "test", pipeline=pipe
        ),
    )
    return job_id


def test_an_interrupted_attempt_queues_the_next_until_the_last(
    records: Records, settings: Settings
) -> None:
    job_id = queued_job(records, settings, max_attempts=2)
    assert records.mark_started(job_id, "host:1")
    # A process of another (older) attempt cannot end this one.
    assert records.interrupt(job_id, (JobStatus.RUNNING,), "old", rq_id="other") is (
        JobStatus.RUNNING
    )
    assert records.interrupt(job_id, (JobStatus.RUNNING,), "killed", rq_id=job_id) is (
        JobStatus.QUEUED
    )
    rq_id, retry_at, _ = records.queue_entry(job_id)
    assert rq_id == f"{job_id}-attempt-2"
    assert retry_at is not None
    job = records.get_job(TENANT, job_id)
    assert job is not None
    assert [(a.attempt, a.worker, a.reason) for a in job.attempts] == [(1, "host:1", "killed")]
    assert job.started_at is None
    # The sweep enqueues the next attempt once its backoff has passed, once.
    assert reap_lost_queued_jobs(records, settings) == []
    time.sleep(RETRY_BACKOFF_BASE_S)
    assert reap_lost_queued_jobs(records, settings) == [job_id]
    assert reap_lost_queued_jobs(records, settings) == []
    assert Job.fetch(rq_id, connection=records.client, serializer="json").get_status() == "queued"
    assert records.queue_entry(job_id)[1] is None
    assert records.mark_started(job_id, "host:2")
    assert records.interrupt(job_id, (JobStatus.RUNNING,), "killed again") is JobStatus.FAILED
    job = records.get_job(TENANT, job_id)
    assert job is not None
    assert job.error == "killed again (attempt 2 of 2)"
    assert [a.attempt for a in job.attempts] == [1, 2]
    assert records.queued_jobs() == records.running_jobs() == []


def test_a_queued_job_whose_queue_entry_is_gone_is_retried(
    records: Records, settings: Settings
) -> None:
    job_id = queued_job(records, settings, max_attempts=3)
    Job.fetch(job_id, connection=records.client, serializer="json").delete()
    assert reap_lost_queued_jobs(records, settings) == [job_id]
    job = records.get_job(TENANT, job_id)
    assert job is not None
    assert job.status is JobStatus.QUEUED
    assert "queue entry is gone" in job.attempts[0].reason


def own_queue(settings: Settings) -> str:
    """The queue the jobs of TENANT wait in (NOTE [ Fair turns ] in
    service/records/tenancy/turns.py)."""
    return turn_queue_name(settings.queue, TENANT, 0)


def taken_from_queue(records: Records, settings: Settings, job_id: str) -> None:
    """What RQ's worker does first with a job: moves it from its queue onto the queue's
    intermediate list (RQ 3 with Redis >= 6.2), then records an execution of it."""
    queue = Queue(own_queue(settings), connection=records.client, serializer="json")
    assert records.client.lmove(queue.key, f"{queue.key}:intermediate") == job_id.encode()
    records.client.zadd(f"rq:wip:{queue.name}", {f"{job_id}:execution1": time.time() + 90})


def test_a_job_taken_from_the_queue_by_a_lost_worker_is_retried(
    records: Records, settings: Settings
) -> None:
    """NOTE [ Dequeued and lost ] in service/upkeep/reaper.py: a worker took the job from the
    queue and recorded that it holds it; the job is left alone while the worker's holds key
    names it, and its attempt ends at the first sweep once that key is gone, long before
    RQ's registry entry (90 s) expires."""
    job_id = queued_job(records, settings, max_attempts=3)
    waiting = queued_job(records, settings, max_attempts=3)
    taken_from_queue(records, settings, job_id)
    holds = DequeueHolds(records.client)
    holds.hold("worker-1", job_id, ttl_s=60)
    assert reap_lost_queued_jobs(records, settings) == []
    holds.beat("worker-1", "another-rq-job", ttl_s=60)  # went on without it
    assert reap_lost_queued_jobs(records, settings) == [job_id]
    job = records.get_job(TENANT, job_id)
    assert job is not None
    assert job.status is JobStatus.QUEUED
    assert "took it from the queue" in job.attempts[0].reason
    assert "its worker went on without it" in job.attempts[0].reason
    # What the lost run left is gone, so RQ's cleanups never act on it; the waiting job
    # beside it is left alone.
    assert records.client.lrange(f"rq:queue:{own_queue(settings)}:intermediate", 0, -1) == []
    assert records.client.zrange(f"rq:wip:{own_queue(settings)}", 0, -1) == []
    assert not records.client.exists(keys.rq_job_holder(job_id))
    assert waiting not in reap_lost_queued_jobs(records, settings)


def test_a_job_whose_holding_worker_died_is_retried(records: Records, settings: Settings) -> None:
    job_id = queued_job(records, settings, max_attempts=3)
    taken_from_queue(records, settings, job_id)
    DequeueHolds(records.client).hold("worker-2", job_id, ttl_s=0.3)
    assert reap_lost_queued_jobs(records, settings) == []
    time.sleep(0.4)  # the worker's holds key expired: it died
    assert reap_lost_queued_jobs(records, settings) == [job_id]
    job = records.get_job(TENANT, job_id)
    assert job is not None
    assert "its worker is gone" in job.attempts[0].reason


def test_a_job_taken_with_no_holder_is_retried_after_a_heartbeat_ttl(
    records: Records, redis_url: str, tmp_path: Path
) -> None:
    """The worker died (or Redis was lost) between RQ's pop and writing the holder: the job
    counts as lost once sweeps have seen it out of its queue and unheld for a heartbeat TTL.
    Here the pop of a worker of several queues (BLPOP: no intermediate list)."""
    quick = Settings(
        redis_url=redis_url, data_dir=tmp_path, queue="attempt-tests", heartbeat_timeout_s=1.2
    )
    job_id = queued_job(records, quick, max_attempts=3)
    waiting = queued_job(records, quick, max_attempts=3)
    assert records.client.lpop(f"rq:queue:{own_queue(quick)}") == job_id.encode()
    assert reap_lost_queued_jobs(records, quick) == []  # a worker may write it any moment
    time.sleep(heartbeat_key_ttl_s(quick.heartbeat_timeout_s) + 0.1)
    assert reap_lost_queued_jobs(records, quick) == [job_id]
    job = records.get_job(TENANT, job_id)
    assert job is not None
    assert "no worker took it on" in job.attempts[0].reason
    assert records.get_job(TENANT, waiting).attempts == []  # type: ignore[union-attr]


def test_one_output_model_per_job(records: Records) -> None:
    assert records.claim_output("job_a", "mdl_1") == "mdl_1"
    assert records.claim_output("job_a", "mdl_2") == "mdl_1"
    records.release_output("job_a")
    assert records.claim_output("job_a", "mdl_3") == "mdl_3"
