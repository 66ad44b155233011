"""The ``train`` row's runner: compute, then save and register the new model."""

from __future__ import annotations

from api_schemas import JobPayload
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.running.compute import compute
from workers.running.runtime import JobRuntime
from workers.running.saving import mark_succeeded, save_outcome

__all__ = ["run"]


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Runs the job's computation, saves weights and report, registers the new model and
    marks the job succeeded; returns the RQ job's result."""
    with JobRuntime(
        records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
    ) as runtime:
        outcome = compute(job, store, runtime)
        saved = save_outcome(job, outcome, records, store, runtime)
    return mark_succeeded(job, saved, records)
