"""/v1/datasets: upload (streamed, validated), list, show, delete. Resumable uploads of big
files: service/api/routes/uploads.py. Every upload path registers through
:func:`service.datasets.registration.register_dataset`."""

from __future__ import annotations

from typing import Annotated, Any, Final

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api_schemas import DatasetPublic, Page, Preprocessing
from service.api.deps import (
    DatasetDep,
    HeavyWorkDep,
    RecordsDep,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from service.api.problems import ApiError
from service.api.transfers import SHA256_HEADER_PARAMETER, store_body, store_multipart
from service.datasets.registration import DATASET_BYTES_SETTING, register_dataset

__all__ = ["router"]

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

_NAME_MAX: Final = 256

# The body is read by the route itself (NOTE [ Streamed uploads ] in service/api/transfers.py),
# so OpenAPI learns its two forms here.
_UPLOAD_BODY: Final[dict[str, Any]] = {
    "parameters": [SHA256_HEADER_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "name": {"type": "string", "minLength": 1, "maxLength": _NAME_MAX},
                        "preprocessing": {
                            "type": "string",
                            "description": "a Preprocessing spec as JSON (docs/datasets.md)",
                        },
                    },
                }
            },
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
}


def parse_preprocessing(text: str | None) -> Preprocessing | None:
    """A preprocessing spec sent as JSON text (a query parameter or a form field)."""
    if text is None:
        return None
    try:
        return Preprocessing.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'preprocessing'}: {e['msg']}"
            for e in exc.errors()
        )
        raise ApiError(422, f"the preprocessing spec is invalid: {problems}") from exc


def check_name(name: str | None) -> str | None:
    if name is not None and not 1 <= len(name) <= _NAME_MAX:
        raise ApiError(422, f"the dataset name must have 1 to {_NAME_MAX} characters")
    return name


@router.post("", status_code=201, openapi_extra=_UPLOAD_BODY)
async def create_dataset(
    request: Request,
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    heavy: HeavyWorkDep,
    response: Response,
    name: Annotated[str | None, Query(min_length=1, max_length=_NAME_MAX)] = None,
    preprocessing: Annotated[str | None, Query(max_length=4096)] = None,
) -> DatasetPublic:
    """Upload an ``.npz`` (no pickles) or ``.safetensors`` file with ``x`` and optional ``y``,
    as the form field ``file`` (multipart, with an optional field ``name``) or as the raw body
    (``application/octet-stream``, ``?name=``). Or a tar of images (WebDataset style,
    docs/datasets.md) with an optional ``preprocessing`` spec as JSON (form field or query);
    a spec may also come with a uint8 (N, C, H, W) array dataset. It is stored as it arrives
    and checked before it is registered: finite values, consistent lengths, at least one
    sample, valid labels, readable image headers. For big files use the resumable
    ``/v1/uploads``."""
    limit = settings.max_dataset_bytes
    # Refused before the body is read when nothing more fits (NOTE [ Tenant quotas ]).
    await run_in_threadpool(records.check_stored_bytes, tenant, 1, settings.tenant_max_stored_bytes)
    if request.headers.get("content-type", "").startswith("multipart/"):
        upload = await store_multipart(
            request, store, limit, "dataset file", DATASET_BYTES_SETTING, "file", heavy
        )
        name = name or check_name(upload.fields.get("name")) or upload.filename
        preprocessing = preprocessing or upload.fields.get("preprocessing")
    else:
        upload = await store_body(
            request, store, limit, "dataset file", DATASET_BYTES_SETTING, heavy
        )
    dataset = await heavy.run(
        register_dataset,
        tenant,
        records,
        store,
        settings,
        upload.sha256,
        upload.size,
        (name or "dataset")[:_NAME_MAX],
        parse_preprocessing(preprocessing),
    )
    response.headers["Location"] = f"/v1/datasets/{dataset.id}"
    return dataset


@router.get("")
def list_datasets(
    tenant: TenantDep,
    records: RecordsDep,
    settings: SettingsDep,
    page_size: Annotated[int, Query(ge=1, le=1000)] = 50,
    page_token: str | None = None,
) -> Page[DatasetPublic]:
    return records.list_datasets(tenant, min(page_size, settings.page_size_max), page_token)


@router.get("/{dataset_id}")
def get_dataset(dataset: DatasetDep) -> DatasetPublic:
    return dataset


@router.delete("/{dataset_id}", status_code=204)
def delete_dataset(dataset: DatasetDep, tenant: TenantDep, records: RecordsDep) -> Response:
    """Deletes the dataset. Its file stays in the store while jobs or other datasets use the
    same bytes; otherwise the store's collector removes it after the grace period."""
    records.delete_dataset(tenant, dataset)
    return Response(status_code=204)
