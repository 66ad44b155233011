"""A machine's cached copies stay while a job uses them (NOTE [ Pinned copies ] in
service/store/cache.py): a job's process pins the copies it reads; another process's download,
which evicts what is over the cache's limit, leaves a pinned copy however old, and takes it once
the job's process is gone, even killed. Real processes sharing one cache directory, over a real
S3-compatible server (SeaweedFS) and a real Redis-compatible server."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from harness.stack import REPO
from service.local.embedded import RedisServer
from service.records.connection import redis_client
from service.store.cache import IN_USE_S, ObjectCache
from service.store.s3 import S3Store

MIB = 1024 * 1024
AN_HOUR_AGO = time.time() - IN_USE_S - 3600.0  # older than "used lately" protects

# A job's process, as run_job holds it: inside the store's `pinning` block it reads its dataset
# through the store, then reads it again by path when told (a loader process reopening it).
JOB = """
import hashlib, sys
from pathlib import Path
from service.records.connection import redis_client
from service.store.cache import ObjectCache
from service.store.s3 import S3Store

bucket, cache_dir, redis_url, sha256 = sys.argv[1:5]
store = S3Store(bucket, "pre/", ObjectCache(Path(cache_dir), 1), redis_client(redis_url))
with store.pinning():
    path = store.local_path(sha256)
    print(path, flush=True)
    sys.stdin.readline()
    print(hashlib.sha256(path.read_bytes()).hexdigest(), flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis_client(redis_server.url)
    try:
        yield conn
    finally:
        conn.close()


def s3_store(bucket: str, client: redis.Redis, cache: ObjectCache) -> S3Store:
    return S3Store(bucket, "pre/", cache, client, part_bytes=5 * MIB)


def stored(bucket: str, client: redis.Redis, tmp_path: Path, data: bytes) -> str:
    """``data`` put in the bucket from another machine (its own cache)."""
    return s3_store(bucket, client, ObjectCache(tmp_path / "elsewhere", 0)).put_bytes(data)


def test_a_running_jobs_copy_survives_another_download(
    s3_bucket: str, client: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    dataset = os.urandom(MIB)
    other = os.urandom(MIB)
    first, second = (stored(s3_bucket, client, tmp_path, data) for data in (dataset, other))
    cache_dir = tmp_path / "machine-cache"
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, s3_bucket, str(cache_dir), redis_server.url, first],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert job.stdout is not None and job.stdin is not None
        copy = Path(job.stdout.readline().strip())
        assert copy.read_bytes() == dataset
        os.utime(copy, (AN_HOUR_AGO, AN_HOUR_AGO))  # the job has been running for a while
        # Another job's download on the same machine: the cache holds one object's worth.
        machine = ObjectCache(cache_dir, max_bytes=MIB + MIB // 2)
        assert s3_store(s3_bucket, client, machine).local_path(second).read_bytes() == other
        assert copy.exists(), "the running job's dataset was evicted"
        job.stdin.write("\n")
        job.stdin.flush()
        assert job.stdout.readline().strip() == hashlib.sha256(dataset).hexdigest()
        assert machine.evict() == 0  # still pinned
    finally:
        job.kill()  # no clean exit: the kernel drops the pin with the process
        job.wait()
    assert machine.evict() == 1
    assert not copy.exists()
    assert machine.get(second) is not None


def test_a_pin_on_a_copy_evicted_meanwhile_is_a_miss(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=0)
    data = b"an object\n"
    sha256 = hashlib.sha256(data).hexdigest()
    with cache.new_file() as (tmp, file):
        file.write(data)
        file.close()
        path = cache.install(tmp, sha256)
    other = ObjectCache(tmp_path, max_bytes=0)
    with cache.pinning():
        assert cache.get(sha256) == path
        assert cache.pinned() == [sha256]
        os.utime(path, (AN_HOUR_AGO, AN_HOUR_AGO))
        assert other.evict() == 0  # pinned by this process's block
    assert cache.pinned() == []
    os.utime(path, (AN_HOUR_AGO, AN_HOUR_AGO))
    assert other.evict() == 1
    with cache.pinning():
        assert cache.get(sha256) is None
        assert cache.pinned() == []


def test_a_second_install_keeps_the_pinned_copy(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=1 << 20)
    data = b"the same bytes, downloaded twice\n"
    sha256 = hashlib.sha256(data).hexdigest()

    def download() -> Path:
        with cache.new_file() as (tmp, file):
            file.write(data)
            file.close()
            return cache.install(tmp, sha256)

    with cache.pinning():
        first = download()
        inode = first.stat().st_ino
        assert download() == first
        assert first.stat().st_ino == inode  # not replaced under the pin
    assert list((tmp_path / "tmp").iterdir()) == []
