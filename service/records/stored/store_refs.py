"""Which records use each store object: ``keys.sha_refs(sha256)``, the set of the ids (models,
datasets, jobs) that use it. The store's collector deletes an object once its set is empty
and it was released long enough ago (NOTE [ Store garbage collection ] in
service/store/gc.py)."""

from __future__ import annotations

import time

import redis

from service.records import keys
from service.records.base import RedisRecords

__all__ = ["StoreRefs", "release_sha_ref"]


def release_sha_ref(pipe: redis.client.Pipeline, sha256: str, owner_id: str) -> None:
    """Drops ``owner_id``'s use of a store object, noting when for the store's collector
    (NOTE [ Store garbage collection ] in service/store/gc.py)."""
    pipe.srem(keys.sha_refs(sha256), owner_id)
    # GT: a live upload session may protect the same bytes until later (NOTE [ Upload parts
    # in the store ] in service/records/stored/uploads.py); a release never shortens that.
    pipe.zadd(keys.STORE_RELEASED, {sha256: time.time()}, gt=True)


class StoreRefs(RedisRecords):
    """Uses of store objects marked outside the write of a resource's own record."""

    def add_sha_ref(self, sha256: str, owner_id: str) -> None:
        """Marks a store object as used by ``owner_id`` (a model, dataset or job)."""
        self.client.sadd(keys.sha_refs(sha256), owner_id)
