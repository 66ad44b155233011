"""Active-job slots (NOTE [ Tenant quotas ] in service/records/tenancy/quotas.py) on a real
Redis-compatible server: every script that ends a job frees its slot, an interrupted job
that goes back to the queue keeps it, and a slot reserved for a submission whose record never
came lapses after its grace period."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from api_schemas import JobStatus
from service.errors import QuotaExceededError
from service.records import keys
from service.records.connection import redis_client
from service.records.sync import Records
from service.records.tenancy.quotas import reserve_job_slot
from service.settings import Settings
from tests.service.records.test_attempts import TENANT, queued_job


@pytest.fixture
def records(redis_url: str) -> Records:
    return Records(redis_client(redis_url))


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, data_dir=tmp_path, queue="slot-tests")


def active(records: Records) -> float:
    return records.quota_usage(TENANT)["max_active_jobs"]


def test_every_end_of_a_job_frees_its_slot(records: Records, settings: Settings) -> None:
    canceled, retried, failed = (queued_job(records, settings, n) for n in (1, 2, 1))
    assert active(records) == 3
    # Canceled: the transition script.
    records.transition(canceled, (JobStatus.QUEUED,), JobStatus.CANCELED)
    assert active(records) == 2
    # Interrupted with an attempt left: queued again, still active.
    assert records.mark_started(retried, "w1")
    assert records.interrupt(retried, (JobStatus.RUNNING,), "lost") is JobStatus.QUEUED
    assert active(records) == 2
    # Interrupted on its last attempt: failed by the retry policy's script.
    assert records.mark_started(failed, "w1")
    assert records.interrupt(failed, (JobStatus.RUNNING,), "lost") is JobStatus.FAILED
    assert active(records) == 1
    # Succeeded: the transition script again.
    assert records.mark_started(retried, "w2")
    assert records.mark_finished(retried, JobStatus.SUCCEEDED)
    assert active(records) == 0


def test_a_slot_whose_job_was_never_written_lapses(records: Records) -> None:
    reserve_job_slot(records.client, TENANT, "job_crashed", 1, grace_s=0.5)
    with pytest.raises(QuotaExceededError, match="max_active_jobs"):
        reserve_job_slot(records.client, TENANT, "job_next", 1)
    time.sleep(0.7)
    reserve_job_slot(records.client, TENANT, "job_next", 1)
    assert active(records) == 1


def test_the_active_jobs_an_earlier_release_kept_still_count(
    records: Records, settings: Settings
) -> None:
    running, ended = queued_job(records, settings, 1), queued_job(records, settings, 1)
    records.transition(ended, (JobStatus.QUEUED,), JobStatus.CANCELED)
    # As an earlier release left them: a set of ids, read by status.
    records.client.delete(keys.tenant_active_jobs(TENANT))
    records.client.sadd(f"{keys.PREFIX}:tenant:{TENANT}:active-jobs", running, ended)
    with pytest.raises(QuotaExceededError, match="max_active_jobs"):
        reserve_job_slot(records.client, TENANT, "job_next", 1)
    assert active(records) == 1
    assert not records.client.exists(f"{keys.PREFIX}:tenant:{TENANT}:active-jobs")
