"""/v1/datasets: upload (validated), list, show, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Response, UploadFile

from api_schemas import DatasetPublic, Page, new_id, utc_now
from service.api.deps import DatasetDep, RecordsDep, SettingsDep, StoreDep, TenantDep
from service.api.problems import ApiError
from service.api.transfers import store_upload
from service.errors import ArrayFileError, ArrayLimitError
from service.formats.arrays import describe_arrays
from service.settings import DEFAULT_MAX_DATASET_BYTES

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

_MULTIPART_SLACK = 1024 * 1024


@router.post("", status_code=201, max_body_size=DEFAULT_MAX_DATASET_BYTES + _MULTIPART_SLACK)
def create_dataset(
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    response: Response,
    file: UploadFile,
    name: Annotated[str | None, Form(min_length=1, max_length=256)] = None,
) -> DatasetPublic:
    """Upload an ``.npz`` (no pickles) or ``.safetensors`` file with ``x`` and optional ``y``.
    It is checked before it is registered: finite values, consistent lengths, at least one
    sample, valid labels."""
    sha256, size = store_upload(store, file.file, settings.max_dataset_bytes, "dataset file")
    try:
        facts = describe_arrays(
            store.local_path(sha256),
            max_elements=settings.max_dataset_elements,
            max_ratio=settings.max_npz_ratio,
        )
    except ArrayLimitError as exc:
        raise ApiError(413, str(exc)) from exc
    except ArrayFileError as exc:
        raise ApiError(422, str(exc)) from exc
    dataset = DatasetPublic(
        id=new_id("ds"),
        name=name or file.filename or "dataset",
        num_samples=facts.num_samples,
        sample_shape=list(facts.sample_shape),
        dtype=facts.dtype,
        has_labels=facts.has_labels,
        label_kind=facts.label_kind,
        num_classes=facts.num_classes,
        sha256=sha256,
        size_bytes=size,
        format=facts.format,
        created_at=utc_now(),
    )
    records.put_dataset(tenant, dataset)
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
