"""The RQ entry point: ``workers.jobs.run_job(payload)``, enqueued by the API by name.

Thin on purpose: it validates the payload, moves the job record through its life cycle, runs
:func:`workers.compute.compute`, and stores the results (workers/saving.py: weights and report
to the store first, then the new model, then the job marked succeeded). A cancel seen before
registering leaves nothing registered; an exception marks the job failed with its message and
propagates to RQ. An ``evaluate`` job writes its report only and registers no model. An adapt
job with ``shards > 1`` only enqueues its shards and their merge here (workers/shard_jobs.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any, Final

import redis
from rq import get_current_job

from api_schemas import (
    AdaptParams,
    EvaluateParams,
    JobPayload,
    JobResultLinks,
    JobStatus,
)
from service.records import Records
from service.redis_conn import redis_client
from service.settings import get_settings
from service.store import LocalStore
from workers.compute import compute, compute_evaluation
from workers.errors import JobCanceled
from workers.runtime import JobRuntime
from workers.saving import error_message, mark_succeeded, save_outcome
from workers.shard_jobs import start_shards

__all__ = ["run_job"]

log = logging.getLogger(__name__)

_LOST_REDIS: Final = (
    "the job's process could not reach Redis for longer than BNADAPT_REDIS_OUTAGE_S and "
    "stopped; check that Redis runs and is reachable from the workers"
)
# Fault injection, for tests only: seconds a job's process waits between RQ's fork and marking
# the job running, so that a test can kill it in that window (tests/test_reliability.py).
FAULT_START_DELAY_ENV: Final = "BNADAPT_FAULT_START_DELAY_S"


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_job(payload: dict[str, Any]) -> dict[str, str]:
    settings = get_settings()
    job = JobPayload.model_validate(payload)
    records = Records(redis_client(settings.redis_url, outage_s=settings.redis_outage_s))
    store = LocalStore(settings.store_path)
    if delay := os.environ.get(FAULT_START_DELAY_ENV):
        time.sleep(float(delay))
    if not records.mark_started(job.job_id, _worker_name()):
        status = records.job_status(job.job_id)
        log.info("job %s not started: it is %s", job.job_id, status)
        return {"job_id": job.job_id, "status": str(status)}
    try:
        if isinstance(job.params, EvaluateParams):
            return _run_evaluation(
                job, records, store, settings.heartbeat_timeout_s, settings.redis_outage_s
            )
        with JobRuntime(
            records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
        ) as runtime:
            if isinstance(job.params, AdaptParams) and job.params.shards > 1:
                # Returns once the shards are queued: waiting here for them could deadlock.
                return start_shards(job, records, store, runtime, settings)
            outcome = compute(job, store, runtime)
            saved = save_outcome(job, outcome, records, store, runtime)
        return mark_succeeded(job, saved, records)
    except JobCanceled:
        if records.cancel_requested(job.job_id):
            records.mark_finished(job.job_id, JobStatus.CANCELED)
            return {"job_id": job.job_id, "status": JobStatus.CANCELED.value}
        # Nobody asked: the job ended elsewhere (kept), or this process lost Redis for longer
        # than BNADAPT_REDIS_OUTAGE_S: an interruption, retried (NOTE [ Job attempts ]).
        status = records.interrupt(job.job_id, (JobStatus.RUNNING,), _LOST_REDIS, _rq_id(job))
        return {"job_id": job.job_id, "status": str(status)}
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # Redis stayed away past the retries of every write: not the job's fault. If Redis is
        # still away, the sweep sees the lost heartbeat instead.
        with contextlib.suppress(redis.RedisError):
            records.interrupt(
                job.job_id, (JobStatus.RUNNING,), f"{_LOST_REDIS} ({exc})", _rq_id(job)
            )
        raise
    except Exception as exc:
        # The job's own failure (bad data, NaN, a bug): retrying would fail the same way.
        records.mark_finished(job.job_id, JobStatus.FAILED, error=error_message(exc))
        raise


def _rq_id(job: JobPayload) -> str:
    """The RQ id of this attempt (NOTE [ Job attempts ] in service/records.py)."""
    current = get_current_job()
    return current.id if current is not None else job.job_id


def _run_evaluation(
    job: JobPayload,
    records: Records,
    store: LocalStore,
    heartbeat_timeout_s: float,
    redis_outage_s: float,
) -> dict[str, str]:
    """Evaluates, stores the report and marks the job succeeded; no model is registered."""
    with JobRuntime(records, job.job_id, heartbeat_timeout_s, redis_outage_s) as runtime:
        report = compute_evaluation(job, store, runtime)
        if runtime.check_cancel_now():
            raise JobCanceled(f"job {job.job_id} was canceled")
        report_sha256 = store.put_bytes(report.model_dump_json(indent=2).encode())
        records.add_sha_ref(report_sha256, job.job_id)
    # Marked once the runtime has stopped: it would take the new status for a verdict from
    # elsewhere. If the reaper gave up on the job meanwhile, its verdict stands.
    links = JobResultLinks(
        model_id=None, weights_url=None, report_url=f"/v1/jobs/{job.job_id}/report"
    )
    records.mark_finished(
        job.job_id, JobStatus.SUCCEEDED, result=links, report_sha256=report_sha256
    )
    return {"job_id": job.job_id, "status": str(records.job_status(job.job_id))}
