"""The layout that a tenant's models, datasets and jobs share.

A tenant's resource ``<kind>`` is a hash ``keys.record(kind, id)`` with its ``tenant_id`` and
its public JSON (``data``), listed newest first in the tenant's index
(``keys.tenant_index``). A lookup for another tenant's resource answers None, exactly like a
missing one, so the API can only ever say 404.
"""

from __future__ import annotations

from datetime import datetime
from typing import TypeVar, cast

import redis
from pydantic import BaseModel

from api_schemas import DatasetPublic, ModelPublic, Page
from service.records import keys
from service.records.base import RedisRecords
from service.records.format import RESOURCE_FIELDS, index_member, owned_resource
from service.records.paging import newest_first
from service.records.stored.store_refs import release_sha_ref
from service.records.tenancy.quotas import ensure_stored_bytes_counted, hold_record, release_objects

__all__ = ["StoredResource", "TenantResources"]

R = TypeVar("R", bound=BaseModel)
# A resource that is one object in the store, which its record holds a use of.
StoredResource = ModelPublic | DatasetPublic


class TenantResources(RedisRecords):
    """The writes and reads of the layout above, for the classes of one resource kind."""

    def _put_stored(
        self,
        tenant_id: str,
        kind: keys.ResourceKind,
        resource: StoredResource,
        max_stored_bytes: float | None = None,
    ) -> None:
        """Writes the record of ``resource``, its use of its store object and its hold of the
        object's bytes in the tenant's count, in one script; with ``max_stored_bytes`` (the
        setting; the tenant's own value wins) only if they fit, else
        :class:`~service.errors.QuotaExceededError` (NOTE [ Tenant quotas ] in
        service/records/tenancy/quotas.py). Writing the same record again (a job's attempts racing)
        holds the object once."""
        hold_record(
            self.client,
            tenant_id,
            keys.record(kind, resource.id),
            keys.tenant_index(tenant_id, kind),
            index_member(resource.created_at, resource.id),
            {"tenant_id": tenant_id, "data": resource.model_dump_json()},
            resource.sha256,
            resource.size_bytes,
            resource.id,
            max_stored_bytes,
        )

    def _delete_stored(
        self, tenant_id: str, kind: keys.ResourceKind, resource: StoredResource
    ) -> None:
        """Deletes the record of ``resource`` and drops its use of its store object, which the
        store's collector deletes once nothing else uses it (NOTE [ Store garbage collection ]
        in service/store/gc.py), and its hold of the object's bytes: they leave the tenant's
        count only if nothing else of the tenant holds them (a job that used it)."""
        ensure_stored_bytes_counted(self.client, tenant_id)
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, kind, resource.id, resource.created_at)
        release_sha_ref(pipe, resource.sha256, resource.id)
        release_objects(self.client, tenant_id, resource.id, [resource.sha256], pipe)
        pipe.execute()

    def _put(
        self,
        pipe: redis.client.Pipeline,
        tenant_id: str,
        kind: keys.ResourceKind,
        resource_id: str,
        resource: BaseModel,
        created_at: datetime,
    ) -> None:
        pipe.hset(
            keys.record(kind, resource_id),
            mapping={"tenant_id": tenant_id, "data": resource.model_dump_json()},
        )
        pipe.zadd(keys.tenant_index(tenant_id, kind), {index_member(created_at, resource_id): 0})

    def _delete(
        self,
        pipe: redis.client.Pipeline,
        tenant_id: str,
        kind: keys.ResourceKind,
        resource_id: str,
        created_at: datetime,
    ) -> None:
        pipe.delete(keys.record(kind, resource_id))
        pipe.zrem(keys.tenant_index(tenant_id, kind), index_member(created_at, resource_id))

    def _get(
        self, tenant_id: str, kind: keys.ResourceKind, resource_id: str, schema: type[R]
    ) -> R | None:
        stored = self.client.hmget(keys.record(kind, resource_id), RESOURCE_FIELDS)
        return owned_resource(tenant_id, cast("list[bytes | None]", stored), schema)

    def _list(
        self,
        tenant_id: str,
        kind: keys.ResourceKind,
        schema: type[R],
        page_size: int,
        token: str | None,
    ) -> Page[R]:
        return newest_first(
            self.client,
            keys.tenant_index(tenant_id, kind),
            lambda resource_id: self._get(tenant_id, kind, resource_id, schema),
            page_size,
            token,
        )
