"""Saving a computed adapt or train job, for one worker (workers/running/job.py) and for the merge
of a sharded job (workers/sharding/jobs.py) alike.

Ordering keeps every artifact whole: weights and report are written atomically to the store
first, then the new model is registered, then the job is marked succeeded. A cancel seen before
registering leaves nothing registered; a job the reaper failed meanwhile keeps that verdict and
its model is dropped again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import redis
import safetensors.torch
import torch
from pydantic import BaseModel

from api_schemas import (
    BatchNormLayer,
    JobPayload,
    JobResultLinks,
    JobStatus,
    ModelPublic,
    new_id,
    utc_now,
)
from api_schemas.reports import Report
from service.errors import StoreError
from service.public_text import scrub_internals
from service.records.sync import Records
from service.store.base import Store
from workers.errors import JobCanceled
from workers.models.eval_preprocessing import evaluation_preprocessing
from workers.running.compute import JobOutcome
from workers.running.runtime import JobRuntime

__all__ = [
    "SavedOutcome",
    "StoredWeights",
    "begin_saving",
    "error_message",
    "mark_succeeded",
    "register_output",
    "save_outcome",
    "store_weights",
    "weights_bytes",
]

MAX_ERROR_CHARS: Final = 2000


@dataclass(frozen=True)
class SavedOutcome:
    model: ModelPublic  # registered
    report_sha256: str  # in the store


class StoredWeights(BaseModel):
    """A computed job's weights, already in the store, and what to register them with; the
    merge of a sharded job hands this to the job's finish (as JSON)."""

    sha256: str
    size_bytes: int
    report: Report
    parameter_count: int
    batchnorm_layers: list[BatchNormLayer]
    input_shape: list[int | None]


def weights_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    """``state_dict`` as a safetensors file, the form the store keeps weights in."""
    return safetensors.torch.save({k: v.contiguous() for k, v in state_dict.items()})


def store_weights(outcome: JobOutcome, store: Store) -> StoredWeights:
    weights = weights_bytes(outcome.state_dict)
    return StoredWeights(
        sha256=store.put_bytes(weights),
        size_bytes=len(weights),
        report=outcome.report,
        parameter_count=outcome.parameter_count,
        batchnorm_layers=[BatchNormLayer(**layer) for layer in outcome.batchnorm_layers],
        input_shape=outcome.input_shape,
    )


def save_outcome(
    job: JobPayload, outcome: JobOutcome, records: Records, store: Store, runtime: JobRuntime
) -> SavedOutcome:
    """Writes weights and report to the store, then registers the new model. Raises
    :class:`JobCanceled` before registering anything when the job was asked to stop."""
    begin_saving(job, runtime)
    return register_output(job, store_weights(outcome, store), records, store)


def begin_saving(job: JobPayload, runtime: JobRuntime) -> None:
    """The saving phase of a job that was not asked to stop (its progress keeps the last work
    phase's figures); :class:`JobCanceled` otherwise, before anything is written."""
    if runtime.check_cancel_now():
        raise JobCanceled(f"job {job.job_id} was canceled")
    runtime.enter_saving()


def register_output(
    job: JobPayload, weights: StoredWeights, records: Records, store: Store
) -> SavedOutcome:
    """Writes the report to the store and registers the new model with ``weights``; at most
    one model per job, whatever its attempts: a later attempt reuses the model an earlier one
    registered (NOTE [ Job attempts ] in service/records/job_life/retries.py)."""
    model_id = records.claim_output(job.job_id, new_id("mdl"))
    report = weights.report.model_copy(update={"output_model_id": model_id})
    report_sha256 = store.put_bytes(report.model_dump_json(indent=2).encode())
    model = ModelPublic(
        id=model_id,
        architecture=job.model.architecture,
        kwargs=job.model.kwargs,
        sha256=weights.sha256,
        size_bytes=weights.size_bytes,
        parameter_count=weights.parameter_count,
        batchnorm_layers=weights.batchnorm_layers,
        input_shape=weights.input_shape,
        parent=job.model.id,
        source="job",
        job_id=job.job_id,
        created_at=utc_now(),
        activations=job.model.activations,  # the same architecture and kwargs
        # A job changes weights, never the architecture's evaluation transform.
        preprocessing=evaluation_preprocessing(job.model.architecture, job.model.kwargs),
    )
    records.add_sha_ref(report_sha256, job.job_id)
    registered = records.get_model(job.tenant_id, model_id)
    if registered is not None:
        return SavedOutcome(registered, report_sha256)
    records.put_model(job.tenant_id, model)
    return SavedOutcome(model, report_sha256)


def mark_succeeded(job: JobPayload, saved: SavedOutcome, records: Records) -> dict[str, str]:
    """Marks the job succeeded with links to its output, and returns the RQ job's result."""
    model = saved.model
    links = JobResultLinks(
        model_id=model.id,
        weights_url=f"/v1/models/{model.id}/weights",
        report_url=f"/v1/jobs/{job.job_id}/report",
    )
    if not records.mark_finished(
        job.job_id, JobStatus.SUCCEEDED, result=links, report_sha256=saved.report_sha256
    ):
        # The job ended meanwhile (the reaper gave up on it, or another attempt of it
        # succeeded with this same model), or another attempt of it is due: keep the model
        # unless the job ended without it.
        status = records.job_status(job.job_id)
        if status in (JobStatus.FAILED, JobStatus.CANCELED):
            records.delete_model(job.tenant_id, model)
            records.release_output(job.job_id)
        return {"job_id": job.job_id, "status": str(status)}
    return {"job_id": job.job_id, "status": JobStatus.SUCCEEDED.value, "model_id": model.id}


def error_message(exc: BaseException) -> str:
    """What a failed job's record says, to its tenant: the exception's message without
    hostnames, paths, buckets or addresses, bounded; for a failure of the service's own
    parts (the store, Redis, the system) a sentence that says so, the exception itself being
    in the worker's log (issue 27, point 9; service/public_text.py)."""
    if isinstance(exc, StoreError):
        text = (
            "the artifact store failed to read or write this job's files (the worker's log "
            "has the detail); retry the job, and tell the operator if it persists"
        )
    elif isinstance(exc, redis.RedisError):
        text = "the job's process lost the record store (Redis); retry the job"
    elif isinstance(exc, OSError):
        text = (
            f"the worker hit a system error ({type(exc).__name__}; its log has the detail); "
            "retry the job, and tell the operator if it persists"
        )
    else:
        text = scrub_internals(str(exc) or type(exc).__name__)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " [...]"
