"""Dataset files that go straight to an S3 store (NOTE [ Direct transfers ]): /v1/direct-uploads
for presigned multipart uploads, /v1/datasets:import for objects already in a bucket. With a local
store both answer 409: upload through POST /v1/datasets."""

from __future__ import annotations

import secrets
import time
from datetime import timedelta
from typing import Final

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from api_schemas import DatasetPublic, utc_now
from api_schemas.uploads import (
    DatasetImport,
    DirectUploadComplete,
    DirectUploadCreate,
    DirectUploadPublic,
)
from service.api.deps import (
    HeavyWorkDep,
    IdPath,
    RecordsDep,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from service.api.problems import ApiError
from service.datasets import imports
from service.datasets.registration import register_dataset
from service.errors import StoreError, StoreTooLargeError
from service.records import keys
from service.records.format import text
from service.records.sync import Records
from service.records.tenancy.quotas import open_upload, release_upload
from service.settings import Settings
from service.store.base import DirectTransfers, DirectUpload, Store

__all__ = ["router"]

# NOTE [ Direct transfers ]
# The API hands out presigned URLs and never sees the bytes: the client PUTs each part to the
# bucket, then asks the API to complete. Completing reads the object once (sha256, size, the
# dataset checks of an upload), installs it under its content key like any write (NOTE
# [ Atomic commit on S3 ] in service/store/s3/store.py) and registers it. An import copies an
# existing object server-side into a temp key and goes on the same way. What the API keeps
# of an upload in progress lives in Redis for the URLs' lifetime. Each presigned part URL signs
# its part's length, so the bucket refuses a PUT of another; and completing first checks the
# parts the bucket holds against the size announced (NOTE [ Direct upload parts ] in
# service/store/s3/store.py), for a store that checks signatures less strictly, and refuses
# with 422, the upload aborted, before anything is assembled or copied. Completing
# and importing read the whole object, so they run in the API's pool for heavy work (NOTE
# [ Heavy work off the request path ] in service/api/offload.py).

router = APIRouter(tags=["direct uploads"])

_UPLOAD_FIELDS: Final = ("tenant_id", "upload_id", "temp_key", "part_bytes", "size", "name")


def _direct(store: Store) -> DirectTransfers:
    if not isinstance(store, DirectTransfers):
        raise ApiError(
            409,
            "direct uploads and imports need an S3 store (BNADAPT_STORE_URL=s3://...); upload "
            "the file through POST /v1/datasets",
        )
    return store


def _register(
    records: Records,
    tenant: str,
    settings: Settings,
    store: Store,
    sha256: str,
    size: int,
    name: str,
    response: Response,
) -> DatasetPublic:
    """Checks and registers the installed object as an upload through POST /v1/datasets is
    (the same rules and limits), and points ``Location`` at it."""
    dataset = register_dataset(tenant, records, store, settings, sha256, size, name)
    response.headers["Location"] = f"/v1/datasets/{dataset.id}"
    return dataset


@router.post("/v1/direct-uploads", status_code=201)
def create_upload(
    body: DirectUploadCreate,
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
) -> DirectUploadPublic:
    """Start a direct upload of a dataset file: PUT each part to its URL, then POST the ETags
    to ``complete_url``."""
    direct = _direct(store)
    if body.size > settings.max_dataset_bytes:
        raise ApiError(
            413,
            f"the dataset file is larger than the limit of {settings.max_dataset_bytes} bytes "
            f"({body.size}); upload a smaller file or raise the limit in the settings",
        )
    # The quotas, before the store starts an upload (NOTE [ Tenant quotas ]).
    records.check_stored_bytes(tenant, body.size, settings.tenant_max_stored_bytes)
    records.check_open_uploads(tenant, settings.tenant_max_open_uploads)
    try:
        upload = direct.start_direct_upload(body.size)
    except StoreError as exc:
        raise ApiError(422, str(exc)) from exc
    upload_id = f"up_{secrets.token_urlsafe(16)}"
    ttl_s = settings.s3_presign_ttl_s
    key = keys.direct_upload(upload_id)
    values = (tenant, upload.upload_id, upload.temp_key, upload.part_bytes, body.size, body.name)

    # Counted open, its size reserved, until its URLs expire or it is completed (NOTE
    # [ Tenant quotas ]): one script with its record.
    open_upload(
        records.client,
        tenant,
        upload_id,
        time.time() + ttl_s,
        settings.tenant_max_open_uploads,
        reserve_bytes=body.size,
        max_stored_bytes=settings.tenant_max_stored_bytes,
        record_key=key,
        fields={
            field: str(value)
            for field, value in zip(_UPLOAD_FIELDS, values, strict=True)
            if value is not None
        },
        ttl_s=ttl_s,
    )
    return DirectUploadPublic(
        id=upload_id,
        part_bytes=upload.part_bytes,
        part_urls=upload.part_urls,
        complete_url=f"/v1/direct-uploads/{upload_id}:complete",
        expires_at=utc_now() + timedelta(seconds=ttl_s),
    )


@router.post("/v1/direct-uploads/{upload_id}:complete", status_code=201)
async def complete_upload(
    upload_id: IdPath,
    body: DirectUploadComplete,
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    heavy: HeavyWorkDep,
    response: Response,
) -> DatasetPublic:
    """Check the uploaded file (size, sha256, the dataset rules) and register it."""
    direct = _direct(store)
    fields = await run_in_threadpool(_claim, records, tenant, upload_id)
    return await heavy.run(
        _finish, direct, records, tenant, settings, store, fields, body.etags, response
    )


def _claim(records: Records, tenant: str, upload_id: str) -> dict[str, str]:
    """The caller's upload in progress, taken: of two completions of one upload, one goes on;
    404 when there is none."""
    fields = {
        text(k): text(v) for k, v in records.client.hgetall(keys.direct_upload(upload_id)).items()
    }
    if fields.get("tenant_id") != tenant or not records.client.delete(
        keys.direct_upload(upload_id)
    ):
        raise ApiError(
            404,
            f"upload {upload_id!r} not found: it was completed, it expired, or it is not "
            "yours; start a new one with POST /v1/direct-uploads",
        )
    # Its reservation ends: the dataset it registers holds its object from then on.
    release_upload(records.client, tenant, upload_id)
    return fields


def _finish(
    direct: DirectTransfers,
    records: Records,
    tenant: str,
    settings: Settings,
    store: Store,
    fields: dict[str, str],
    etags: list[str],
    response: Response,
) -> DatasetPublic:
    upload = DirectUpload(fields["upload_id"], fields["temp_key"], int(fields["part_bytes"]), [])
    try:
        sha256, size = direct.finish_direct_upload(
            upload, etags, settings.max_dataset_bytes, int(fields["size"])
        )
    except StoreTooLargeError as exc:
        raise ApiError(413, str(exc)) from exc
    except StoreError as exc:
        raise ApiError(422, str(exc)) from exc
    if size != int(fields["size"]):
        raise ApiError(
            422,
            f"the upload holds {size} bytes but {fields['size']} were announced; nothing was "
            "registered: start a new upload",
        )
    return _register(
        records, tenant, settings, store, sha256, size, fields.get("name", "dataset"), response
    )


@router.post("/v1/datasets:import", status_code=201, tags=["datasets"])
async def import_dataset(
    body: DatasetImport,
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    heavy: HeavyWorkDep,
    response: Response,
) -> DatasetPublic:
    """Register a dataset from a bucket the operator allowed your tenant to import from
    (``bnadapt tenants allow-import``): an object (``s3://BUCKET/KEY``), copied server-side, or
    a folder of images (``s3://BUCKET/PREFIX/``), streamed into the store as an image tar;
    then checked like an upload. Any source you may not read, or that is not there, is the
    same 404."""
    dataset = await heavy.run(
        imports.import_dataset, tenant, records, store, _direct(store), settings, body
    )
    response.headers["Location"] = f"/v1/datasets/{dataset.id}"
    return dataset
