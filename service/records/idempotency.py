"""Idempotency keys of job submissions: ``keys.idempotency(tenant, key)`` holds
``<body sha256>:<job id>``, first as a short lease, then for the key's full lifetime once the
job is written (NOTE [ Idempotency lease ] in service/jobs/idempotency.py)."""

from __future__ import annotations

import redis

from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text

__all__ = ["IdempotencyKeys"]


class IdempotencyKeys(RedisRecords):
    """Bindings of idempotency keys to the jobs they submitted."""

    def remember_idempotency(
        self, tenant_id: str, key: str, body_sha256: str, job_id: str, ttl_s: float
    ) -> tuple[str, str]:
        """Binds ``key`` to (body hash, job id) for ``ttl_s`` unless already bound; returns the
        binding. The API binds with a short lease, made long by :meth:`bind_idempotency` in
        the MULTI that writes the job: NOTE [ Idempotency lease ] in service/jobs/idempotency.py."""
        name = keys.idempotency(tenant_id, key)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(name, f"{body_sha256}:{job_id}", nx=True, px=max(int(ttl_s * 1000), 1))
        pipe.get(name)
        bound = text(pipe.execute()[1])
        body, _, bound_job = bound.partition(":")
        return body, bound_job

    @staticmethod
    def bind_idempotency(
        pipe: redis.client.Pipeline,
        tenant_id: str,
        key: str,
        body_sha256: str,
        job_id: str,
        ttl_s: int,
    ) -> None:
        """Queues on ``pipe`` the long binding of ``key`` to the job it writes."""
        pipe.set(keys.idempotency(tenant_id, key), f"{body_sha256}:{job_id}", ex=ttl_s)

    def forget_idempotency(self, tenant_id: str, key: str) -> None:
        self.client.delete(keys.idempotency(tenant_id, key))
