"""The API in the test process: the app object from ``create_app`` under a real uvicorn server on
a free port, over one real Redis-compatible server, with the model inspector answering from a
thread. No RQ worker: jobs are accepted and queued, and stay queued.

This is what the quick tier (plain ``pytest``) tests routes and the contract with. It
is the real HTTP path (uvicorn, the body limits, the problem handlers, auth against keys in
Redis, the store on disk); what it leaves out is only the job process and its boot (a worker
importing torch in a fresh interpreter), which ``harness/stack.py`` starts for the end-to-end
tier.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import uvicorn

from harness.servers import new_redis_server, wait_for
from harness.stack import REPO, Client
from service.api.app import create_app
from service.local.embedded import RedisServer, free_port
from service.records import keys
from service.records.connection import redis_client
from service.records.sync import Records
from service.settings import Settings
from workers.processes import inspector

__all__ = ["MAX_DATASET_BYTES", "InProcessApi", "running_api"]

# How long the API and the inspector get to come up; neither imports anything new by then.
START_TIMEOUT_S: Final = 30.0
# The session API's dataset limit: small, so a test can cross it with a few MiB.
MAX_DATASET_BYTES: Final = 3 * 1024 * 1024


@dataclass
class InProcessApi:
    """A running in-process API; ``client(tenant)`` gives a new tenant and its client."""

    settings: Settings
    redis: RedisServer
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment for a CLI subprocess that talks to this API."""
        return {**os.environ, "PYTHONPATH": str(REPO)}

    def records(self) -> Records:
        return Records(redis_client(self.redis.url))

    def client(self, tenant: str) -> Client:
        return Client(self.url, self.records().create_api_key(tenant).key)

    def anonymous(self) -> Client:
        return Client(self.url, None)


@contextmanager
def running_api(data_dir: Path, **settings: object) -> Iterator[InProcessApi]:
    """Redis on a free port, the inspector in a thread, the API under uvicorn in a thread;
    all stopped on exit. ``settings`` override :class:`Settings` fields."""
    redis = new_redis_server(data_dir / "redis")
    config = Settings(
        redis_url=redis.url,
        data_dir=data_dir / "data",
        **settings,  # type: ignore[arg-type]
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    stop_inspector = threading.Event()
    threads = [
        threading.Thread(target=inspector.serve, args=(config, stop_inspector), daemon=True),
        threading.Thread(target=server.run, daemon=True),
    ]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: server.started, START_TIMEOUT_S, what="the in-process API to start")
        client = redis_client(redis.url)
        wait_for(
            lambda: client.exists(keys.INSPECTORS_ALIVE),
            START_TIMEOUT_S,
            what="the in-process inspector to publish",
        )
        yield InProcessApi(config, redis, port)
    finally:
        server.should_exit = True
        stop_inspector.set()
        for thread in threads:
            thread.join(timeout=START_TIMEOUT_S)
        redis.stop()
