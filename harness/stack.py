"""The whole service as separate processes, for end-to-end tests: a Redis-compatible server, the
API under uvicorn, and a worker (``python -m workers.processes.supervisor``: RQ worker +
inspector), each on free ports, all state under one directory."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import numpy as np
from rq import Worker

from api_schemas import JobPayload
from harness.servers import new_redis_server, stop_process, wait_for
from service.client import Client as ApiClient
from service.local.embedded import RedisServer, free_port
from service.local.up import api_command, worker_command
from service.records import keys
from service.records.connection import redis_client
from service.records.sync import Records

REPO = Path(__file__).resolve().parent.parent
# A test's requests give up sooner than a user's: a hung API fails the test within a minute.
TEST_TIMEOUT_S: Final = 60.0
# The torch threads of the shared stack's worker (conftest.py's `shared_stack`): tests that
# compute a reference in process use as many, since training's reductions depend on it.
SHARED_STACK_THREADS = 1


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@dataclass
class Stack:
    """A running API and worker over one Redis; ``start_worker``/``stop_worker`` and
    ``start_api``/``stop_api`` can be called again to test restarts."""

    data_dir: Path
    redis: RedisServer
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    api_port: int = field(default_factory=free_port)
    api: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    # Workers started by add_worker, beside `worker`: all take jobs from the same queue.
    more_workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # Each worker's own data directory, as on machines of their own (the store must then be
    # shared another way: an S3 bucket); None: all share data_dir.
    worker_data_dirs: list[Path] | None = None
    # The workers' --device: which queue they serve (cpu; cuda on a GPU machine).
    worker_device: str = "cpu"
    # uvicorn processes of the API (``bnadapt up`` runs 2 by default).
    api_processes: int = 1
    _workers_started: int = 0

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "BNADAPT_REDIS_URL": self.redis.url,
            "BNADAPT_DATA_DIR": str(self.data_dir),
            "BNADAPT_HEARTBEAT_TIMEOUT_S": "4",
            "PYTHONPATH": str(REPO),
            **self.env_overrides,
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def records(self) -> Records:
        return Records(redis_client(self.redis.url))

    def api_argv(self) -> list[str]:
        return api_command("127.0.0.1", self.api_port, self.api_processes)

    def start_api(self, timeout_s: float = 30) -> None:
        self.api = subprocess.Popen(self.api_argv(), env=self.env, cwd=REPO)

        def ready() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout_s=timeout_s, what="the API to answer /healthz")

    def stop_api(self) -> None:
        if self.api is not None:
            stop_process(self.api)
            self.api = None

    @property
    def worker_log(self) -> Path:
        """What the workers printed (RQ's lines included), for tests that read it."""
        return self.data_dir / "worker.log"

    def _spawn_worker(self) -> subprocess.Popen[bytes]:
        env = self.env
        if self.worker_data_dirs is not None:
            own = self.worker_data_dirs[self._workers_started % len(self.worker_data_dirs)]
            env["BNADAPT_DATA_DIR"] = str(own)
        self._workers_started += 1
        self.worker_log.parent.mkdir(parents=True, exist_ok=True)
        with self.worker_log.open("ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                worker_command(self.worker_device),
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for kill_worker_group
            )

    def add_worker(self) -> None:
        """One more worker (RQ worker + inspector) on the same Redis and store; returns once
        every worker's RQ worker is registered."""
        self.more_workers.append(self._spawn_worker())
        expected = len(self.more_workers) + (self.worker is not None)
        client = redis_client(self.redis.url)
        wait_for(
            lambda: len(Worker.all(connection=client)) >= expected,
            timeout_s=60,
            what=f"{expected} RQ workers to register",
        )

    def start_worker(self) -> None:
        self.worker = self._spawn_worker()
        client = redis_client(self.redis.url)
        wait_for(
            lambda: bool(client.exists("bnadapt:inspectors-alive")),
            timeout_s=60,
            what="the worker's inspector to come up",
        )

    def stop_worker(self) -> None:
        if self.worker is not None:
            stop_process(self.worker, timeout_s=40)
            self.worker = None

    def kill_worker_group(self) -> None:
        """SIGKILL the supervisor, its RQ worker, inspector and any job process at once: a
        machine lost."""
        assert self.worker is not None
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait()
        self.worker = None

    def stop(self) -> None:
        self.stop_api()
        self.stop_worker()
        while self.more_workers:
            stop_process(self.more_workers.pop(), timeout_s=40)

    def client(self, tenant: str) -> Client:
        key = self.records().create_api_key(tenant).key
        return Client(self.url, key)


@contextmanager
def running_stack(
    data_dir: Path,
    env_overrides: Mapping[str, str] | None = None,
    workers: int = 1,
    separate_machines: bool = False,
    worker_device: str = "cpu",
    api_processes: int = 1,
) -> Iterator[Stack]:
    """A Redis-compatible server, ``workers`` workers and the API with all state under
    ``data_dir``; everything stopped on exit. ``separate_machines``: the API keeps its data in
    ``data_dir/api`` and each worker in ``data_dir/worker-<i>``, sharing only Redis and what
    ``env_overrides`` name (an S3 store). ``worker_device``: the workers' --device;
    ``api_processes``: the API's uvicorn processes."""
    redis = new_redis_server(data_dir / "redis")
    stack = Stack(
        data_dir / "api" if separate_machines else data_dir,
        redis,
        env_overrides or {},
        worker_device=worker_device,
        api_processes=api_processes,
    )
    if separate_machines:
        stack.worker_data_dirs = [data_dir / f"worker-{i}" for i in range(workers)]
    try:
        stack.start_worker()
        for _ in range(workers - 1):
            stack.add_worker()
        stack.start_api()
        yield stack
    finally:
        stack.stop()
        stack.redis.stop()


class Client:
    """A test's client for one tenant: :class:`service.client.Client` (``api``: the key, the
    base URL, the connection, shared by ``http``) with helpers that answer the raw
    :class:`httpx.Response`, so that a test can check every status, header and error body.
    ``key`` None or empty: an anonymous client, for the tests of authentication."""

    def __init__(self, url: str, key: str | None) -> None:
        self.api = ApiClient(url, key or "", timeout_s=TEST_TIMEOUT_S)
        if not key:
            # No Authorization header at all: what a caller without a key sends.
            del self.api.http.headers["Authorization"]
        self.http = self.api.http

    def add_model(
        self,
        architecture: str,
        kwargs: dict[str, Any] | None = None,
        weights: bytes | None = None,
        seed: int = 0,
    ) -> httpx.Response:
        meta = {"architecture": architecture, "kwargs": kwargs or {}, "seed": seed}
        files = {"weights": ("w.safetensors", weights)} if weights is not None else None
        return self.api.request("POST", "/v1/models", data={"meta": json.dumps(meta)}, files=files)

    def add_dataset(self, content: bytes, name: str = "data.npz") -> httpx.Response:
        return self.api.request("POST", "/v1/datasets", files={"file": (name, content)})

    def submit(self, body: dict[str, Any], **headers: str) -> httpx.Response:
        return self.api.request("POST", "/v1/jobs", json=body, headers=headers)

    def wait(self, job_id: str, timeout_s: float = 120) -> dict[str, Any]:
        """The job once it ended, as the API writes it (JSON)."""
        return self.api.wait(job_id, timeout_s=timeout_s).model_dump(mode="json")


def job_payload(stack: Stack, job_id: str) -> JobPayload:
    """The payload the API enqueued for a job, read from its record."""
    raw = stack.records().client.hget(keys.record("job", job_id), "payload")
    assert raw is not None, f"no job {job_id}"
    return JobPayload.model_validate_json(raw)
