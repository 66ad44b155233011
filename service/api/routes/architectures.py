"""GET /v1/architectures: what can be registered."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api_schemas import ArchitecturePublic
from service.api.deps import RecordsDep, TenantDep
from service.api.inspection import published_catalog

router = APIRouter(prefix="/v1/architectures", tags=["architectures"])


@router.get("", response_model=list[ArchitecturePublic])
def list_architectures(tenant: TenantDep, records: RecordsDep) -> Response:
    """The architectures the running workers can build, with their kwargs and input shape."""
    # Validated by the inspector that published it; parsing some 1,450 entries again on every
    # request took longer than the rest of the request.
    return Response(published_catalog(records.client), media_type="application/json")
