"""The S3 store on a real S3-compatible server (SeaweedFS, started on free ports by the
``s3_server`` fixture) and a real Redis-compatible server: atomic commits, streaming writes,
the machine's cache, and collection racing writers (NOTE [ Collecting an S3 store ])."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from botocore.exceptions import ClientError

from harness.servers import S3Server, wait_for
from service.errors import (
    ObjectNotFoundError,
    StoreDigestMismatchError,
    StoreError,
    StoreTooLargeError,
)
from service.local.embedded import RedisServer
from service.records import keys
from service.records.connection import redis_client
from service.settings import Settings
from service.store import open_store
from service.store.base import Store
from service.store.cache import IN_USE_S, ObjectCache
from service.store.gc import collect_garbage
from service.store.s3 import S3Store, parse_s3_url

pytestmark = pytest.mark.slow  # a real S3-compatible server (outside the quick tier)

MIB = 1024 * 1024
FUTURE = time.time() + 10 * 3600.0  # a cutoff that makes every object old


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis_client(redis_server.url)
    try:
        yield conn
    finally:
        conn.close()


def make_store(bucket: str, client: redis.Redis, cache_dir: Path, **options: Any) -> S3Store:
    options.setdefault("part_bytes", 5 * MIB)
    return S3Store(bucket, "pre/", ObjectCache(cache_dir, 1024 * MIB), client, **options)


@pytest.fixture
def store(s3_bucket: str, client: redis.Redis, tmp_path: Path) -> S3Store:
    return make_store(s3_bucket, client, tmp_path / "cache")


def bucket_keys(server: S3Server, bucket: str) -> list[str]:
    reply = server.client().list_objects_v2(Bucket=bucket)
    return sorted(entry["Key"] for entry in reply.get("Contents", ()))


def pending_uploads(server: S3Server, bucket: str) -> list[str]:
    reply = server.client().list_multipart_uploads(Bucket=bucket)
    return [upload["Key"] for upload in reply.get("Uploads", ())]


def never_used(sha256: str) -> bool:
    return False


# --- choosing the store --------------------------------------------------------------------


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://bkt") == ("bkt", "")
    assert parse_s3_url("s3://bkt/a/b/") == ("bkt", "a/b/")
    for bad in ("http://bkt/x", "s3:///x", "s3://bkt/x?y=1"):
        with pytest.raises(ValueError, match="not an S3 URL"):
            parse_s3_url(bad)


def test_open_store_follows_the_url(tmp_path: Path, redis_url: str) -> None:
    s3 = open_store(Settings(store_url="s3://bkt/deploy", redis_url=redis_url, data_dir=tmp_path))
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix) == ("bkt", "deploy/")
    assert s3.cache.root == tmp_path / "cache"
    local = open_store(Settings(store_url=str(tmp_path / "elsewhere"), data_dir=tmp_path))
    assert repr(local) == f"LocalStore({str(tmp_path / 'elsewhere')!r})"
    default = open_store(Settings(data_dir=tmp_path))
    assert repr(default) == f"LocalStore({str(tmp_path / 'store')!r})"


def test_the_api_does_not_import_boto3_for_a_local_store() -> None:
    code = (
        "import sys, service.api.app, service.store; "
        "print('boto3' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]


def test_is_a_store(store: S3Store) -> None:
    as_protocol: Store = store  # mypy checks that S3Store satisfies Store
    assert as_protocol.put_bytes(b"") == sha(b"")


# --- writing and reading --------------------------------------------------------------------


def test_small_object_one_put_under_its_content_key(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    digest = store.put_bytes(b"hello")
    assert digest == sha(b"hello")
    assert bucket_keys(s3_server, s3_bucket) == [f"pre/objects/{digest}"]
    assert store.exists(digest)
    with store.open(digest) as file:
        assert file.read() == b"hello"


def test_a_large_object_of_unknown_digest_goes_once_to_its_content_key(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    data = os.urandom(12 * MIB + 123)
    uploads = count_calls(store, "CreateMultipartUpload", "PutObject")
    copies = count_calls(store, "CopyObject", "UploadPartCopy")
    with store.writer() as writer:
        for start in range(0, len(data), MIB):
            writer.write(data[start : start + MIB])
    assert writer.sha256 == sha(data)
    assert writer.size == len(data)
    # Uploaded once, straight to its content key, once its digest was known: no temp key,
    # no server-side copy.
    assert uploads == [f"pre/objects/{sha(data)}"]
    assert copies == []
    assert bucket_keys(s3_server, s3_bucket) == [f"pre/objects/{sha(data)}"]
    assert pending_uploads(s3_server, s3_bucket) == []
    body = s3_server.client().get_object(Bucket=s3_bucket, Key=f"pre/objects/{sha(data)}")
    assert sha(body["Body"].read()) == sha(data)


def test_chunks_across_part_boundaries_from_a_reused_buffer(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    # Chunks that straddle the 5 MiB parts, from one buffer the caller refills after each
    # write: the parts hold the bytes as they were written, not the buffer's later content.
    data = os.urandom(17 * MIB + 11)
    step = 3 * MIB + 7
    buffer = bytearray(step)
    with store.writer(sha256=sha(data)) as writer:
        for start in range(0, len(data), step):
            piece = data[start : start + step]
            buffer[: len(piece)] = piece
            writer.write(memoryview(buffer)[: len(piece)])  # type: ignore[arg-type]
            buffer[:] = bytes(len(buffer))
    assert writer.sha256 == sha(data)
    body = s3_server.client().get_object(Bucket=s3_bucket, Key=f"pre/objects/{sha(data)}")
    assert body["Body"].read() == data
    # The cache's copy too, written past the page cache every 16 MiB (NOTE [ Copies past the
    # page cache ]): whole, from the buffer's bytes as they were written.
    cached = store.cache.get(sha(data))
    assert cached is not None
    assert cached.read_bytes() == data


def count_calls(store: S3Store, *operations: str) -> list[str]:
    """A list that gets the key of each ``operations`` request ``store``'s client sends."""
    calls: list[str] = []
    for operation in operations:
        store.client.meta.events.register(
            f"before-parameter-build.s3.{operation}",
            lambda params, **_: calls.append(str(params.get("Key"))),
        )
    return calls


def write_announced(store: S3Store, data: bytes, sha256: str) -> str:
    with store.writer(sha256=sha256) as writer:
        for start in range(0, len(data), MIB):
            writer.write(data[start : start + MIB])
    return writer.sha256


def test_an_announced_digest_goes_straight_to_its_content_key(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    data = os.urandom(12 * MIB + 5)
    uploads = count_calls(store, "CreateMultipartUpload")
    copies = count_calls(store, "CopyObject", "UploadPartCopy")
    assert write_announced(store, data, sha(data)) == sha(data)
    assert len(uploads) == 1 and uploads[0] == f"pre/objects/{sha(data)}"
    assert copies == []
    assert bucket_keys(s3_server, s3_bucket) == [f"pre/objects/{sha(data)}"]
    assert pending_uploads(s3_server, s3_bucket) == []
    body = s3_server.client().get_object(Bucket=s3_bucket, Key=f"pre/objects/{sha(data)}")
    assert sha(body["Body"].read()) == sha(data)
    assert store.cache.get(sha(data)) is not None  # the writer's machine keeps a copy


def test_an_announced_digest_that_is_wrong_leaves_nothing(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    data = os.urandom(12 * MIB)
    claimed = sha(b"something else")
    with pytest.raises(StoreDigestMismatchError, match=sha(data)):
        write_announced(store, data, claimed)
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []
    assert not store.exists(claimed)
    assert store.cache.size_bytes() == 0


def test_an_announced_object_already_there_is_not_sent_again(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    data = os.urandom(11 * MIB)
    store.put_bytes(data)  # several parts: put_bytes announces its digest
    store.cache.discard(sha(data))
    parts = count_calls(store, "UploadPart")
    assert write_announced(store, data, sha(data)) == sha(data)
    assert parts == []
    assert bucket_keys(s3_server, s3_bucket) == [f"pre/objects/{sha(data)}"]
    assert store.cache.get(sha(data)) is not None


def test_a_dead_writer_of_an_announced_digest_leaves_an_invisible_upload(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    data = os.urandom(6 * MIB)
    writer = store.writer(sha256=sha(data))  # kept: dropping it would close the write
    handle = writer.__enter__()
    handle.write(data)  # one part sent, to the content key; never completed
    wait_for(lambda: pending_uploads(s3_server, s3_bucket), what="the multipart upload")
    assert pending_uploads(s3_server, s3_bucket) == [f"pre/objects/{sha(data)}"]
    assert bucket_keys(s3_server, s3_bucket) == []  # invisible until completed
    assert not store.exists(sha(data))
    assert store.cleanup_tmp(older_than_s=3600) == 0
    assert store.cleanup_tmp(older_than_s=0) == 1
    assert pending_uploads(s3_server, s3_bucket) == []


def test_an_exception_mid_write_leaves_nothing(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    def fail_midway() -> None:
        with store.writer() as writer:
            writer.write(os.urandom(11 * MIB))  # past two parts
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_midway()
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []
    assert store.cache.size_bytes() == 0
    assert list((store.cache.root / "tmp").iterdir()) == []


def signed_payloads(store: S3Store, *operations: str) -> dict[str, list[tuple[str, bool]]]:
    """For each of ``operations``: the X-Amz-Content-SHA256 of every request ``store``'s
    client sends, and whether the request carries a CRC32 header."""
    seen: dict[str, list[tuple[str, bool]]] = {operation: [] for operation in operations}
    for operation in operations:
        store.client.meta.events.register(
            f"before-send.s3.{operation}",
            lambda request, event_name, **_: seen[event_name.rpartition(".")[2]].append(
                (
                    request.headers["X-Amz-Content-SHA256"].decode(),
                    "x-amz-checksum-crc32" in request.headers,
                )
            ),
        )
    return seen


def test_object_bytes_are_signed_over_their_crc32(store: S3Store) -> None:
    # NOTE [ What checks the bytes of a part ]: over plain HTTP, botocore would sign a SHA-256
    # of every body; a body that carries a CRC32 is signed over that checksum instead, and a
    # request without one (the list of parts) keeps the SHA-256.
    seen = signed_payloads(store, "UploadPart", "PutObject", "CompleteMultipartUpload")
    data = os.urandom(11 * MIB)
    write_announced(store, data, sha(data))
    write_unannounced(store, data[::-1])
    store.put_bytes(b"small")
    assert seen["UploadPart"] == [("UNSIGNED-PAYLOAD", True)] * 6
    assert seen["PutObject"] == [("UNSIGNED-PAYLOAD", True)]
    completions = seen["CompleteMultipartUpload"]
    assert len(completions) == 2
    for completion, has_crc32 in completions:
        assert re.fullmatch("[0-9a-f]{64}", completion) and not has_crc32


def change_a_byte_on_the_way(store: S3Store, operation: str, number: int) -> None:
    """Changes one byte of the body of the ``number``-th ``operation`` request after it was
    signed, as a faulty link would."""
    sent = [0]

    def change(request: Any, **_: Any) -> None:
        sent[0] += 1
        if sent[0] == number:
            body = bytearray(request.body)
            body[len(body) // 2] ^= 0xFF
            request.body = bytes(body)

    store.client.meta.events.register(f"before-send.s3.{operation}", change)


def write_unannounced(store: S3Store, data: bytes) -> str:
    with store.writer() as writer:
        for start in range(0, len(data), MIB):
            writer.write(data[start : start + MIB])
    return writer.sha256


@pytest.mark.parametrize("digest", ["announced", "unknown"])
def test_a_part_changed_on_the_way_is_refused_and_nothing_is_stored(
    store: S3Store, s3_server: S3Server, s3_bucket: str, digest: str
) -> None:
    # The server checks each part against its CRC32 (NOTE [ What checks the bytes of a
    # part ]): the write fails, the upload is aborted, and neither the bucket nor the cache
    # keeps anything. Unknown digest: the parts are read from the cache file by the threads
    # that send them, signed the same way.
    data = os.urandom(11 * MIB)
    change_a_byte_on_the_way(store, "UploadPart", 2)
    write = (
        functools.partial(write_announced, store, data, sha(data))
        if digest == "announced"
        else functools.partial(write_unannounced, store, data)
    )
    with pytest.raises(ClientError, match="BadDigest"):
        write()
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []
    assert store.cache.size_bytes() == 0


def test_a_small_object_changed_on_the_way_is_refused(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    change_a_byte_on_the_way(store, "PutObject", 1)
    with pytest.raises(ClientError, match="BadDigest"):
        store.put_bytes(b"one part, one PUT")
    assert bucket_keys(s3_server, s3_bucket) == []
    assert store.cache.size_bytes() == 0


def test_size_limit(store: S3Store, s3_server: S3Server, s3_bucket: str) -> None:
    def write_7_mib() -> None:
        with store.writer(max_bytes=6 * MIB) as writer:
            for _ in range(7):
                writer.write(os.urandom(MIB))

    with pytest.raises(StoreTooLargeError, match="limit of 6291456 bytes"):
        write_7_mib()
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []


def test_a_writer_of_unknown_digest_that_died_leaves_nothing_in_the_bucket(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    writer = store.writer()
    handle = writer.__enter__()
    handle.write(os.urandom(6 * MIB))  # past one part: only in the cache file until the end
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []
    assert store.cleanup_tmp(older_than_s=0) == 0


def test_missing_object(store: S3Store) -> None:
    missing = sha(b"nothing")
    assert not store.exists(missing)
    with pytest.raises(ObjectNotFoundError, match=missing):
        store.open(missing)
    with pytest.raises(ObjectNotFoundError, match=missing):
        store.local_path(missing)


# --- the cache ------------------------------------------------------------------------------


def test_a_second_read_on_a_machine_downloads_nothing(
    s3_bucket: str, client: redis.Redis, tmp_path: Path, s3_server: S3Server
) -> None:
    writer_machine = make_store(s3_bucket, client, tmp_path / "a")
    data = os.urandom(7 * MIB)
    digest = writer_machine.put_bytes(data)
    # The writer's own machine keeps what it wrote: no download at all.
    assert writer_machine.local_path(digest).read_bytes() == data
    reader_machine = make_store(s3_bucket, client, tmp_path / "b")
    path = reader_machine.local_path(digest)
    assert path.parent == tmp_path / "b" / "objects"
    assert path.read_bytes() == data
    # With the object gone from the bucket, only the cached copy can answer.
    s3_server.client().delete_object(Bucket=s3_bucket, Key=f"pre/objects/{digest}")
    assert reader_machine.local_path(digest) == path
    assert writer_machine.local_path(digest).read_bytes() == data


def test_a_download_is_checked_against_its_sha256(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    claimed = sha(b"the real bytes")
    s3_server.client().put_object(Bucket=s3_bucket, Key=f"pre/objects/{claimed}", Body=b"other")
    with pytest.raises(StoreError, match="changed outside bnadapt"):
        store.local_path(claimed)
    assert store.cache.size_bytes() == 0


def test_a_download_of_many_parts_is_checked_before_it_is_cached(
    s3_bucket: str, client: redis.Redis, tmp_path: Path, s3_server: S3Server
) -> None:
    # More parts than in flight: the parts are hashed in order while later ones arrive.
    reader = make_store(s3_bucket, client, tmp_path / "b", parts_in_flight=2)
    data = os.urandom(12 * MIB + 3)
    digest = sha(data)
    key = f"pre/objects/{digest}"
    s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=data)
    assert reader.local_path(digest).read_bytes() == data
    # One byte changed in the last part, under the same content key, on a machine that has
    # no copy yet: refused, and nothing left in its cache.
    other = make_store(s3_bucket, client, tmp_path / "c", parts_in_flight=2)
    changed = bytearray(data)
    changed[-2] ^= 0xFF
    s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=bytes(changed))
    with pytest.raises(StoreError, match="changed outside bnadapt"):
        other.local_path(digest)
    assert other.cache.size_bytes() == 0
    assert list((tmp_path / "c" / "tmp").iterdir()) == []
    # A changed first part too (hashed first, before the others are all in).
    changed = bytearray(data)
    changed[0] ^= 0xFF
    s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=bytes(changed))
    with pytest.raises(StoreError, match="changed outside bnadapt"):
        other.local_path(digest)
    assert other.cache.size_bytes() == 0


def test_the_cache_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=10)
    paths = {}
    for name in (b"aaaa", b"bbbb", b"cccc"):
        with cache.new_file() as (tmp, file):
            file.write(name)
            file.close()
            paths[name] = cache.install(tmp, sha(name))
    assert cache.size_bytes() == 12  # over the limit, but all three were just used
    long_ago = time.time() - 2 * IN_USE_S
    for age_s, name in enumerate((b"bbbb", b"aaaa", b"cccc")):
        os.utime(paths[name], (long_ago + age_s, long_ago + age_s))
    cache.get(sha(b"bbbb"))  # used now: last to go
    assert cache.evict() == 1
    assert sorted(p.name for p in (tmp_path / "objects").iterdir()) == sorted(
        [sha(b"bbbb"), sha(b"cccc")]
    )


# --- presigned downloads ---------------------------------------------------------------------


def test_download_url_serves_the_object(store: S3Store) -> None:
    digest = store.put_bytes(b"weights bytes")
    url = store.download_url(digest, "m.safetensors")
    assert url is not None
    reply = httpx.get(url)
    assert reply.status_code == 200
    assert reply.content == b"weights bytes"
    assert 'filename="m.safetensors"' in reply.headers["content-disposition"]


# --- collection (NOTE [ Collecting an S3 store ]) ---------------------------------------------


def test_remove_unused_deletes_only_old_unused_objects(
    store: S3Store, s3_server: S3Server, s3_bucket: str
) -> None:
    old, used = store.put_bytes(b"old"), store.put_bytes(b"used")
    assert not store.remove_unused(old, time.time() - 3600, never_used)  # written just now
    assert not store.remove_unused(used, FUTURE, lambda sha256: sha256 == used)
    assert store.remove_unused(old, FUTURE, never_used)
    assert bucket_keys(s3_server, s3_bucket) == [f"pre/objects/{used}"]
    assert store.cache.get(old) is None  # the collector's own copy goes too


def test_a_write_recorded_after_the_listing_keeps_the_object(store: S3Store) -> None:
    digest = store.put_bytes(b"weights")
    cutoff = time.time() + 5  # the object is older than this ...
    time.sleep(0.01)
    while time.time() < cutoff:  # ... and a writer finds it again after the cutoff
        time.sleep(0.1)
    assert store.put_bytes(b"weights") == digest
    assert not store.remove_unused(digest, cutoff, never_used)
    assert store.exists(digest)


def test_a_reference_added_after_the_mark_keeps_the_object(store: S3Store) -> None:
    digest = store.put_bytes(b"weights")
    answers = iter([False, True])  # unused at the first check, used at the second
    assert not store.remove_unused(digest, FUTURE, lambda _: next(answers))
    assert store.exists(digest)


def test_a_writer_during_a_delete_waits_and_writes_the_object_anew(
    store: S3Store, client: redis.Redis
) -> None:
    digest = store.put_bytes(b"weights")
    client.zrem(keys.STORE_WRITTEN, digest)  # as if written long ago
    written = threading.Event()
    writer = threading.Thread(target=lambda: (store.put_bytes(b"weights"), written.set()))
    checks = 0

    def in_use(sha256: str) -> bool:
        nonlocal checks
        checks += 1
        if checks == 2:  # the marker is set: a writer that comes now must wait for the delete
            writer.start()
            wait_for(lambda: client.zscore(keys.STORE_WRITTEN, digest) is not None)
            time.sleep(0.3)
            assert not written.is_set(), "the writer did not wait for the delete"
        return False

    assert store.remove_unused(digest, FUTURE, in_use)
    writer.join(timeout=30)
    assert written.is_set()
    assert store.exists(digest)
    assert client.exists(keys.store_deleting(digest)) == 0


def test_collect_garbage_on_s3(
    store: S3Store, client: redis.Redis, s3_server: S3Server, s3_bucket: str
) -> None:
    unused, referenced, released = (store.put_bytes(d) for d in (b"u", b"r", b"d"))
    client.sadd(keys.sha_refs(referenced), "mdl_1")
    client.zadd(keys.STORE_RELEASED, {released: time.time() + 590})  # dropped just before
    # Everything written within the grace period: nothing goes.
    first = collect_garbage(client, store, grace_s=3600)
    assert (first.objects, first.deleted, first.kept_recent) == (3, 0, 3)
    # Judged 10 minutes later with a 1-minute grace: the unused one goes; the referenced one
    # and the one released within the grace period stay.
    later = collect_garbage(client, store, grace_s=60, now=time.time() + 600)
    assert (later.deleted, later.kept_in_use) == (1, 2)
    assert bucket_keys(s3_server, s3_bucket) == sorted(
        f"pre/objects/{d}" for d in (referenced, released)
    )
    assert client.zscore(keys.STORE_WRITTEN, unused) is None  # old write times are dropped
