"""GET /v1/architectures: what can be registered."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas import ArchitecturePublic
from service.api.deps import RecordsDep, TenantDep
from service.api.inspection import published_architectures

router = APIRouter(prefix="/v1/architectures", tags=["architectures"])


@router.get("")
def list_architectures(tenant: TenantDep, records: RecordsDep) -> list[ArchitecturePublic]:
    """The architectures the running workers can build, with their kwargs and input shape."""
    return published_architectures(records.client)
