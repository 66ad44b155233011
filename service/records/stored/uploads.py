"""Resumable uploads in Redis: a session per upload, the parts it received, and how long the
store keeps those parts.

# NOTE [ Upload parts in the store ]
Each part is a store object of its own (content-addressed, so a part sent again lands on the
same object). No record refers to a part, so the store's collector would delete it after the
grace period; instead each part is noted in ``STORE_RELEASED`` with the session's expiry as its
score (``ZADD GT``: never earlier than another holder's), which the collector reads as "in use
until then" (NOTE [ Store garbage collection ] in service/store/gc.py). Several sessions, of one
tenant or of several, can send the same bytes: each session that sent a part is also noted in
``upload_part_holders(sha256)``, scored by its expiry. When an upload is completed or deleted,
its parts are released at once unless another session still holds them: the new score is the
latest expiry of the other live holders, or now if there is none (one script, so that a
session sending the same part meanwhile is never overwritten). A session nobody finishes
expires with its keys, and its parts are collected a grace period after. Nothing needs
sweeping.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

import redis

from service.records import keys
from service.records.tenancy.quotas import hold_upload_objects, open_upload, release_upload

__all__ = ["UploadRecords", "UploadSession"]

# Releases one part of an ending session (NOTE [ Upload parts in the store ]).
# KEYS: STORE_RELEASED, upload_part_holders(sha256); ARGV: sha256, session id, now.
_RELEASE_PART_LUA: Final = """
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3])
local release = tonumber(ARGV[3])
local latest = redis.call('ZRANGE', KEYS[2], 0, 0, 'REV', 'WITHSCORES')
if latest[2] ~= nil and tonumber(latest[2]) > release then
    release = tonumber(latest[2])
end
redis.call('ZADD', KEYS[1], release, ARGV[1])
return tostring(release)
"""


@dataclass(frozen=True)
class UploadSession:
    id: str
    tenant: str
    name: str | None
    expected_bytes: int | None
    created_at: datetime
    expires_at: datetime
    parts: dict[int, tuple[str, int]]  # number -> (sha256, size)


class UploadRecords:
    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._release_part = client.register_script(_RELEASE_PART_LUA)

    def create(
        self,
        upload_id: str,
        tenant: str,
        name: str | None,
        expected_bytes: int | None,
        max_open_uploads: float | None = None,
        max_stored_bytes: float | None = None,
    ) -> UploadSession:
        """With ``max_open_uploads`` (the setting; the tenant's own value wins): only if the
        tenant may open one more, and with ``max_stored_bytes`` only if ``expected_bytes``
        fit, which the upload reserves until it ends; else
        :class:`~service.errors.QuotaExceededError` (NOTE [ Tenant quotas ] in
        service/records/tenancy/quotas.py)."""
        now = time.time()
        fields: dict[str, str | int | float] = {
            "tenant": tenant,
            "name": name or "",
            "expected_bytes": expected_bytes or 0,
            "created_at": repr(now),
            "expires_at": repr(now + self.ttl_s),
        }
        open_upload(
            self.client,
            tenant,
            upload_id,
            now + self.ttl_s,
            max_open_uploads,
            reserve_bytes=expected_bytes or 0,
            max_stored_bytes=max_stored_bytes,
            record_key=keys.upload(upload_id),
            fields=fields,
            ttl_s=self.ttl_s + 1,
        )
        return UploadSession(
            upload_id, tenant, name, expected_bytes, _utc(now), _utc(now + self.ttl_s), parts={}
        )

    def get(self, tenant: str, upload_id: str) -> UploadSession | None:
        """The session, if it exists and belongs to ``tenant``."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.upload(upload_id))
        pipe.hgetall(keys.upload_parts(upload_id))
        raw_fields, raw_parts = pipe.execute()
        fields = {k.decode(): v.decode() for k, v in raw_fields.items()}
        if not fields or fields.get("tenant") != tenant:
            return None
        found = {}
        for number, value in raw_parts.items():
            sha256, _, size = value.decode().partition(":")
            found[int(number)] = (sha256, int(size))
        return UploadSession(
            upload_id,
            tenant,
            fields.get("name") or None,
            int(fields.get("expected_bytes", 0)) or None,
            _utc(float(fields["created_at"])),
            _utc(float(fields["expires_at"])),
            dict(sorted(found.items())),
        )

    def put_part(
        self,
        session: UploadSession,
        number: int,
        sha256: str,
        size: int,
        max_stored_bytes: float | None = None,
    ) -> bool:
        """Records a part (replacing one of the same number) and keeps its object in the store
        until the session expires (NOTE [ Upload parts in the store ]). An upload that
        announced no size holds each part in its tenant's stored bytes as it lands, within
        ``max_stored_bytes`` when given (else :class:`~service.errors.QuotaExceededError`).
        False when the upload is no longer open (nothing recorded)."""
        if session.expected_bytes is None and not hold_upload_objects(
            self.client, session.tenant, session.id, {sha256: size}, max_stored_bytes
        ):
            return False
        expires = session.expires_at.timestamp()
        holders = keys.upload_part_holders(sha256)
        pipe = self.client.pipeline()
        pipe.hset(keys.upload_parts(session.id), str(number), f"{sha256}:{size}")
        pipe.expireat(keys.upload_parts(session.id), int(expires) + 1)
        pipe.zadd(holders, {session.id: expires}, gt=True)
        pipe.expireat(holders, int(expires) + 1, gt=True)
        pipe.expireat(holders, int(expires) + 1, nx=True)
        pipe.zadd(keys.STORE_RELEASED, {sha256: expires}, gt=True)
        pipe.execute()
        return True

    @contextmanager
    def completing(self, session: UploadSession) -> Iterator[None]:
        """Around the registration of a completed upload: what the upload reserved leaves the
        tenant's count first (the dataset it registers holds its object then), and is held
        again, without a limit, if the registration fails and the upload stays."""
        release_upload(self.client, session.tenant, session.id, keep_open=True)
        try:
            yield
        except BaseException:
            held = (
                {f"upload:{session.id}": session.expected_bytes}
                if session.expected_bytes is not None
                else dict(session.parts.values())
            )
            hold_upload_objects(self.client, session.tenant, session.id, held, None)
            raise

    def delete(self, session: UploadSession) -> None:
        """Ends the session; its parts are released now, or when the last other session that
        sent the same bytes expires (the collector deletes what nothing else uses after the
        grace period: NOTE [ Upload parts in the store ])."""
        now = time.time()
        pipe = self.client.pipeline()
        pipe.delete(keys.upload(session.id), keys.upload_parts(session.id))
        release_upload(self.client, session.tenant, session.id, pipe=pipe)
        for sha256 in {sha256 for sha256, _ in session.parts.values()}:
            self._release_part(
                keys=[keys.STORE_RELEASED, keys.upload_part_holders(sha256)],
                args=[sha256, session.id, repr(now)],
                client=pipe,
            )
        pipe.execute()


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
