"""/v1/models: register (upload or initialize), list, show, download weights, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Header, Query, Response, UploadFile
from fastapi.responses import RedirectResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api_schemas import ModelCreate, ModelPublic, Page, new_id, utc_now
from api_schemas.inspection import InspectRequest, InspectSuccess
from service.api.deps import (
    AsyncRecordsDep,
    HeavyWorkDep,
    ModelDep,
    RecordsDep,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from service.api.inspection import inspect_model, new_request_id
from service.api.problems import ApiError, problem_items
from service.api.transfers import store_upload, stream_object
from service.errors import WeightsFileError
from service.formats.weights import read_weights_header
from service.public_text import scrub_internals
from service.records.sync import Records
from service.settings import DEFAULT_MAX_WEIGHTS_BYTES, Settings
from service.store.base import Store

router = APIRouter(prefix="/v1/models", tags=["models"])

# The route-level body limit is fixed when the app is built; the setting (checked while
# streaming) can only be lower. Multipart framing and the meta field get 1 MiB on top.
_MULTIPART_SLACK = 1024 * 1024


def _parse_meta(meta: str) -> ModelCreate:
    try:
        return ModelCreate.model_validate_json(meta, strict=True)  # no "0" for 0
    except ValidationError as exc:
        items = problem_items(exc.errors())
        for item in items:
            item.loc = ["meta", *item.loc]
        raise ApiError(
            422,
            "the form field 'meta' must be a JSON object like "
            '{"architecture": "digits_cnn", "kwargs": {}, "seed": 0}: '
            + "; ".join(f"{'.'.join(map(str, i.loc))}: {i.msg}" for i in items),
            errors=items,
        ) from exc


def _store_weights(store: Store, weights: UploadFile, settings: Settings) -> str:
    """Copies the uploaded weights into the store and checks their header; their sha256.
    Blocking and as long as the file: run in the API's pool for heavy work (NOTE [ Heavy work
    off the request path ] in service/api/offload.py)."""
    sha256, _ = store_upload(store, weights.file, settings.max_weights_bytes, "weights file")
    try:
        read_weights_header(store.local_path(sha256))
    except WeightsFileError as exc:
        raise ApiError(422, scrub_internals(str(exc)), errors=None) from exc
    return sha256


@router.post("", status_code=201, max_body_size=DEFAULT_MAX_WEIGHTS_BYTES + _MULTIPART_SLACK)
async def create_model(
    tenant: TenantDep,
    records: RecordsDep,
    store: StoreDep,
    settings: SettingsDep,
    heavy: HeavyWorkDep,
    async_records: AsyncRecordsDep,
    response: Response,
    meta: Annotated[str, Form(description="ModelCreate as JSON")],
    weights: UploadFile | None = None,
) -> ModelPublic:
    """Register a model: an architecture, its kwargs and safetensors weights that load into it
    with strict=True; without weights, it is initialized with ``seed``."""
    create = _parse_meta(meta)
    await run_in_threadpool(records.check_stored_bytes, tenant, 1, settings.tenant_max_stored_bytes)
    sha256: str | None = None
    if weights is not None:
        sha256 = await heavy.run(_store_weights, store, weights, settings)
    # A worker's inspector checks the model; the wait holds no thread.
    request = InspectRequest(
        request_id=new_request_id(),
        architecture=create.architecture,
        kwargs=create.kwargs,
        weights_sha256=sha256,
        seed=create.seed,
    )
    found = await inspect_model(async_records.client, tenant, request, settings.inspect_timeout_s)
    uploaded = sha256 is not None
    return await run_in_threadpool(
        _register, tenant, records, settings, response, create, found, uploaded
    )


def _register(
    tenant: str,
    records: Records,
    settings: Settings,
    response: Response,
    create: ModelCreate,
    found: InspectSuccess,
    uploaded: bool,
) -> ModelPublic:
    """Registers the model the inspector found."""
    model = ModelPublic(
        id=new_id("mdl"),
        architecture=create.architecture,
        kwargs=create.kwargs,
        sha256=found.weights_sha256,
        size_bytes=found.size_bytes,
        parameter_count=found.parameter_count,
        batchnorm_layers=found.batchnorm_layers,
        input_shape=found.input_shape,
        parent=None,
        source="upload" if uploaded else "init",
        created_at=utc_now(),
        activations=found.activations,
        preprocessing=found.preprocessing,
        renamed_keys=found.renamed_keys,
    )
    records.put_model(tenant, model, settings.tenant_max_stored_bytes)
    response.headers["Location"] = f"/v1/models/{model.id}"
    return model


@router.get("")
def list_models(
    tenant: TenantDep,
    records: RecordsDep,
    settings: SettingsDep,
    page_size: Annotated[int, Query(ge=1, le=1000)] = 50,
    page_token: str | None = None,
) -> Page[ModelPublic]:
    return records.list_models(tenant, min(page_size, settings.page_size_max), page_token)


@router.get("/{model_id}")
def get_model(model: ModelDep) -> ModelPublic:
    return model


@router.get(
    "/{model_id}/weights",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        307: {"description": "the weights at a short-lived URL of the store (S3)"},
    },
)
def download_weights(
    model: ModelDep,
    store: StoreDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The weights as a safetensors file; the ETag is their sha256. With an S3 store the
    answer is a 307 to a presigned URL valid for ``BNADAPT_S3_PRESIGN_TTL_S``: the bytes go
    from the bucket to the client, not through the API."""
    etag = f'"{model.sha256}"'
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers={"ETag": etag})
    direct = store.download_url(model.sha256, f"{model.id}.safetensors")
    if direct is not None:
        return RedirectResponse(direct, status_code=307, headers={"ETag": etag})
    return StreamingResponse(
        stream_object(store, model.sha256),
        media_type="application/octet-stream",
        headers={
            "ETag": etag,
            "Content-Disposition": f'attachment; filename="{model.id}.safetensors"',
        },
    )


@router.delete("/{model_id}", status_code=204)
def delete_model(model: ModelDep, tenant: TenantDep, records: RecordsDep) -> Response:
    """Deletes the model. Its weights stay in the store while jobs or other models use the
    same bytes; otherwise the store's collector removes them after the grace period."""
    records.delete_model(tenant, model)
    return Response(status_code=204)
