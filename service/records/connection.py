"""How every process of the service connects to Redis."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

__all__ = ["REDIS_BLOCK_SLICE_S", "REDIS_SOCKET_TIMEOUT_S", "OutageRetry", "redis_client"]

T = TypeVar("T")

REDIS_SOCKET_TIMEOUT_S: Final = 10.0
# Longest single blocking command (BLPOP); must stay below REDIS_SOCKET_TIMEOUT_S.
REDIS_BLOCK_SLICE_S: Final = 5.0


class OutageRetry(Retry):
    """Retries a command on connection errors and timeouts, with exponential backoff (0.1 s
    doubling to 2 s), until ``outage_s`` has passed since its first failure; then the last
    error propagates. Commands are sent again whole: ours are idempotent (sets, hash writes,
    compare-and-set scripts), so a reply lost to the outage does no harm when redone."""

    def __init__(self, outage_s: float) -> None:
        if outage_s <= 0:
            raise ValueError(f"outage_s must be > 0, got {outage_s}")
        super().__init__(ExponentialBackoff(cap=2.0, base=0.1), retries=-1)
        self.outage_s = outage_s

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()  # type: ignore[no-untyped-call]
        failures = 0
        deadline: float | None = None
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                deadline = deadline or time.monotonic() + self.outage_s
                pause = self._backoff.compute(failures)
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)


def redis_client(url: str, outage_s: float | None = None) -> redis.Redis:
    """A pooled, thread-safe client. Every read times out (a hung server must not hang a
    request thread forever), so blocking pops wait in slices of ``REDIS_BLOCK_SLICE_S``. With
    ``outage_s`` (a running job's client), commands ride out a Redis outage that long
    (:class:`OutageRetry`); without, they fail at once (the API answers 503)."""
    extra: dict[str, Any] = {}
    if outage_s is not None:
        extra = {"retry": OutageRetry(outage_s), "retry_on_error": [redis.ConnectionError]}
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=5,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        health_check_interval=30,
        **extra,
    )
