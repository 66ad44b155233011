"""Tenants and their API keys.

A tenant is created on the first key made for its name (``keys.tenant_by_name``, then
``keys.tenant``); a key is a hash ``keys.api_key(key_id)`` holding its tenant and only the
sha256 of its secret, so a key is shown once, when it is made (service/records/format.py
parses and checks presented keys).
"""

from __future__ import annotations

import secrets
from typing import cast

from pydantic import BaseModel

from api_schemas import new_id, utc_now
from service.records import keys
from service.records.base import RedisRecords
from service.records.format import (
    API_KEY_FIELDS,
    API_KEY_PREFIX,
    hash_secret,
    split_api_key,
    text,
    verify_api_key,
)

__all__ = ["ApiKey", "ApiKeys"]


class ApiKey(BaseModel):
    tenant_id: str
    key: str


class ApiKeys(RedisRecords):
    """Tenants and API keys: made, listed, revoked, and checked on every request."""

    def create_api_key(self, tenant_name: str) -> ApiKey:
        """A new key for the tenant named ``tenant_name`` (created on first use). Only the
        secret's sha256 is stored: the key is shown once."""
        tenant_id = self._tenant_id(tenant_name)
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        self.client.hset(
            keys.api_key(key_id),
            mapping={
                "tenant_id": tenant_id,
                "secret_sha256": hash_secret(secret),
                "created_at": utc_now().isoformat(),
            },
        )
        return ApiKey(tenant_id=tenant_id, key=f"{API_KEY_PREFIX}_{key_id}_{secret}")

    def _tenant_id(self, name: str) -> str:
        candidate = new_id("tn")
        # SET NX makes two concurrent creations agree on one id.
        self.client.set(keys.tenant_by_name(name), candidate, nx=True)
        tenant_id = text(self.client.get(keys.tenant_by_name(name)))
        if tenant_id == candidate:
            self.client.hset(
                keys.tenant(tenant_id), mapping={"name": name, "created_at": utc_now().isoformat()}
            )
        return tenant_id

    def list_api_keys(self) -> list[dict[str, str]]:
        """Every key's id, tenant (id and name) and creation time; never its secret (only
        its hash is stored). For operators: a scan of all keys."""
        found = []
        for name in self.client.scan_iter(match=keys.api_key("*"), count=500):
            fields = self._fields(text(name))
            if fields is None:
                continue
            tenant_name = self.client.hget(keys.tenant(fields["tenant_id"]), "name")
            found.append(
                {
                    "key_id": text(name).rsplit(":", 1)[1],
                    "tenant_id": fields["tenant_id"],
                    "tenant": "" if tenant_name is None else text(tenant_name),
                    "created_at": fields.get("created_at", ""),
                }
            )
        return sorted(found, key=lambda k: k["created_at"])

    def revoke_api_key(self, key_or_id: str) -> bool:
        """Deletes a key, named by its id or given whole; False if there is no such key."""
        parts = split_api_key(key_or_id)
        key_id = parts[0] if parts is not None else key_or_id
        return bool(self.client.delete(keys.api_key(key_id)))

    def tenant_for_key(self, presented: str) -> str | None:
        """The tenant a presented key belongs to, or None (see :func:`verify_api_key`)."""
        parts = split_api_key(presented)
        if parts is None:
            return None
        stored = cast(
            "list[bytes | None]", self.client.hmget(keys.api_key(parts[0]), API_KEY_FIELDS)
        )
        return verify_api_key(parts[1], stored)

    def _fields(self, name: str) -> dict[str, str] | None:
        raw = cast("dict[bytes, bytes]", self.client.hgetall(name))
        if not raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}
