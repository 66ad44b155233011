"""The root of every class of records (service/records/sync.py lists them): each takes one
redis-py client and is usable alone, as RQ's registries are; :class:`service.records.sync.Records`
combines them."""

from __future__ import annotations

import redis

__all__ = ["RedisRecords"]


class RedisRecords:
    """Records of one concern over one redis-py client (thread-safe, pooled).

    Subclasses that register scripts do it in ``__init__`` after ``super().__init__(client)``,
    so that a class combining several of them (``Records``) initializes each exactly once."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
