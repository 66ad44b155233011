"""Upload parts under several sessions (NOTE [ Upload parts in the store ] in
service/records/stored/uploads.py): a part's bytes stay in the store while any live session holds
them, whichever session ends first, and go once none does. On a real directory store, a real
Redis-compatible server and the real collector."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from service.local.embedded import RedisServer
from service.records import keys
from service.records.connection import redis_client
from service.records.stored.store_refs import release_sha_ref
from service.records.stored.uploads import UploadRecords
from service.store.gc import collect_garbage
from service.store.local import LocalStore

GRACE_S = 60.0
DAY_S = 24 * 3600.0
PART = b"the same part, sent by two sessions\n" * 1000


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis_client(redis_server.url)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def stored_part(store: LocalStore) -> str:
    sha256 = store.put_bytes(PART)
    assert sha256 == hashlib.sha256(PART).hexdigest()
    return sha256


def collect_later(client: redis.Redis, store: LocalStore, after_s: float) -> int:
    """A collection as it would run ``after_s`` from now: what it deletes."""
    return collect_garbage(client, store, GRACE_S, now=time.time() + after_s).deleted


def released_at(client: redis.Redis, sha256: str) -> float:
    score = client.zscore(keys.STORE_RELEASED, sha256)
    assert score is not None
    return float(score)


def test_ending_one_session_keeps_the_part_of_a_later_one(
    client: redis.Redis, store: LocalStore
) -> None:
    sha256 = stored_part(store)
    first = UploadRecords(client, ttl_s=DAY_S)
    second = UploadRecords(client, ttl_s=7 * DAY_S)  # a later expiry: the protection to keep
    a = first.create("up_a", "tenant-a", None, None)
    first.put_part(a, 1, sha256, len(PART))
    b = second.create("up_b", "tenant-b", None, None)
    second.put_part(b, 3, sha256, len(PART))
    first.delete(first.get("tenant-a", "up_a") or a)
    assert released_at(client, sha256) >= b.expires_at.timestamp()
    # Two grace periods on, session b still lives: its part stays.
    assert collect_later(client, store, 2 * GRACE_S) == 0
    assert store.exists(sha256)
    # Once b ends too, nothing holds the bytes: collected a grace period later.
    second.delete(second.get("tenant-b", "up_b") or b)
    assert released_at(client, sha256) <= time.time()
    assert collect_later(client, store, 2 * GRACE_S) == 1
    assert not store.exists(sha256)


def test_ending_the_later_session_keeps_the_earlier_ones_protection(
    client: redis.Redis, store: LocalStore
) -> None:
    sha256 = stored_part(store)
    uploads = UploadRecords(client, ttl_s=DAY_S)
    a = uploads.create("up_a", "t", None, None)
    uploads.put_part(a, 1, sha256, len(PART))
    later = UploadRecords(client, ttl_s=3 * DAY_S)
    b = later.create("up_b", "t", None, None)
    later.put_part(b, 1, sha256, len(PART))
    later.delete(later.get("t", "up_b") or b)
    assert released_at(client, sha256) == pytest.approx(a.expires_at.timestamp())
    assert collect_later(client, store, 2 * GRACE_S) == 0


def test_a_released_dataset_does_not_shorten_a_live_parts_protection(
    client: redis.Redis, store: LocalStore
) -> None:
    # A one-part upload's part and a deleted dataset's file can be the same bytes.
    sha256 = stored_part(store)
    uploads = UploadRecords(client, ttl_s=DAY_S)
    session = uploads.create("up_live", "t", None, None)
    uploads.put_part(session, 1, sha256, len(PART))
    client.sadd(keys.sha_refs(sha256), "ds_old")
    pipe = client.pipeline()
    release_sha_ref(pipe, sha256, "ds_old")
    pipe.execute()
    assert released_at(client, sha256) == pytest.approx(session.expires_at.timestamp())
    assert collect_later(client, store, 2 * GRACE_S) == 0


def test_holders_expire_with_the_latest_session(client: redis.Redis, store: LocalStore) -> None:
    sha256 = stored_part(store)
    short = UploadRecords(client, ttl_s=100.0)
    long = UploadRecords(client, ttl_s=DAY_S)
    long.put_part(long.create("up_long", "t", None, None), 1, sha256, len(PART))
    short.put_part(short.create("up_short", "t", None, None), 1, sha256, len(PART))
    ttl = client.ttl(keys.upload_part_holders(sha256))
    assert DAY_S - 60 < ttl <= DAY_S + 1
