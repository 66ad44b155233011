"""Tenants' datasets (``keys.record("dataset", id)``, the layout of
service/records/stored/resources.py); each holds a use of its file in the store
(service/records/stored/store_refs.py)."""

from __future__ import annotations

from api_schemas import DatasetPublic, Page
from service.records.stored.resources import TenantResources

__all__ = ["DatasetRecords"]


class DatasetRecords(TenantResources):
    """A tenant's datasets: written, read, listed newest first, deleted."""

    def put_dataset(
        self, tenant_id: str, dataset: DatasetPublic, max_stored_bytes: float | None = None
    ) -> None:
        """With ``max_stored_bytes``: only within the tenant's stored-bytes quota (NOTE
        [ Tenant quotas ] in service/records/tenancy/quotas.py)."""
        self._put_stored(tenant_id, "dataset", dataset, max_stored_bytes)

    def get_dataset(self, tenant_id: str, dataset_id: str) -> DatasetPublic | None:
        return self._get(tenant_id, "dataset", dataset_id, DatasetPublic)

    def list_datasets(
        self, tenant_id: str, page_size: int, token: str | None
    ) -> Page[DatasetPublic]:
        return self._list(tenant_id, "dataset", DatasetPublic, page_size, token)

    def delete_dataset(self, tenant_id: str, dataset: DatasetPublic) -> None:
        """Deletes the record and drops its reference to the file (see
        :meth:`ModelRecords.delete_model`)."""
        self._delete_stored(tenant_id, "dataset", dataset)
