"""/v1/jobs: submit (checked, idempotent), list (filtered), show, cancel, delete, report,
logs, and the live events of a job (server-sent events).

One router per resource: every /v1/jobs route is here; its NOTE blocks mark the subtle parts.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Final

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import StringConstraints

from api_schemas import (
    ID_PATTERN,
    JOB_KINDS,
    JobKind,
    JobPublic,
    JobStatus,
    Page,
    Problem,
    Report,
    parse_job_create,
)
from api_schemas.jobs.params import TAG_KEY_PATTERN
from api_schemas.jobs.public import JobLogEntry, JobLogPage
from service.api.deps import (
    AsyncQuotasDep,
    AsyncRecordsDep,
    JobDep,
    QueueDep,
    RecordsDep,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from service.api.edge import bearer_key
from service.api.problems import ApiError, refuse_other_methods
from service.errors import ObjectNotFoundError
from service.jobs.queues import tenant_queue
from service.jobs.submission import submit_job
from service.records.aio import AsyncRecords
from service.records.job_life.queue import JOB_FUNCTION
from service.records.sync import JobFilter
from service.records.tenancy.quotas import STREAM_LEASE_S, AsyncTenantQuotas

__all__ = ["JOB_FUNCTION", "router"]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_IDEMPOTENCY_KEY_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,128}$"


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


def _one_of(words: list[str]) -> str:
    """The alternatives in a sentence: ``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


# The OpenAPI text that names the kinds is written from the job-kind table (NOTE [ The
# job-kind table ]), so a new kind needs no edit here. The line breaks are those of the
# docstring the description was, which keeps the OpenAPI document as it was.
_FIRST_KIND: Final = next(iter(JOB_KINDS))
_CREATE_JOB_DESCRIPTION: Final = (
    f"Submit {'an' if _FIRST_KIND[0] in 'aeiou' else 'a'} "
    f"{_one_of([f'``{kind}``' for kind in JOB_KINDS])} job; answers 202 with the job's\n"
    "``Location``. With an ``Idempotency-Key`` header, repeating the same request returns the\n"
    "same job."
)
JOB_CREATE_BODY: Final[dict[str, Any]] = {
    "requestBody": {
        "required": True,
        "description": (
            f"{_one_of([spec.create.__name__ for spec in JOB_KINDS.values()])}, chosen by kind"
        ),
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobCreate"}}},
    }
}


@router.post(
    "", status_code=202, description=_CREATE_JOB_DESCRIPTION, openapi_extra=JOB_CREATE_BODY
)
def create_job(
    tenant: TenantDep,
    records: RecordsDep,
    settings: SettingsDep,
    queue: QueueDep,
    response: Response,
    body: Annotated[Any, Depends(_json_body)],
    idempotency_key: Annotated[
        str | None, Header(pattern=_IDEMPOTENCY_KEY_PATTERN, alias="Idempotency-Key")
    ] = None,
) -> JobPublic:
    # The description is _CREATE_JOB_DESCRIPTION; the work is service/jobs/submission.py.
    job = submit_job(records, settings, queue, tenant, parse_job_create(body), idempotency_key)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job


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
    job: JobDep, tenant: TenantDep, records: RecordsDep, settings: SettingsDep, queue: QueueDep
) -> JobPublic:
    """A queued job is canceled at once; a running one is asked to stop and shows
    ``canceled`` once it has (nothing it was writing is kept)."""
    job_id = job.id
    if job.status is JobStatus.QUEUED and records.mark_finished(
        job_id, JobStatus.CANCELED, allowed=(JobStatus.QUEUED,)
    ):
        # The worker would skip it anyway: its status is canceled.
        tenant_queue(queue, settings, job.params.device, tenant, job.priority).remove(job_id)
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
# rate, ETA, whenever it changes), ``epoch`` (a train job's EpochEvent, once an epoch is
# validated, in epoch order: the numbers of the report's ``epochs``; a client that reconnects
# gets the epochs so far again), ``log`` (each new log entry, with ?logs=true) and ``end``
# (the whole job once it has ended; the stream then closes). The API polls the job's record
# every EVENTS_POLL_S, on the event loop (redis.asyncio), so a watcher costs one Redis round
# trip per poll and no thread; a comment line every EVENTS_KEEPALIVE_S keeps proxies from
# closing a quiet stream. A client that reconnects gets the current state again first. Each
# poll reads the caller's API key with the job (the same round trip): once the key is revoked
# the stream sends ``error`` (a problem body, status 401) and closes, as any request with that
# key would be refused.
EVENTS_POLL_S: Final = 0.25
EVENTS_KEEPALIVE_S: Final = 15.0
_EVENT_STREAM: Final[dict[int | str, dict[str, Any]]] = {
    200: {
        "description": "text/event-stream: events status (a JobPublic), progress (a "
        "Progress), epoch (an EpochEvent: a train job's epoch, once validated, in epoch "
        "order), log (a JobLogEntry, with logs=true) and end (a JobPublic); each event's data "
        "is one JSON document",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def _sse(event: str, data: str) -> str:
    return f"event: {event}\ndata: {data}\n\n"


_REVOKED: Final = Problem(
    title="Unauthorized",
    status=401,
    detail="the API key of this stream was revoked; the stream ends (use a valid key)",
).model_dump_json(exclude_none=True)


async def _job_events(
    records: AsyncRecords,
    quotas: AsyncTenantQuotas,
    key: str,
    tenant: str,
    job_id: str,
    logs: bool,
    after: int,
    lease_id: str,
) -> AsyncIterator[str]:
    """The stream, holding the lease ``lease_id`` on one of the tenant's streams: renewed while
    it runs, given back when it ends, however it ends (NOTE [ Tenant quotas ])."""
    try:
        async for item in _job_event_items(
            records, quotas, key, tenant, job_id, logs, after, lease_id
        ):
            yield item
    finally:
        # The client may be gone and this task cancelled: give the lease back all the same.
        with anyio.CancelScope(shield=True):
            await quotas.close_stream(tenant, lease_id)


async def _job_event_items(
    records: AsyncRecords,
    quotas: AsyncTenantQuotas,
    key: str,
    tenant: str,
    job_id: str,
    logs: bool,
    after: int,
    lease_id: str,
) -> AsyncIterator[str]:
    last_status: JobStatus | None = None
    renewed = time.monotonic()
    last_progress: str | None = None
    last_seq = after
    last_epoch = 0
    last_sent = time.monotonic()
    while True:
        key_tenant, job = await records.tenant_and_job(key, job_id)
        if key_tenant != tenant:  # the key was revoked meanwhile
            yield _sse("error", _REVOKED)
            return
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
        if job.kind == "train":
            for epoch, body in await records.job_epochs(job_id):
                if epoch > last_epoch:
                    sent.append(_sse("epoch", body.decode()))
                    last_epoch = epoch
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
        if time.monotonic() - renewed > STREAM_LEASE_S / 3:
            await quotas.renew_stream(tenant, lease_id)
            renewed = time.monotonic()
        await asyncio.sleep(EVENTS_POLL_S)


@router.get("/{job_id}/events", response_class=StreamingResponse, responses=_EVENT_STREAM)
async def job_events(
    job: JobDep,
    tenant: TenantDep,
    records: AsyncRecordsDep,
    request: Request,
    quotas: AsyncQuotasDep,
    settings: SettingsDep,
    logs: Annotated[bool, Query(description="also send the job's log entries")] = False,
    after: Annotated[int, Query(ge=0, description="with logs: entries after this seq")] = 0,
) -> StreamingResponse:
    """The job's live status, progress and (with ``logs``) log entries as server-sent events,
    until it ends (NOTE [ Job events ]). A tenant has at most ``BNADAPT_TENANT_MAX_STREAMS``
    open at once; one more is a 429."""
    key = bearer_key(request.headers.get("authorization")) or ""  # checked by JobDep
    lease_id = secrets.token_hex(8)
    await quotas.open_stream(tenant, lease_id, settings.tenant_max_streams)
    return StreamingResponse(
        _job_events(records, quotas, key, tenant, job.id, logs, after, lease_id),
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
