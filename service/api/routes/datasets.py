"""/v1/datasets: upload (streamed, validated), list, show, delete. Resumable uploads of big
files: service/api/routes/uploads.py, which registers through :func:`register_dataset`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api_schemas import DatasetPublic, Page, Preprocessing, new_id, utc_now
from service.api.deps import DatasetDep, RecordsDep, SettingsDep, StoreDep, TenantDep
from service.api.problems import ApiError
from service.api.transfers import SHA256_HEADER_PARAMETER, store_body, store_multipart
from service.errors import ArrayFileError, ArrayLimitError
from service.formats.arrays import describe_arrays
from service.formats.images import describe_tar
from service.formats.sniff import sniff
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store

__all__ = ["DATASET_BYTES_SETTING", "register_dataset", "router", "with_job_spec"]

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

DATASET_BYTES_SETTING: Final = "BNADAPT_MAX_DATASET_BYTES"
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


def register_dataset(
    tenant: str,
    records: Records,
    store: Store,
    settings: Settings,
    sha256: str,
    size: int,
    name: str,
    preprocessing: Preprocessing | None = None,
) -> DatasetPublic:
    """Checks a stored dataset file (arrays, or a tar of images with its ``preprocessing``)
    against every rule, in bounded memory, and registers it; 422 (413 past a limit) naming
    what to fix, and nothing registered, when it breaks one. Blocking: call it from a worker
    thread."""
    path = store.local_path(sha256)
    try:
        if sniff(path)[0] == "tar":
            return _register(
                tenant, records, sha256, size, name, _describe_images(path, preprocessing, settings)
            )
        facts = describe_arrays(
            path,
            max_elements=settings.max_dataset_elements,
            max_classes=settings.max_classes,
            max_ratio=settings.max_npz_ratio,
        )
    except ArrayLimitError as exc:
        raise ApiError(413, str(exc)) from exc
    except ArrayFileError as exc:
        raise ApiError(422, str(exc)) from exc
    shape = list(facts.sample_shape)
    image = facts.dtype == "uint8" and len(shape) == 3  # (C, H, W)
    if preprocessing is not None:
        shape = _preprocessed_shape(facts.dtype, shape, preprocessing)
    dataset = DatasetPublic(
        id=new_id("ds"),
        name=name,
        num_samples=facts.num_samples,
        sample_shape=shape,
        dtype=facts.dtype,
        has_labels=facts.has_labels,
        label_kind=facts.label_kind,
        num_classes=facts.num_classes,
        sha256=sha256,
        size_bytes=size,
        format=facts.format,
        preprocessing=preprocessing,
        image_size=list(facts.sample_shape[1:]) if image else None,
        created_at=utc_now(),
    )
    return _register(tenant, records, sha256, size, name, dataset)


def _describe_images(
    path: Path, preprocessing: Preprocessing | None, settings: Settings
) -> DatasetPublic:
    spec = preprocessing or Preprocessing()
    facts = describe_tar(
        path,
        spec,
        max_pixels=settings.max_image_pixels,
        max_classes=settings.max_classes,
        max_elements=settings.max_dataset_elements,
    )
    return DatasetPublic(
        id=new_id("ds"),
        name="dataset",  # replaced by _register
        num_samples=facts.num_samples,
        sample_shape=list(facts.sample_shape),
        dtype="uint8",
        has_labels=facts.has_labels,
        label_kind="class" if facts.has_labels else None,
        num_classes=facts.num_classes,
        sha256="0" * 64,  # replaced by _register
        size_bytes=0,
        format="tar",
        preprocessing=spec,
        image_size=None if facts.image_size is None else list(facts.image_size),
        created_at=utc_now(),
    )


def with_job_spec(dataset: DatasetPublic, spec: Preprocessing | None) -> DatasetPublic:
    """The dataset as a job with its own preprocessing ``spec`` sees it: that spec, and the
    sample shape after it; 422 when the spec cannot apply to the dataset."""
    if spec is None:
        return dataset
    if dataset.image_size is None or (dataset.format != "tar" and dataset.dtype != "uint8"):
        if dataset.format != "tar":
            raise ApiError(
                422,
                f"dataset {dataset.id} holds no images (uint8 arrays of shape (N, C, H, W)); "
                "send the job without a preprocessing spec",
            )
        if spec.resize is None:
            raise ApiError(
                422,
                f"dataset {dataset.id} holds images of several sizes; a job's preprocessing "
                'spec needs a "resize": [height, width]',
            )
        return dataset.model_copy(
            update={"preprocessing": spec, "sample_shape": spec.output_shape(1, 1)}
        )
    height, width = dataset.image_size
    if dataset.format == "tar":
        crop = spec.center_crop
        if crop is not None and spec.resize is None and (crop[0] > height or crop[1] > width):
            raise ApiError(
                422,
                f"center_crop {crop} is larger than the images of dataset {dataset.id} ({height} "
                f"x {width} pixels); crop less, or resize first",
            )
        shape = spec.output_shape(height, width)
    else:
        # The array's own channels: the registered spec's, or the first dimension of x's samples.
        spec_before = dataset.preprocessing
        channels = dataset.sample_shape[0] if spec_before is None else spec_before.num_channels
        shape = _preprocessed_shape("uint8", [channels, height, width], spec)
    return dataset.model_copy(update={"preprocessing": spec, "sample_shape": shape})


def _preprocessed_shape(dtype: str, shape: list[int], spec: Preprocessing) -> list[int]:
    """A uint8 array's sample shape after ``spec``; 422 when the spec cannot apply to it."""
    if dtype != "uint8" or len(shape) != 3 or shape[0] != spec.num_channels:
        raise ApiError(
            422,
            f"a preprocessing spec applies to uint8 images of shape (N, C, H, W) with C = "
            f"{spec.num_channels} for channels {spec.channels!r}, but x is {dtype} with samples "
            f"of shape {shape}; save x as uint8 (N, C, H, W), or register it without a spec",
        )
    crop = spec.center_crop
    if crop is not None and spec.resize is None and (crop[0] > shape[1] or crop[1] > shape[2]):
        raise ApiError(
            422,
            f"center_crop {crop} is larger than the samples ({shape[1]} x {shape[2]} pixels); "
            "crop less, or resize first",
        )
    return spec.output_shape(shape[1], shape[2])


def _register(
    tenant: str, records: Records, sha256: str, size: int, name: str, dataset: DatasetPublic
) -> DatasetPublic:
    dataset = dataset.model_copy(update={"name": name, "sha256": sha256, "size_bytes": size})
    records.put_dataset(tenant, dataset)
    return dataset


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
    if request.headers.get("content-type", "").startswith("multipart/"):
        upload = await store_multipart(
            request, store, limit, "dataset file", DATASET_BYTES_SETTING, "file"
        )
        name = name or check_name(upload.fields.get("name")) or upload.filename
        preprocessing = preprocessing or upload.fields.get("preprocessing")
    else:
        upload = await store_body(request, store, limit, "dataset file", DATASET_BYTES_SETTING)
    dataset = await run_in_threadpool(
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
