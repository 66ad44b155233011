"""The ``evaluate`` row's runner: measure, store the report, register nothing."""

from __future__ import annotations

from api_schemas import JobPayload, JobResultLinks, JobStatus
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.errors import JobCanceled
from workers.running.compute import compute_evaluation
from workers.running.runtime import JobRuntime

__all__ = ["run"]


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Evaluates, stores the report and marks the job succeeded; no model is registered."""
    with JobRuntime(
        records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
    ) as runtime:
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
