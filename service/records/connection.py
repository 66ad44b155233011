"""How every process of the service connects to Redis."""

from __future__ import annotations

from typing import Final

import redis

__all__ = ["REDIS_BLOCK_SLICE_S", "REDIS_SOCKET_TIMEOUT_S", "redis_client"]

REDIS_SOCKET_TIMEOUT_S: Final = 10.0
# Longest single blocking command (BLPOP); must stay below REDIS_SOCKET_TIMEOUT_S.
REDIS_BLOCK_SLICE_S: Final = 5.0


def redis_client(url: str) -> redis.Redis:
    """A pooled, thread-safe client. Every read times out (a hung server must not hang a
    request thread forever), so blocking pops wait in slices of ``REDIS_BLOCK_SLICE_S``."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=5,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )
