"""Idempotency keys of job submissions: ``keys.idempotency(tenant, key)`` holds
``<body sha256>:<job id>``, first as a short lease, then for the key's full lifetime once the
job is written (NOTE [ Idempotency lease ] in service/jobs/idempotency.py). The job's record
names its key (field ``idempotency_key``), so that deleting the job frees the key."""

from __future__ import annotations

from typing import Final

import redis

from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text

__all__ = ["IDEMPOTENCY_FIELD", "IdempotencyKeys"]

# The job record's field that names the Idempotency-Key the job was submitted with.
IDEMPOTENCY_FIELD: Final = "idempotency_key"
# KEYS[1]: the key's binding; ARGV[1]: the job id. Deletes the binding only while it still
# names that job (a later request may have bound the key anew).
_RELEASE_LUA: Final = """
local bound = redis.call('GET', KEYS[1])
if bound and string.sub(bound, -string.len(ARGV[1]) - 1) == ':' .. ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


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
        """Queues on ``pipe`` the long binding of ``key`` to the job it writes, and the key's
        name on the job's record (written earlier on the same pipe)."""
        pipe.set(keys.idempotency(tenant_id, key), f"{body_sha256}:{job_id}", ex=ttl_s)
        pipe.hset(keys.record("job", job_id), IDEMPOTENCY_FIELD, key)

    @staticmethod
    def release_idempotency(
        pipe: redis.client.Pipeline, tenant_id: str, key: str, job_id: str
    ) -> None:
        """Queues on ``pipe`` the end of ``key``'s binding to ``job_id``, the job being
        deleted: a request with the key then makes a new job instead of answering 409."""
        pipe.eval(_RELEASE_LUA, 1, keys.idempotency(tenant_id, key), job_id)

    def forget_idempotency(self, tenant_id: str, key: str) -> None:
        self.client.delete(keys.idempotency(tenant_id, key))
