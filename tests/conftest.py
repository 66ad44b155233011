"""Shared fixtures: real servers on free ports. The helpers live in ``tests/servers.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.local.embedded import RedisServer
from tests.servers import S3Server, new_redis_server, new_s3_server


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh password-protected Redis-compatible server for one test, stopped afterwards."""
    server = new_redis_server(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def session_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server shared by the whole session: cheaper, but tests must not assume it is empty
    (use unique keys or queue names)."""
    server = new_redis_server(tmp_path_factory.mktemp("redis-session"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors run much faster on one thread than on two of a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3-compatible server (SeaweedFS) for the session; tests take a fresh bucket each."""
    server = new_s3_server(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new empty bucket, with this process's AWS_* variables pointing at its server."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server.new_bucket()
