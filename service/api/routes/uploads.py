"""/v1/uploads: resumable uploads of big dataset files, in numbered parts that can be sent
again after a dropped connection, then joined into a dataset.

    POST   /v1/uploads                       {name?}  -> 201 the upload (its id)
    PUT    /v1/uploads/{id}/parts/{number}   raw body -> the part's digest and size
    GET    /v1/uploads/{id}                           -> the parts received so far
    POST   /v1/uploads/{id}:complete         {name?}  -> 201 the dataset
    DELETE /v1/uploads/{id}                           -> 204

Parts are store objects kept while the session lasts (NOTE [ Upload parts in the store ] in
service/records/stored/uploads.py); each is streamed like any upload (NOTE [ Streamed uploads ] in
service/api/transfers.py). Completing joins parts 1..n in order into one store object, checks
it like ``POST /v1/datasets`` and registers it.

# NOTE [ Upload bytes in processes of their own ]
An upload's bytes cost the API processor time (receiving, hashing, writing, joining), and in the
API's own interpreter they slow every other request: threads at a lower priority help (NOTE
[ Bytes at a lower priority ] in service/api/offload.py) but a low-priority thread that holds
the GIL makes the requests wait for it, and another tenant's status reads stay slower during a
flood of large uploads. So an operator may run API processes of their own for these bytes (the
same app, at a lower priority: ``bnadapt up --uploads-nice``, or a service of its own behind the
proxy) and set ``BNADAPT_UPLOADS_URL`` to their base URL on the API: every upload then names it
in ``transfer_url``, and the Python client sends the upload's parts and its completion there,
with the same key (every API process shares Redis and the store, so either answers for any
upload). The status reads during such a flood, with the bytes apart and with them in the main
API: figure `noisy-neighbour-reads` in bench/RESULTS.md
(bench/history/2026-12-07-noisy-neighbour-quiet-machine-every-thread.md). Creating, reading and
deleting an upload stay with the main API; a client that ignores ``transfer_url`` still works.
"""

from __future__ import annotations

import logging
from typing import Annotated, Final

from fastapi import APIRouter, Body, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from api_schemas import DatasetPublic, new_id
from api_schemas.common import ID_PATTERN
from api_schemas.datasets import (
    MAX_UPLOAD_PARTS,
    Preprocessing,
    UploadComplete,
    UploadCreate,
    UploadPart,
    UploadPublic,
)
from service.api.deps import HeavyWorkDep, RecordsDep, SettingsDep, StoreDep, TenantDep
from service.api.problems import ApiError, refuse_other_methods
from service.api.transfers import CHUNK_BYTES, SHA256_HEADER_PARAMETER, store_body, too_large
from service.datasets.registration import DATASET_BYTES_SETTING, register_dataset
from service.errors import ObjectNotFoundError, StoreDigestMismatchError, StoreTooLargeError
from service.records.stored.uploads import UploadRecords, UploadSession
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/uploads", tags=["uploads"])

UploadId = Annotated[str, Path(pattern=ID_PATTERN)]
PartNumber = Annotated[int, Path(ge=1, le=MAX_UPLOAD_PARTS)]
_PART_SETTING: Final = "BNADAPT_MAX_UPLOAD_PART_BYTES"
_PART_BODY: Final = {
    "parameters": [SHA256_HEADER_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
}


def _uploads(records: Records, settings: Settings) -> UploadRecords:
    return UploadRecords(records.client, settings.upload_ttl_s)


def _session(uploads: UploadRecords, tenant: str, upload_id: str) -> UploadSession:
    session = uploads.get(tenant, upload_id)
    if session is None:
        raise ApiError(
            404,
            f"upload {upload_id!r} not found: it was completed, deleted or expired, or belongs "
            "to another key; start one with POST /v1/uploads",
        )
    return session


def _public(session: UploadSession, settings: Settings) -> UploadPublic:
    return UploadPublic(
        id=session.id,
        name=session.name,
        expected_bytes=session.expected_bytes,
        parts=[
            UploadPart(number=n, sha256=sha256, size_bytes=size)
            for n, (sha256, size) in session.parts.items()
        ],
        size_bytes=sum(size for _, size in session.parts.values()),
        max_part_bytes=settings.max_upload_part_bytes,
        created_at=session.created_at,
        expires_at=session.expires_at,
        transfer_url=settings.uploads_url,
    )


@router.post("", status_code=201)
def create_upload(
    tenant: TenantDep,
    records: RecordsDep,
    settings: SettingsDep,
    response: Response,
    request: Annotated[UploadCreate, Body()] = UploadCreate(),  # noqa: B008
) -> UploadPublic:
    """Starts a resumable upload; send its parts next."""
    if request.size_bytes is not None and request.size_bytes > settings.max_dataset_bytes:
        raise too_large("dataset file", settings.max_dataset_bytes, DATASET_BYTES_SETTING)
    if request.size_bytes is not None:
        records.check_stored_bytes(tenant, request.size_bytes, settings.tenant_max_stored_bytes)
    session = _uploads(records, settings).create(
        new_id("up"),
        tenant,
        request.name,
        request.size_bytes,
        settings.tenant_max_open_uploads,
        settings.tenant_max_stored_bytes,
    )
    response.headers["Location"] = f"/v1/uploads/{session.id}"
    return _public(session, settings)


refuse_other_methods(
    router, "/{upload_id}:complete", "POST", "an upload's :complete (POST completes it)"
)


@router.get("/{upload_id}")
def get_upload(
    upload_id: UploadId, tenant: TenantDep, records: RecordsDep, settings: SettingsDep
) -> UploadPublic:
    """The parts received so far: send the missing ones, or those whose digest differs."""
    return _public(_session(_uploads(records, settings), tenant, upload_id), settings)


@router.put("/{upload_id}/parts/{number}", openapi_extra=_PART_BODY)
async def put_part(
    upload_id: UploadId,
    number: PartNumber,
    request: Request,
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    heavy: HeavyWorkDep,
) -> UploadPart:
    """Stores part ``number`` (the raw body), replacing a part of that number sent before."""
    uploads = _uploads(records, settings)
    session = await run_in_threadpool(_session, uploads, tenant, upload_id)
    others = sum(size for n, (_, size) in session.parts.items() if n != number)
    room = settings.max_dataset_bytes - others
    if room <= 0:
        raise too_large("dataset file", settings.max_dataset_bytes, DATASET_BYTES_SETTING)
    if room < settings.max_upload_part_bytes:
        limit, what, setting = room, "dataset file", DATASET_BYTES_SETTING
    else:
        limit, what, setting = settings.max_upload_part_bytes, "upload part", _PART_SETTING
    try:
        part = await store_body(request, store, limit, what, setting, heavy)
    except ApiError as exc:
        if exc.status == 413 and limit == room:
            raise too_large("dataset file", settings.max_dataset_bytes, setting) from exc
        raise
    if not await run_in_threadpool(
        uploads.put_part,
        session,
        number,
        part.sha256,
        part.size,
        settings.tenant_max_stored_bytes,
    ):
        _session(uploads, tenant, upload_id)  # its 404, now that it ended meanwhile
        raise ApiError(
            404,
            f"upload {upload_id!r} ended while part {number} was sent; start one with "
            "POST /v1/uploads",
        )
    return UploadPart(number=number, sha256=part.sha256, size_bytes=part.size)


def _join(
    store: Store, session: UploadSession, max_bytes: int, sha256: str | None
) -> tuple[str, int]:
    """Parts 1..n joined, in order, into one store object."""
    numbers = list(session.parts)
    if not numbers:
        raise ApiError(409, f"upload {session.id} has no parts; send them before completing it")
    missing = sorted(set(range(1, max(numbers) + 1)) - set(numbers))
    if missing:
        raise ApiError(
            409,
            f"upload {session.id} lacks parts {missing[:20]} of 1..{max(numbers)}; send them "
            "(GET the upload to see what arrived), then complete it",
        )
    received = sum(size for _, size in session.parts.values())
    if session.expected_bytes is not None and received != session.expected_bytes:
        raise ApiError(
            409,
            f"upload {session.id} has {received} of the {session.expected_bytes} bytes it "
            "announced; send the missing parts (GET the upload to see what arrived), then "
            "complete it",
        )
    try:
        with store.writer(max_bytes=max_bytes, sha256=sha256) as writer:
            for number in numbers:
                with store.open(session.parts[number][0]) as part:
                    while chunk := part.read(CHUNK_BYTES):
                        writer.write(chunk)
    except ObjectNotFoundError as exc:
        log.warning("upload %s: a part is gone: %s", session.id, exc)
        raise ApiError(
            409,
            f"a part of upload {session.id} is no longer in the store; send the parts again "
            "(GET the upload to see which arrived)",
        ) from exc
    except StoreTooLargeError as exc:
        raise too_large("dataset file", max_bytes, DATASET_BYTES_SETTING) from exc
    except StoreDigestMismatchError as exc:
        raise ApiError(
            422, f"upload {session.id}: {exc} (field sha256); GET the upload to compare parts"
        ) from exc
    return writer.sha256, writer.size


def _complete(
    store: Store,
    records: Records,
    settings: Settings,
    tenant: str,
    upload_id: str,
    name: str | None,
    announced: str | None,
    preprocessing: Preprocessing | None,
) -> DatasetPublic:
    uploads = _uploads(records, settings)
    session = _session(uploads, tenant, upload_id)
    sha256, size = _join(store, session, settings.max_dataset_bytes, announced)
    name = name or session.name or "dataset"
    with uploads.completing(session):  # NOTE [ Tenant quotas ]: its reservation ends
        dataset = register_dataset(
            tenant, records, store, settings, sha256, size, name, preprocessing
        )
    uploads.delete(session)
    return dataset


@router.post("/{upload_id}:complete", status_code=201)
async def complete_upload(
    upload_id: UploadId,
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    heavy: HeavyWorkDep,
    response: Response,
    request: Annotated[UploadComplete, Body()] = UploadComplete(),  # noqa: B008
) -> DatasetPublic:
    """Joins parts 1..n into the dataset file, checks it like ``POST /v1/datasets`` and
    registers it; the upload ends. Refused (422, 413): the upload stays, to be fixed."""
    dataset = await heavy.run(
        _complete,
        store,
        records,
        settings,
        tenant,
        upload_id,
        request.name,
        request.sha256,
        request.preprocessing,
    )
    response.headers["Location"] = f"/v1/datasets/{dataset.id}"
    return dataset


@router.delete("/{upload_id}", status_code=204)
def delete_upload(
    upload_id: UploadId, tenant: TenantDep, records: RecordsDep, settings: SettingsDep
) -> Response:
    """Abandons the upload; its parts are collected from the store after the grace period."""
    uploads = _uploads(records, settings)
    uploads.delete(_session(uploads, tenant, upload_id))
    return Response(status_code=204)
