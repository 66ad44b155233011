"""Helpers that start and stop the real processes tests run against.

Fixtures in ``conftest.py`` stay thin and call these. Add a helper here for each kind of
process (the API under uvicorn, an RQ worker), following the Redis one: start it on a free
port, wait until it answers, and stop it on teardown, even when the test failed.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

from service.local.embedded import RedisServer, free_port

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S",
    "free_port",
    "new_redis_server",
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
