"""The reads every request makes, on the event loop: the caller's tenant and a job's record.

They are :class:`service.records.sync.Records`'s reads over ``redis.asyncio``, sharing its
parsing (service/records/format.py), so an ``async def`` route that needs nothing else never
waits for a thread of the pool: polling ``GET /v1/jobs/{id}`` is most of an API's traffic.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio

from api_schemas import JobPublic
from service.records import keys
from service.records.connection import REDIS_SOCKET_TIMEOUT_S
from service.records.format import API_KEY_FIELDS, job_from_fields, split_api_key, verify_api_key

__all__ = ["AsyncRecords", "async_redis_client"]


def async_redis_client(url: str) -> redis.asyncio.Redis:
    """Like :func:`service.records.connection.redis_client`, for the event loop it is created on."""
    return redis.asyncio.Redis.from_url(
        url,
        socket_connect_timeout=5,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )


class AsyncRecords:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client

    async def tenant_for_key(self, presented: str) -> str | None:
        parts = split_api_key(presented)
        if parts is None:
            return None
        stored = await self.client.hmget(keys.api_key(parts[0]), API_KEY_FIELDS)
        return verify_api_key(parts[1], cast("list[bytes | None]", stored))

    async def job_log_lines(self, job_id: str) -> list[bytes]:
        """The job's kept log entries as stored (JSON), oldest first."""
        lines = await self.client.lrange(keys.job_logs(job_id), 0, -1)
        return [line.encode() if isinstance(line, str) else line for line in lines]

    async def job_epochs(self, job_id: str) -> list[tuple[int, bytes]]:
        """A train job's validated epochs as stored (JSON), by epoch number, in epoch order."""
        fields = await self.client.hgetall(keys.job_epochs(job_id))
        found = [(int(k), v.encode() if isinstance(v, str) else v) for k, v in fields.items()]
        return sorted(found)

    async def tenant_and_job(
        self, presented: str, job_id: str
    ) -> tuple[str | None, JobPublic | None]:
        """The tenant of the API key ``presented`` (None: not a valid key) and, when it is
        valid, that tenant's job ``job_id`` (None: missing or another tenant's), in one round
        trip: polling a job is most of an API's traffic."""
        parts = split_api_key(presented)
        if parts is None:
            return None, None
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.api_key(parts[0]), API_KEY_FIELDS)
            pipe.hgetall(keys.record("job", job_id))
            pipe.get(keys.job_progress(job_id))
            stored, fields, progress = await pipe.execute()
        tenant_id = verify_api_key(parts[1], cast("list[bytes | None]", stored))
        if tenant_id is None:
            return None, None
        return tenant_id, job_from_fields(tenant_id, fields, progress)

    async def get_job(self, tenant_id: str, job_id: str) -> JobPublic | None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.record("job", job_id))
            pipe.get(keys.job_progress(job_id))
            fields, progress = await pipe.execute()
        return job_from_fields(tenant_id, fields, progress)
