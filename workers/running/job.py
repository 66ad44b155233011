"""The RQ entry point: ``workers.running.job.run_job(payload)``, enqueued by the API by name.

Thin on purpose: it validates the payload, marks the job running, and calls the runner that
the job-kind table names for the job's kind (NOTE [ The job-kind table ] in
api_schemas/jobs/kinds.py; the runners are in workers/kinds/). A cancel ends the job
canceled, with nothing registered; an exception marks it failed with its message and
propagates to RQ.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Final

import redis
from rq import get_current_job
from rq.timeouts import JobTimeoutException

from api_schemas import ESTIMATORS, JOB_KINDS, JobPayload, JobStatus
from service.public_text import worker_label
from service.records.connection import redis_client
from service.records.sync import Records
from service.settings import Settings, get_settings
from service.store import open_store
from service.store.base import Store
from workers import import_path
from workers.errors import JobCanceled, JobInterrupted
from workers.estimators.dispatch import load_runner
from workers.faults import delay_start
from workers.running.capacity import hold_job_to
from workers.running.failures import failure_message
from workers.running.loading import WORKER_DEVICE_ENV
from workers.running.logs import job_logging

__all__ = ["load_runners", "run_job"]

log = logging.getLogger(__name__)

_LOST_REDIS: Final = (
    "the job's process could not reach Redis for longer than BNADAPT_REDIS_OUTAGE_S and "
    "stopped; check that Redis runs and is reachable from the workers"
)


def _worker_name() -> str:
    """This process as the job's record shows it to its tenant: no hostname."""
    return worker_label(os.getpid())


def run_job(payload: dict[str, Any]) -> dict[str, str]:
    settings = get_settings()
    job = JobPayload.model_validate(payload)
    records = Records(redis_client(settings.redis_url, outage_s=settings.redis_outage_s))
    store = open_store(settings)
    # NOTE [ Activation estimate ] in service/jobs/submission.py: held to the worker's memory.
    hold_job_to(settings.worker_memory_bytes, os.environ.get(WORKER_DEVICE_ENV, "auto"))
    try:
        delay_start()  # the fork window, for tests (workers/faults.py)
        started = records.mark_started(job.job_id, _worker_name())
    except JobTimeoutException as exc:  # its timeout passed before it began: still its own
        records.mark_finished(
            job.job_id,
            JobStatus.FAILED,
            error=failure_message(exc, _timeout_s(job)),
            allowed=(JobStatus.QUEUED, JobStatus.RUNNING),
        )
        raise
    if not started:
        status = records.job_status(job.job_id)
        log.info("job %s not started: it is %s", job.job_id, status)
        return {"job_id": job.job_id, "status": str(status)}
    # The job's copies of store objects stay on this machine while it runs (NOTE [ Pinned
    # copies ] in service/store/cache.py).
    with job_logging(records, job.job_id), store.pinning():  # NOTE [ Job logs ]
        log.info(
            "job %s (%s) started on %s (%s)",
            job.job_id,
            job.kind,
            f"{socket.gethostname()}:{os.getpid()}",
            _worker_name(),
        )
        result = _run_started(job, records, store, settings)
        log.info("job %s ended %s", job.job_id, result.get("status"))
        return result


def _run_started(
    job: JobPayload, records: Records, store: Store, settings: Settings
) -> dict[str, str]:
    try:
        return _runner(JOB_KINDS[job.kind].runner)(job, records, store, settings)
    except JobCanceled:
        if records.cancel_requested(job.job_id):
            records.mark_finished(job.job_id, JobStatus.CANCELED)
            return {"job_id": job.job_id, "status": JobStatus.CANCELED.value}
        # Nobody asked: the job ended elsewhere (kept), or this process lost Redis for longer
        # than BNADAPT_REDIS_OUTAGE_S: an interruption, retried (NOTE [ Job attempts ]).
        status = records.interrupt(job.job_id, (JobStatus.RUNNING,), _LOST_REDIS, _rq_id(job))
        return {"job_id": job.job_id, "status": str(status)}
    except JobInterrupted as exc:
        # A process of the job killed from outside (a rank: workers/training/ranks.py): an
        # interruption, as the job's own process killed would be (NOTE [ Job attempts ]).
        log.warning("job %s interrupted: %s", job.job_id, exc)
        status = records.interrupt(job.job_id, (JobStatus.RUNNING,), str(exc), _rq_id(job))
        return {"job_id": job.job_id, "status": str(status)}
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # Redis stayed away past the retries of every write: not the job's fault. If Redis is
        # still away, the sweep sees the lost heartbeat instead.
        log.warning("job %s lost Redis: %s", job.job_id, exc)
        with contextlib.suppress(redis.RedisError):
            records.interrupt(job.job_id, (JobStatus.RUNNING,), _LOST_REDIS, _rq_id(job))
        raise
    except Exception as exc:
        # The job's own failure (bad data, NaN, out of memory, its timeout, a bug): retrying
        # would fail the same way (workers/running/failures.py).
        log.exception("job %s failed", job.job_id)
        records.mark_finished(
            job.job_id, JobStatus.FAILED, error=failure_message(exc, _timeout_s(job))
        )
        raise


def _timeout_s(job: JobPayload) -> int | None:
    """The seconds this attempt may run, as RQ enforces them."""
    current = get_current_job()
    return int(current.timeout) if current is not None and current.timeout else job.timeout_s


def _rq_id(job: JobPayload) -> str:
    """The RQ id of this attempt (NOTE [ Job attempts ] in service/records/job_life/retries.py)."""
    current = get_current_job()
    return current.id if current is not None else job.job_id


Runner = Callable[[JobPayload, Records, Store, Settings], dict[str, str]]


def _runner(path: str) -> Runner:
    """The function a ``module:function`` path of the job-kind table names."""
    runner: Runner = import_path(path)
    return runner


def load_runners() -> None:
    """Imports every kind's runner and every estimator's, so that forked job processes find
    them (and torch) imported already."""
    for spec in JOB_KINDS.values():
        _runner(spec.runner)
    for estimator in ESTIMATORS.values():
        load_runner(estimator.runner)
