"""Tenants' models (``keys.record("model", id)``, the layout of
service/records/stored/resources.py); each holds a use of its weights in the store
(service/records/stored/store_refs.py)."""

from __future__ import annotations

from api_schemas import ModelPublic, Page
from service.records.stored.resources import TenantResources

__all__ = ["ModelRecords"]


class ModelRecords(TenantResources):
    """A tenant's models: written, read, listed newest first, deleted."""

    def put_model(
        self, tenant_id: str, model: ModelPublic, max_stored_bytes: float | None = None
    ) -> None:
        """With ``max_stored_bytes``: only within the tenant's stored-bytes quota (NOTE
        [ Tenant quotas ] in service/records/tenancy/quotas.py)."""
        self._put_stored(tenant_id, "model", model, max_stored_bytes)

    def get_model(self, tenant_id: str, model_id: str) -> ModelPublic | None:
        return self._get(tenant_id, "model", model_id, ModelPublic)

    def list_models(self, tenant_id: str, page_size: int, token: str | None) -> Page[ModelPublic]:
        return self._list(tenant_id, "model", ModelPublic, page_size, token)

    def delete_model(self, tenant_id: str, model: ModelPublic) -> None:
        """Deletes the record and drops its reference to the weights, which the store's
        collector deletes once nothing else uses them (NOTE [ Store garbage collection ])."""
        self._delete_stored(tenant_id, "model", model)
