"""/v1/jobs: submit (checked, idempotent), list (filtered), show, cancel, delete, report,
logs, and the live events of a job (server-sent events).

One router per resource: every /v1/jobs route is here; its NOTE blocks mark the subtle parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Final

import redis
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import StringConstraints
from rq import Queue

from api_schemas import (
    ID_PATTERN,
    JOB_KINDS,
    AdaptParams,
    DatasetPublic,
    JobCreate,
    JobKind,
    JobPayload,
    JobPayloadDataset,
    JobPayloadModel,
    JobPublic,
    JobStatus,
    ModelPublic,
    Page,
    Progress,
    Report,
    new_id,
    parse_job_create,
    utc_now,
)
from api_schemas.jobs.params import TAG_KEY_PATTERN
from api_schemas.jobs.public import JobLogEntry, JobLogPage
from service.api.deps import (
    AsyncRecordsDep,
    JobDep,
    RecordsDep,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from service.api.problems import ApiError, not_found, refuse_other_methods
from service.api.routes.datasets import with_job_spec
from service.errors import ObjectNotFoundError
from service.records import keys
from service.records.aio import AsyncRecords
from service.records.queue import JOB_FUNCTION, enqueue_run
from service.records.sync import JobFilter, Records
from service.settings import Settings

__all__ = ["JOB_FUNCTION", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

IDEMPOTENCY_TTL_S: Final = 24 * 3600
_IDEMPOTENCY_KEY_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,128}$"


def _shape_fits(expected: list[int | None], got: list[int]) -> bool:
    return len(expected) == len(got) and all(
        e is None or e == g for e, g in zip(expected, got, strict=True)
    )


def _check_fit(request: JobCreate, model: ModelPublic, dataset: DatasetPublic) -> None:
    if not _shape_fits(model.input_shape, dataset.sample_shape):
        wanted = "x".join("any" if d is None else str(d) for d in model.input_shape)
        raise ApiError(
            422,
            f"dataset {dataset.id} has samples of shape {dataset.sample_shape} but model "
            f"{model.id} ({model.architecture}) takes samples of shape [{wanted}]; upload x as "
            f"(N, {', '.join('any' if d is None else str(d) for d in model.input_shape)})",
        )
    if JOB_KINDS[request.kind].needs_labels and not dataset.has_labels:
        raise ApiError(
            422,
            f"{request.kind} jobs need labels but dataset {dataset.id} has no y; upload a "
            "dataset with y (int64 class labels or float targets)",
        )
    loss = getattr(request.params, "loss", None)
    if loss is not None:
        if loss == "cross_entropy" and dataset.label_kind != "class":
            raise ApiError(
                422,
                f"loss cross_entropy needs int64 class labels but dataset {dataset.id} has "
                "float targets; use loss mse, or upload class labels",
            )
        if loss == "mse" and dataset.label_kind != "target":
            raise ApiError(
                422,
                f"loss mse needs float targets but dataset {dataset.id} has int64 class "
                "labels; use loss cross_entropy, or upload float targets",
            )
    params = request.params
    if isinstance(params, AdaptParams) and params.shards > 1:
        batches = params.estimation_batches(dataset.num_samples)
        holdout = params.effective_holdout()
        held = f", holdout {holdout:g} held out of estimation" if holdout > 0 else ""
        if params.shards > batches:
            raise ApiError(
                422,
                f"shards={params.shards} but the job runs only {batches} batches "
                f"({dataset.num_samples} samples of dataset {dataset.id}, batch_size "
                f"{params.batch_size}, max_batches {params.max_batches}{held}) and each shard "
                f"needs at least one whole batch; use shards <= {batches}, or a smaller "
                "batch_size",
            )


def _job_queue(request: Request, settings: Settings, device: str) -> Queue:
    """The queue of a job asking for ``device`` (NOTE [ Queues by device ] in
    service/settings.py)."""
    default: Queue = request.app.state.queue
    name = settings.job_queue(device)
    if name == default.name:
        return default
    return Queue(name, connection=default.connection, serializer="json")


def _waiting(device: str) -> Progress | None:
    """What a job shows until a worker takes it: for a job that asked for a device class,
    that it waits for a worker of that class."""
    device_class = device.partition(":")[0]
    if device_class == "auto":
        return None
    return Progress(
        done=0,
        total=0,
        unit="batches",
        samples_per_second=0.0,
        phase=f"waiting for a {device_class} worker",
        updated_at=utc_now(),
    )


def _body_sha256(request: JobCreate) -> str:
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()


# NOTE [ Idempotency lease ]
# A request with an Idempotency-Key first reserves the key for its new job id with a short
# lease (``idempotency_lease_s``, SET NX), then writes the job, its queue entry and the key's
# 24-hour binding in one MULTI. A retry during the lease answers 409 "retry shortly"; a retry
# after it finds the 24-hour binding and answers the job. If the API process dies between the
# two steps, the lease expires and a retry makes the job anew: a crashed request never blocks
# its key for longer than the lease (it used to block it for the whole 24 hours). The lease
# outlasts the second step by far (a few Redis round trips).


def _existing_for_key(
    records: Records, tenant: str, key: str, body_sha256: str, job_id: str, lease_s: float
) -> JobPublic | None:
    """The job an earlier request with this Idempotency-Key made, or None if this is the first
    request with it (the key is then leased to ``job_id``: NOTE [ Idempotency lease ])."""
    bound_body, bound_job = records.remember_idempotency(tenant, key, body_sha256, job_id, lease_s)
    if bound_body != body_sha256:
        raise ApiError(
            422,
            f"Idempotency-Key {key!r} was already used with a different request body; use a "
            "new key for a different job",
        )
    if bound_job == job_id:
        return None
    job = records.get_job(tenant, bound_job)
    if job is None:
        raise ApiError(
            409,
            f"a request with Idempotency-Key {key!r} is still being processed; retry in "
            f"{lease_s:g} s at most (a request that crashed gives up the key by then)",
            headers={"Retry-After": str(max(1, round(lease_s)))},
        )
    return job


async def _json_body(request: Request) -> Any:
    """The decoded JSON body. The route reads it itself, so that :func:`parse_job_create`
    validates it strictly; the OpenAPI document still shows its schema (``JobCreate``, the
    kinds' union, added by service/api/app.py)."""
    try:
        return await request.json()
    except ValueError as exc:
        raise ApiError(
            422, f"the body is not JSON ({exc}); send a JobCreate object as application/json"
        ) from exc


JOB_CREATE_BODY: Final[dict[str, Any]] = {
    "requestBody": {
        "required": True,
        "description": "AdaptJobCreate, TrainJobCreate or EvaluateJobCreate, chosen by kind",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobCreate"}}},
    }
}


@router.post("", status_code=202, openapi_extra=JOB_CREATE_BODY)
def create_job(
    tenant: TenantDep,
    records: RecordsDep,
    settings: SettingsDep,
    request: Request,
    response: Response,
    body: Annotated[Any, Depends(_json_body)],
    idempotency_key: Annotated[
        str | None, Header(pattern=_IDEMPOTENCY_KEY_PATTERN, alias="Idempotency-Key")
    ] = None,
) -> JobPublic:
    """Submit an ``adapt``, ``train`` or ``evaluate`` job; answers 202 with the job's
    ``Location``. With an ``Idempotency-Key`` header, repeating the same request returns the
    same job."""
    job_request = parse_job_create(body)
    model, dataset = records.get_model_and_dataset(
        tenant, job_request.model_id, job_request.dataset_id
    )
    if model is None:
        raise not_found("model", job_request.model_id)
    if dataset is None:
        raise not_found("dataset", job_request.dataset_id)
    dataset = with_job_spec(dataset, job_request.params.preprocessing)
    _check_fit(job_request, model, dataset)

    job_id = new_id("job")
    if idempotency_key is not None:
        body_sha256 = _body_sha256(job_request)
        existing = _existing_for_key(
            records, tenant, idempotency_key, body_sha256, job_id, settings.idempotency_lease_s
        )
        if existing is not None:
            response.headers["Location"] = f"/v1/jobs/{existing.id}"
            return existing

    job = JobPublic(
        id=job_id,
        kind=job_request.kind,
        status=JobStatus.QUEUED,
        model_id=model.id,
        dataset_id=dataset.id,
        params=job_request.params,
        created_at=utc_now(),
        max_attempts=job_request.max_attempts,
        tags=job_request.tags,
    )
    payload = JobPayload(
        job_id=job_id,
        tenant_id=tenant,
        kind=job_request.kind,
        model=JobPayloadModel(
            id=model.id,
            architecture=model.architecture,
            kwargs=model.kwargs,
            weights_sha256=model.sha256,
        ),
        dataset=JobPayloadDataset(
            id=dataset.id,
            sha256=dataset.sha256,
            format=dataset.format,
            num_samples=dataset.num_samples,
            sample_shape=dataset.sample_shape,
            dtype=dataset.dtype,
            has_labels=dataset.has_labels,
            label_kind=dataset.label_kind,
            num_classes=dataset.num_classes,
            preprocessing=dataset.preprocessing,
        ),
        params=job_request.params,
    )
    queue = _job_queue(request, settings, job_request.params.device)
    waiting = _waiting(job_request.params.device)

    def enqueue(pipe: redis.client.Pipeline) -> None:
        if waiting is not None:
            pipe.set(keys.job_progress(job_id), waiting.model_dump_json())
        enqueue_run(
            queue,
            payload.model_dump(mode="json"),
            job_id,
            settings.job_timeout_s,
            f"{job.kind} {model.id} on {dataset.id}",
            pipeline=pipe,
        )
        if idempotency_key is not None:
            records.bind_idempotency(
                pipe, tenant, idempotency_key, body_sha256, job_id, IDEMPOTENCY_TTL_S
            )

    try:
        records.create_job(
            tenant, job, payload, uses=(model.sha256, dataset.sha256), enqueue=enqueue
        )
    except redis.RedisError:
        # The MULTI wrote all or nothing, but its answer may have been lost: undo it, so that
        # a retry with the same Idempotency-Key makes the job anew.
        with contextlib.suppress(redis.RedisError):
            records.delete_job(tenant, job)
            if idempotency_key is not None:
                records.forget_idempotency(tenant, idempotency_key)
        raise
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    # The progress lives in its own key (written above), not in the record.
    return job if waiting is None else job.model_copy(update={"progress": waiting})


IdQuery = Annotated[str | None, Query(pattern=ID_PATTERN)]
_LIST_PARAMS: Final = frozenset(
    {"page_size", "page_token", "status", "kind", "model_id", "dataset_id", "tag"}
)
_TAG_FILTER_PATTERN: Final = TAG_KEY_PATTERN.removesuffix("$") + r":.{0,256}$"


@router.get("")
def list_jobs(
    tenant: TenantDep,
    records: RecordsDep,
    settings: SettingsDep,
    request: Request,
    page_size: Annotated[int, Query(ge=1, le=1000)] = 50,
    page_token: str | None = None,
    status: JobStatus | None = None,
    kind: JobKind | None = None,
    model_id: IdQuery = None,
    dataset_id: IdQuery = None,
    tag: Annotated[
        list[Annotated[str, StringConstraints(pattern=_TAG_FILTER_PATTERN)]] | None,
        Query(description="key:value; repeat for several (all must match)"),
    ] = None,
) -> Page[JobPublic]:
    """Newest first. Every filter given must match; an unknown query parameter is a 422 (a
    misspelt filter would otherwise list every job)."""
    unknown = sorted(set(request.query_params) - _LIST_PARAMS)
    if unknown:
        raise ApiError(
            422,
            f"unknown query parameter(s) {', '.join(unknown)}; GET /v1/jobs takes "
            f"{', '.join(sorted(_LIST_PARAMS))}",
        )
    where = JobFilter(
        kind=kind,
        status=status,
        model_id=model_id,
        dataset_id=dataset_id,
        tags=dict(t.split(":", 1) for t in tag or []),
    )
    return records.list_jobs(
        tenant, min(page_size, settings.page_size_max), page_token, where=where
    )


refuse_other_methods(router, "/{job_id}:cancel", "POST", "a job's :cancel (POST cancels the job)")


@router.get("/{job_id}")
async def get_job(job: JobDep) -> JobPublic:
    return job


@router.post("/{job_id}:cancel", status_code=202)
def cancel_job(
    job: JobDep, tenant: TenantDep, records: RecordsDep, settings: SettingsDep, request: Request
) -> JobPublic:
    """A queued job is canceled at once; a running one is asked to stop and shows
    ``canceled`` once it has (nothing it was writing is kept)."""
    job_id = job.id
    if job.status is JobStatus.QUEUED and records.mark_finished(
        job_id, JobStatus.CANCELED, allowed=(JobStatus.QUEUED,)
    ):
        # The worker would skip it anyway: its status is canceled.
        _job_queue(request, settings, job.params.device).remove(job_id)
    else:
        job = records.get_job(tenant, job_id) or job
        if job.status.is_terminal:
            raise ApiError(409, f"job {job_id} already {job.status.value}; nothing to cancel")
        records.request_cancel(job_id)
    return records.get_job(tenant, job_id) or job


@router.delete("/{job_id}", status_code=204)
def delete_job(job: JobDep, tenant: TenantDep, records: RecordsDep) -> Response:
    """Deletes an ended job: its record, logs and report (a model it registered stays; delete
    it with DELETE /v1/models/{id}). A queued or running job is a 409: cancel it first."""
    if not job.status.is_terminal:
        raise ApiError(
            409,
            f"job {job.id} is {job.status.value}; cancel it (POST /v1/jobs/{job.id}:cancel) "
            "and delete it once it has ended",
        )
    records.delete_finished_job(tenant, job)
    return Response(status_code=204)


@router.get("/{job_id}/logs")
async def get_logs(
    job: JobDep,
    records: AsyncRecordsDep,
    after: Annotated[int, Query(ge=0, description="only entries with a larger seq")] = 0,
) -> JobLogPage:
    """What the job's processes logged (warnings, a failure's traceback), oldest first; the
    latest few hundred entries are kept. To follow a running job, read
    GET /v1/jobs/{id}/events?logs=true (server-sent events)."""
    entries = [
        JobLogEntry.model_validate_json(line) for line in await records.job_log_lines(job.id)
    ]
    items = [entry for entry in entries if entry.seq > after]
    return JobLogPage(items=items, last_seq=max([after, *(e.seq for e in entries)]))


# NOTE [ Job events ]
# GET /v1/jobs/{id}/events is a server-sent event stream of one job: ``status`` (the whole job,
# whenever its status changes, and first thing), ``progress`` (the Progress: phase, done/total,
# rate, ETA, whenever it changes), ``log`` (each new log entry, with ?logs=true) and ``end``
# (the whole job once it has ended; the stream then closes). The API polls the job's record
# every EVENTS_POLL_S, on the event loop (redis.asyncio), so a watcher costs one Redis round
# trip per poll and no thread; a comment line every EVENTS_KEEPALIVE_S keeps proxies from
# closing a quiet stream. A client that reconnects gets the current state again first.
EVENTS_POLL_S: Final = 0.25
EVENTS_KEEPALIVE_S: Final = 15.0
_EVENT_STREAM: Final[dict[int | str, dict[str, Any]]] = {
    200: {
        "description": "text/event-stream: events status, progress, log and end "
        "(NOTE [ Job events ])",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def _sse(event: str, data: str) -> str:
    return f"event: {event}\ndata: {data}\n\n"


async def _job_events(
    records: AsyncRecords, tenant: str, job_id: str, logs: bool, after: int
) -> AsyncIterator[str]:
    last_status: JobStatus | None = None
    last_progress: str | None = None
    last_seq = after
    last_sent = time.monotonic()
    while True:
        job = await records.get_job(tenant, job_id)
        if job is None:  # deleted meanwhile
            yield _sse("end", json.dumps({"id": job_id, "status": "deleted"}))
            return
        sent: list[str] = []
        if job.status is not last_status:
            sent.append(_sse("status", job.model_dump_json()))
            last_status = job.status
        progress = None if job.progress is None else job.progress.model_dump_json()
        if progress is not None and progress != last_progress:
            sent.append(_sse("progress", progress))
            last_progress = progress
        if logs:
            for line in await records.job_log_lines(job_id):
                entry = JobLogEntry.model_validate_json(line)
                if entry.seq > last_seq:
                    sent.append(_sse("log", entry.model_dump_json()))
                    last_seq = entry.seq
        if job.status.is_terminal:
            sent.append(_sse("end", job.model_dump_json()))
        for item in sent:
            yield item
        if job.status.is_terminal:
            return
        if sent:
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent > EVENTS_KEEPALIVE_S:
            yield ": keepalive\n\n"
            last_sent = time.monotonic()
        await asyncio.sleep(EVENTS_POLL_S)


@router.get("/{job_id}/events", response_class=StreamingResponse, responses=_EVENT_STREAM)
async def job_events(
    job: JobDep,
    tenant: TenantDep,
    records: AsyncRecordsDep,
    logs: Annotated[bool, Query(description="also send the job's log entries")] = False,
    after: Annotated[int, Query(ge=0, description="with logs: entries after this seq")] = 0,
) -> StreamingResponse:
    """The job's live status, progress and (with ``logs``) log entries as server-sent events,
    until it ends (NOTE [ Job events ])."""
    return StreamingResponse(
        _job_events(records, tenant, job.id, logs, after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get(
    "/{job_id}/report",
    # The route streams the stored JSON as it is; the schema is for clients and generators.
    responses={200: {"model": Report, "description": "the job's report"}},
)
def get_report(job: JobDep, records: RecordsDep, store: StoreDep) -> Response:
    """What the job changed: BatchNorm statistics, tensors, metrics, timings (JSON)."""
    job_id = job.id
    sha256 = records.report_sha256(job_id)
    if job.status is not JobStatus.SUCCEEDED or sha256 is None:
        raise ApiError(
            409, f"job {job_id} is {job.status.value}; its report exists once it has succeeded"
        )
    try:
        with store.open(sha256) as file:
            content = file.read()
    except ObjectNotFoundError as exc:
        raise ApiError(404, f"the report of job {job_id} is missing from the store") from exc
    return Response(content, media_type="application/json")
