"""Dependencies the routes declare: settings, records, store, queue and the caller's tenant."""

from __future__ import annotations

import re
from typing import Annotated, Final

from fastapi import Depends, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from rq import Queue

from api_schemas import ID_PATTERN, DatasetPublic, JobPublic, ModelPublic
from service.api.offload import HeavyWork
from service.api.problems import invalid_key, missing_key
from service.errors import ResourceNotFoundError
from service.records.aio import AsyncRecords
from service.records.sync import Records
from service.records.tenancy.quotas import AsyncTenantQuotas
from service.settings import Settings
from service.store.base import Store

__all__ = [
    "AsyncQuotasDep",
    "AsyncRecordsDep",
    "DatasetDep",
    "HeavyWorkDep",
    "IdPath",
    "JobDep",
    "ModelDep",
    "QueueDep",
    "RecordsDep",
    "SettingsDep",
    "StoreDep",
    "TenantDep",
]

_BEARER: Final = re.compile(r"^Bearer\s+(\S+)$", re.IGNORECASE)
# The OpenAPI document's security scheme (Swagger UI's Authorize button); the header itself is
# read below, so that a missing key and a wrong one get their own messages.
_BEARER_SCHEME: Final = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="an API key (`bnadapt keys create`), sent as `Authorization: Bearer <key>`",
)


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_records(request: Request) -> Records:
    records: Records = request.app.state.records
    return records


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_queue(request: Request) -> Queue:
    """The queue of ``auto`` jobs; the others share its connection (service/jobs/queues.py)."""
    queue: Queue = request.app.state.queue
    return queue


async def get_async_records(request: Request) -> AsyncRecords:
    records: AsyncRecords = request.app.state.async_records
    return records


async def get_async_quotas(request: Request) -> AsyncTenantQuotas:
    quotas: AsyncTenantQuotas = request.app.state.async_quotas
    return quotas


SettingsDep = Annotated[Settings, Depends(get_settings)]
RecordsDep = Annotated[Records, Depends(get_records)]
StoreDep = Annotated[Store, Depends(get_store)]
QueueDep = Annotated[Queue, Depends(get_queue)]
AsyncRecordsDep = Annotated[AsyncRecords, Depends(get_async_records)]
AsyncQuotasDep = Annotated[AsyncTenantQuotas, Depends(get_async_quotas)]


def _presented_key(request: Request) -> str | None:
    """The key in the request's ``Authorization: Bearer`` header; raises the 401 when there
    is no such header, None when it is not a bearer key."""
    authorization = request.headers.get("authorization")
    if authorization is None:
        raise missing_key()
    match = _BEARER.match(authorization)
    return match.group(1) if match else None


def _known(tenant_id: str | None, request: Request) -> str:
    """The caller's tenant, kept for the request's other dependencies; the 401 when None."""
    if tenant_id is None:
        raise invalid_key()
    request.state.tenant = tenant_id
    return tenant_id


async def within_rate(request: Request, tenant_id: str) -> None:
    """The tenant's request rate: one token of its bucket per request, shared by every API
    process (NOTE [ Tenant quotas ] in service/records/tenancy/quotas.py); 429 when it is empty. The
    auth dependencies (``get_tenant``, ``owned_job``) call it once the tenant is known, so every
    authenticated route is limited, once a request, with no lookup of its own."""
    if getattr(request.state, "rate_checked", False):
        return
    request.state.rate_checked = True
    settings: Settings = request.app.state.settings
    quotas: AsyncTenantQuotas = request.app.state.async_quotas
    await quotas.take_request_token(
        tenant_id, settings.tenant_rate_per_s, settings.tenant_rate_burst
    )


async def get_tenant(
    request: Request,
    records: AsyncRecordsDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER_SCHEME)],
) -> str:
    known: str | None = getattr(request.state, "tenant", None)
    if known is not None:  # found with the job by owned_job
        await within_rate(request, known)
        return known
    presented = _presented_key(request)
    tenant_id = None if presented is None else await records.tenant_for_key(presented)
    tenant_id = _known(tenant_id, request)
    await within_rate(request, tenant_id)
    return tenant_id


TenantDep = Annotated[str, Depends(get_tenant)]


async def get_heavy_work(request: Request, tenant: TenantDep) -> HeavyWork:
    """Where long copies and hashes run, in the caller's tenant's turns (NOTE [ Heavy work off
    the request path ], NOTE [ Heavy work in turns ] in service/api/offload.py)."""
    heavy_work: HeavyWork = request.app.state.heavy_work
    return heavy_work.for_tenant(tenant)


HeavyWorkDep = Annotated[HeavyWork, Depends(get_heavy_work)]

# Every id in a path: anything else (`abc:cancel`, `../x`) is a 422 before any lookup.
IdPath = Annotated[str, Path(pattern=ID_PATTERN, description="a resource id")]


# The caller's resource named in the path, or the one 404 (missing and another tenant's look
# the same).


def owned_model(model_id: IdPath, tenant: TenantDep, records: RecordsDep) -> ModelPublic:
    model = records.get_model(tenant, model_id)
    if model is None:
        raise ResourceNotFoundError("model", model_id)
    return model


def owned_dataset(dataset_id: IdPath, tenant: TenantDep, records: RecordsDep) -> DatasetPublic:
    dataset = records.get_dataset(tenant, dataset_id)
    if dataset is None:
        raise ResourceNotFoundError("dataset", dataset_id)
    return dataset


async def owned_job(
    request: Request,
    job_id: IdPath,
    records: AsyncRecordsDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER_SCHEME)],
) -> JobPublic:
    """The caller's job: the key and the job read in one round trip when the tenant is not
    known yet (a status poll, the API's most frequent request)."""
    known: str | None = getattr(request.state, "tenant", None)
    if known is not None:
        job = await records.get_job(known, job_id)
    else:
        presented = _presented_key(request)
        tenant_id, job = (
            (None, None) if presented is None else await records.tenant_and_job(presented, job_id)
        )
        known = _known(tenant_id, request)
    await within_rate(request, known)
    if job is None:
        raise ResourceNotFoundError("job", job_id)
    return job


ModelDep = Annotated[ModelPublic, Depends(owned_model)]
DatasetDep = Annotated[DatasetPublic, Depends(owned_dataset)]
JobDep = Annotated[JobPublic, Depends(owned_job)]
