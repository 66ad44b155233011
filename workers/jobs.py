"""The RQ entry point: ``workers.jobs.run_job(payload)``, enqueued by the API by name.

Thin on purpose: it validates the payload, moves the job record through its life cycle, runs
:func:`workers.compute.compute`, and stores the results. Ordering keeps every artifact whole:
weights and report are written atomically to the store first, then the new model is
registered, then the job is marked succeeded. A cancel seen before registering leaves nothing
registered; an exception marks the job failed with its message and propagates to RQ.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from api_schemas import (
    BatchNormLayer,
    JobPayload,
    JobResultLinks,
    JobStatus,
    ModelPublic,
    new_id,
    utc_now,
)
from service.records import Records
from service.redis_conn import redis_client
from service.settings import get_settings
from service.store import LocalStore
from workers.compute import compute, weights_bytes
from workers.errors import JobCanceled
from workers.runtime import JobRuntime

__all__ = ["run_job"]

log = logging.getLogger(__name__)


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_job(payload: dict[str, Any]) -> dict[str, str]:
    settings = get_settings()
    job = JobPayload.model_validate(payload)
    records = Records(redis_client(settings.redis_url))
    store = LocalStore(settings.store_path)
    if not records.mark_started(job.job_id, _worker_name()):
        status = records.job_status(job.job_id)
        log.info("job %s not started: it is %s", job.job_id, status)
        return {"job_id": job.job_id, "status": str(status)}
    try:
        with JobRuntime(records, job.job_id, settings.heartbeat_timeout_s) as runtime:
            outcome = compute(job, store, runtime)
            if runtime.check_cancel_now():
                raise JobCanceled(f"job {job.job_id} was canceled")
            runtime.start_phase("saving", 1, "batches", 0.0)
            weights = weights_bytes(outcome.state_dict)
            weights_sha256 = store.put_bytes(weights)
            model_id = new_id("mdl")
            report = outcome.report.model_copy(update={"output_model_id": model_id})
            report_sha256 = store.put_bytes(report.model_dump_json(indent=2).encode())
            model = ModelPublic(
                id=model_id,
                architecture=job.model.architecture,
                kwargs=job.model.kwargs,
                sha256=weights_sha256,
                size_bytes=len(weights),
                parameter_count=outcome.parameter_count,
                batchnorm_layers=[BatchNormLayer(**layer) for layer in outcome.batchnorm_layers],
                input_shape=outcome.input_shape,
                parent=job.model.id,
                source="job",
                job_id=job.job_id,
                created_at=utc_now(),
            )
            records.add_sha_ref(report_sha256, job.job_id)
            records.put_model(job.tenant_id, model)
            runtime.report(1)
        links = JobResultLinks(
            model_id=model_id,
            weights_url=f"/v1/models/{model_id}/weights",
            report_url=f"/v1/jobs/{job.job_id}/report",
        )
        if not records.mark_finished(
            job.job_id, JobStatus.SUCCEEDED, result=links, report_sha256=report_sha256
        ):
            # The reaper gave up on this job meanwhile: keep its verdict, drop the output.
            records.delete_model(job.tenant_id, model)
            return {"job_id": job.job_id, "status": str(records.job_status(job.job_id))}
    except JobCanceled:
        records.mark_finished(job.job_id, JobStatus.CANCELED)
        return {"job_id": job.job_id, "status": JobStatus.CANCELED.value}
    except Exception as exc:
        records.mark_finished(job.job_id, JobStatus.FAILED, error=_message(exc))
        raise
    return {"job_id": job.job_id, "status": JobStatus.SUCCEEDED.value, "model_id": model_id}


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + " [...]"
