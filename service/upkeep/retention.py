"""Finished jobs kept for ``BNADAPT_JOB_RETENTION_S``, then deleted by housekeeping.

A job that ended (succeeded, failed, canceled) longer ago than the retention is deleted like
DELETE /v1/jobs/{id} does: its record, progress, logs, and its uses of store objects (its
report, its inputs), which the store's collector then deletes if nothing else uses them. The
models a job registered are resources of their own and stay. The default is 30 days: until
then an ended job's inputs and training checkpoint count in its tenant's stored bytes (NOTE
[ Tenant quotas ] in service/records/tenancy/quotas.py). Unset (None), jobs are kept until deleted.
"""

from __future__ import annotations

import time
from typing import Final

from service.records.sync import Records

__all__ = ["RETENTION_BATCH", "delete_expired_jobs"]

# Jobs deleted per sweep at most; a backlog goes in later sweeps.
RETENTION_BATCH: Final = 500


def delete_expired_jobs(records: Records, retention_s: float, now: float | None = None) -> int:
    """Deletes jobs that ended more than ``retention_s`` ago; how many."""
    cutoff = (time.time() if now is None else now) - retention_s
    deleted = 0
    for job_id, tenant_id in records.jobs_finished_before(cutoff, RETENTION_BATCH):
        job = records.get_job(tenant_id, job_id)
        if job is not None and job.status.is_terminal:
            records.delete_finished_job(tenant_id, job)
            deleted += 1
    return deleted
