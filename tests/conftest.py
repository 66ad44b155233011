"""Shared fixtures: real servers on free ports. The helpers live in ``harness/servers.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.servers import S3Server, new_redis_server, new_s3_server
from service.local.embedded import RedisServer

if TYPE_CHECKING:
    # Imported where used: collecting the checkpoint suite must not depend on the service.
    from harness.inprocess import InProcessApi
    from harness.stack import Stack


# NOTE [ Test tiers ]
# Plain `pytest` runs the quick tier: every test not marked `slow`. The whole suite is asked
# for by name, `pytest --whole` (what .ci/run runs); an explicit `-m` expression chooses for
# itself (`-m slow`, `-m zoo`). Deselected tests are reported as such, so a run that selects
# nothing still exits 5 (no tests ran) and fails CI.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--whole",
        action="store_true",
        help="run the whole suite, the slow tier included (plain pytest runs the quick tier)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--whole") or config.getoption("markexpr"):
        return
    quick, slow = [], []
    for item in items:
        (quick if item.get_closest_marker("slow") is None else slow).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = quick


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


@pytest.fixture(scope="session")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    """The API in this process over its own Redis-compatible server, with an inspector and no
    worker (``harness/inprocess.py``), shared by the session: take a new tenant per test."""
    from harness.inprocess import MAX_DATASET_BYTES, running_api

    data_dir = tmp_path_factory.mktemp("api")
    with running_api(data_dir, max_dataset_bytes=MAX_DATASET_BYTES) as running:
        yield running


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One whole stack (Redis, the API under uvicorn, a worker) for every test that only needs
    jobs to run: boots once per session. Take a new tenant per test; a test that kills,
    restarts or reconfigures processes starts its own with ``running_stack``."""
    from harness.stack import SHARED_STACK_THREADS, running_stack

    threads = {"BNADAPT_WORKER_THREADS": str(SHARED_STACK_THREADS)}
    with running_stack(tmp_path_factory.mktemp("shared-stack"), threads) as stack:
        yield stack
