"""The S3 store's part in a collection: the writes it records in Redis, the deletion markers,
and the listing and removal of objects nothing uses, of temp keys and unfinished uploads.

# NOTE [ Collecting an S3 store ]
The local store protects a write racing a collection with mtimes and a rename out of reach
(NOTE [ Store garbage collection ] in service/store/gc.py). S3 has no rename, so the same two
facts live in Redis:
- every writer, before it writes (or finds) the object under its content key, records the
  time in the sorted set ``keys.STORE_WRITTEN`` and checks, in the same MULTI, that no
  collection is deleting the object (``keys.store_deleting``); if one is, it waits until the
  marker is gone and then writes the object anew;
- the collector, after the rules of gc.py found the object unused, sets that marker only if
  the recorded write is older than the grace period (one Lua script: check and set are one
  step), checks the references again, deletes the object and removes the marker.
A write recorded before the marker keeps the object for the grace period; a write recorded
after it waits until the delete is done and installs the object again. The marker expires
after ``DELETE_MARKER_TTL_S`` should its collector die; a collection whose delete could take
that long does not exist (one DELETE request, bounded by the client's timeouts and retries).
An object without a recorded write is as old as its ``LastModified``, also checked.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Final

import redis
from botocore.exceptions import ClientError

from service.errors import StoreError
from service.records import keys
from service.store.base import DEFAULT_TMP_MAX_AGE_S, SHA256_RE, StoredObject
from service.store.cache import ObjectCache
from service.store.s3.client import S3Bucket, not_found

__all__ = ["DELETE_MARKER_TTL_S", "S3Collection"]

# How long a collection's deletion marker lives if its collector dies before removing it.
DELETE_MARKER_TTL_S: Final = 300.0
_MARKER_POLL_S: Final = 0.1

# The marker is set only if no write was recorded at or after the cutoff (NOTE [ Collecting an
# S3 store ]). KEYS: written zset, marker; ARGV: sha256, cutoff, token, ttl ms.
_MARK_LUA: Final = """
local written = redis.call('ZSCORE', KEYS[1], ARGV[1])
if written and tonumber(written) >= tonumber(ARGV[2]) then return 0 end
if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then return 1 end
return 0
"""
_UNMARK_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class S3Collection:
    """Both sides of NOTE [ Collecting an S3 store ] for the objects in ``s3``: the writers'
    (:meth:`record_write`) and the collector's (the rest, the :class:`~service.store.base.Store`
    methods of collection), with this machine's copies in ``cache``."""

    def __init__(self, s3: S3Bucket, cache: ObjectCache, redis_client: redis.Redis) -> None:
        self._s3 = s3
        self._cache = cache
        self._redis = redis_client
        self._mark = redis_client.register_script(_MARK_LUA)
        self._unmark = redis_client.register_script(_UNMARK_LUA)

    def record_write(self, sha256: str) -> None:
        """Records that ``sha256`` is being written, once no collection is deleting it."""
        deadline = time.monotonic() + DELETE_MARKER_TTL_S + 10.0
        while True:
            pipe = self._redis.pipeline(transaction=True)
            pipe.zadd(keys.STORE_WRITTEN, {sha256: time.time()})
            pipe.exists(keys.store_deleting(sha256))
            _, deleting = pipe.execute()
            if not deleting:
                return
            if time.monotonic() > deadline:
                raise StoreError(
                    f"object {sha256} has been marked for deletion by a store collection for "
                    f"over {DELETE_MARKER_TTL_S:g} s; check Redis key "
                    f"{keys.store_deleting(sha256)} and retry"
                )
            time.sleep(_MARKER_POLL_S)

    def objects(self) -> Iterator[StoredObject]:
        pages = (
            self._s3.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self._s3.name, Prefix=self._s3.objects_prefix)
        )
        for page in pages:
            for entry in page.get("Contents", ()):
                name = entry["Key"].rpartition("/")[2]
                if SHA256_RE.fullmatch(name) is None:
                    continue
                yield StoredObject(name, entry["LastModified"].timestamp(), entry["Size"])

    def remove_unused(self, sha256: str, cutoff: float, in_use: Callable[[str], bool]) -> bool:
        if in_use(sha256):
            return False
        marker = keys.store_deleting(sha256)
        token = secrets.token_hex(8)
        marked = self._mark(
            keys=[keys.STORE_WRITTEN, marker],
            args=[sha256, repr(cutoff), token, int(DELETE_MARKER_TTL_S * 1000)],
        )
        if not marked:
            return False  # written within the grace period, or another collector is on it
        try:
            if in_use(sha256):
                return False
            key = self._s3.object_key(sha256)
            try:
                head = self._s3.client().head_object(Bucket=self._s3.name, Key=key)
            except ClientError as exc:
                if not_found(exc):
                    return False
                raise
            if head["LastModified"].timestamp() >= cutoff:
                return False
            self._s3.client().delete_object(Bucket=self._s3.name, Key=key)
            self._cache.discard(sha256)
            return True
        finally:
            self._unmark(keys=[marker], args=[token])

    def settle_trash(self, cutoff: float) -> int:
        """Nothing is moved aside on S3 (a dead collector's marker expires); drops the
        recorded writes older than ``cutoff``, which no longer protect anything."""
        self._redis.zremrangebyscore(keys.STORE_WRITTEN, "-inf", f"({cutoff}")
        return 0

    def cleanup_tmp(self, older_than_s: float = DEFAULT_TMP_MAX_AGE_S) -> int:
        """Deletes temp keys and aborts unfinished multipart uploads older than
        ``older_than_s``."""
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        client = self._s3.client()
        tmp_prefix = self._s3.tmp_prefix
        removed = 0
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=self._s3.name, Prefix=tmp_prefix
        )
        for page in pages:
            for entry in page.get("Contents", ()):
                if entry["LastModified"] < cutoff:
                    client.delete_object(Bucket=self._s3.name, Key=entry["Key"])
                    removed += 1
        # Unfinished uploads under tmp/ and under objects/ (a write whose digest was
        # announced uploads to its content key; unfinished, it is invisible there).
        uploads = client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self._s3.name, Prefix=self._s3.prefix
        )
        ours = (tmp_prefix, self._s3.objects_prefix)
        for page in uploads:
            for upload in page.get("Uploads", ()):
                if upload["Key"].startswith(ours) and upload["Initiated"] < cutoff:
                    with contextlib.suppress(ClientError):
                        client.abort_multipart_upload(
                            Bucket=self._s3.name, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        removed += 1
        return removed
