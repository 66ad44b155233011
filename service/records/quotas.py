"""Quotas per tenant: the table of quotas, a tenant's own values, and the counts they bound.

# NOTE [ Tenant quotas ]
Each quota is a setting (``BNADAPT_TENANT_<NAME>``, the default of every tenant) that a tenant
may have its own value of (``keys.tenant_quotas``, set by ``bnadapt tenants set-quota``); 0
means no limit. A request past one raises :class:`~service.errors.QuotaExceededError`, which
the API answers 429 with ``Retry-After``. Every count is checked and changed in the same
atomic step as the records it counts, so two API processes (or two requests racing in one)
never both take the last unit:

- active jobs: ``keys.tenant_active_jobs`` holds the id of every job submitted, written in the
  MULTI that writes the job (``JobRecords.create_job``). A submission WATCHes the set, reads
  the status of its members, and in its MULTI drops those that have ended while adding its own;
  a concurrent submission changes the set and makes the other's EXEC retry. The job's life
  cycle (its Lua transitions) is left alone: an ended job simply stops counting.
- stored bytes: ``keys.tenant_stored_bytes``, added to and taken from in the MULTI that writes
  or deletes a model's or dataset's record (``TenantResources``); a registration WATCHes it.
  A model a job registers is counted but never refused: the job was admitted already. A train
  job's training checkpoint is counted too, as its tenant's, from when it is written to when
  the job is deleted (``CHECKPOINT_BYTES_FIELD`` of the job's hash holds its size; NOTE
  [ Train checkpoint records ] in service/records/train_checkpoints.py); a checkpoint past
  the quota is refused, and the job fails with that error (not retried: the next attempt
  would be refused the same).
  A tenant with no count yet (its resources came before quotas) is counted once from its
  records (its jobs' checkpoints included) before its count is first read or changed
  (:func:`ensure_stored_bytes_counted`): every path that reads or changes the count ensures
  it first, and the count is set only where none exists (SET NX), so a registration that
  raced the first count and changed it after is not lost.
- open uploads: ``keys.tenant_uploads``, one member per resumable or direct upload scored by
  its expiry, added in the MULTI that writes the session and removed when it ends; an upload
  nobody ends stops counting when it expires.
- event streams: ``keys.tenant_streams``, a lease per open stream scored by its expiry (Redis
  server time), taken by a Lua script that drops expired leases and counts, renewed by the
  stream while it runs and removed when it ends (client gone included). A stream whose API
  process died stops counting when its lease expires, ``STREAM_LEASE_S`` at most.
- requests per second: a token bucket per tenant (``keys.tenant_rate``) in a Lua script on
  Redis server time, so every API process draws from the same bucket.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import redis
import redis.asyncio

from api_schemas import JobStatus
from service.errors import QuotaExceededError
from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text
from service.settings import Settings

__all__ = [
    "CHECKPOINT_BYTES_FIELD",
    "QUOTAS",
    "STREAM_LEASE_S",
    "AsyncTenantQuotas",
    "Quota",
    "TenantQuotas",
    "active_job_ids",
    "ensure_stored_bytes_counted",
    "open_upload_within",
    "parse_quota_value",
    "within_quota",
]

# The field of a job's hash that holds its training checkpoint's size, counted in its
# tenant's stored bytes (NOTE [ Tenant quotas ]).
CHECKPOINT_BYTES_FIELD: Final = "train_checkpoint_bytes"
# How long an event stream's lease lasts; the stream renews it every third of that.
STREAM_LEASE_S: Final = 30.0
# Attempts of a WATCH/MULTI before giving up (each retry means another writer won a race).
_WATCH_ATTEMPTS: Final = 50


@dataclass(frozen=True)
class Quota:
    """One row of :data:`QUOTAS`: ``name`` is a tenant's value's name and, as
    ``tenant_<name>``, the setting's field."""

    name: str
    what: str  # what is counted, in a sentence
    remedy: str  # what the tenant can do about it
    retry_after_s: int  # Retry-After when the wait cannot be computed
    integer: bool = True

    @property
    def setting(self) -> str:
        return f"BNADAPT_TENANT_{self.name.upper()}"

    def default(self, settings: Settings) -> float:
        return cast("float", getattr(settings, f"tenant_{self.name}"))

    def exceeded(
        self, limit: float, used: float | None, retry_after_s: float | None = None
    ) -> QuotaExceededError:
        """The 429's error: the limit, its value, the use (when counted) and what to do."""
        shown = f"{limit:g}" if not self.integer else str(int(limit))
        now = "" if used is None else f" (now {used:g})"
        wait = self.retry_after_s if retry_after_s is None else max(1, math.ceil(retry_after_s))
        return QuotaExceededError(
            f"quota {self.name} exceeded: at most {shown} {self.what}{now}; "
            f"{self.remedy}. The limit is the setting {self.setting} or the tenant's own value "
            "(`bnadapt tenants set-quota`): ask the operator to raise it",
            self.name,
            limit,
            wait,
        )


QUOTAS: Final[Mapping[str, Quota]] = {
    quota.name: quota
    for quota in (
        Quota(
            "max_active_jobs",
            "active (queued or running) jobs",
            "wait for some to end or cancel some (POST /v1/jobs/{id}:cancel), then submit again",
            30,
        ),
        Quota(
            "max_stored_bytes",
            "bytes of models, datasets and training checkpoints stored",
            "delete models or datasets you no longer need (DELETE /v1/models/{id}, "
            "DELETE /v1/datasets/{id}), or ended train jobs whose training checkpoints you "
            "no longer need (DELETE /v1/jobs/{id})",
            60,
        ),
        Quota(
            "max_open_uploads",
            "open uploads",
            "complete or delete an open upload (POST /v1/uploads/{id}:complete, DELETE "
            "/v1/uploads/{id}); a direct upload ends when completed or when its URLs expire",
            60,
        ),
        Quota(
            "max_streams",
            "open job event streams",
            "close a stream you no longer read (a stream of an ended job closes by itself)",
            5,
        ),
        Quota(
            "rate_per_s",
            "requests per second",
            "send fewer requests: wait Retry-After seconds",
            1,
            integer=False,
        ),
        Quota(
            "rate_burst",
            "requests at once (the burst of the rate limit)",
            "send fewer requests: wait Retry-After seconds",
            1,
        ),
    )
}


def parse_quota_value(name: str, value: str) -> float | None:
    """A value given for quota ``name`` (``default``: None, the setting's), or ValueError
    saying what is accepted."""
    quota = QUOTAS.get(name)
    if quota is None:
        raise ValueError(f"no quota {name!r}; the quotas are {', '.join(QUOTAS)}")
    if value == "default":
        return None
    try:
        number = int(value) if quota.integer else float(value)
    except ValueError:
        kind = "a whole number" if quota.integer else "a number"
        raise ValueError(f"{name} takes {kind} (0: no limit) or 'default', not {value!r}") from None
    if not number >= 0 or math.isinf(number):  # also NaN
        raise ValueError(f"{name} takes 0 (no limit) or more, not {value!r}")
    return number


def _limit(raw: bytes | str | None, default: float) -> float:
    return default if raw is None else float(text(raw))


def within_quota(
    client: redis.Redis,
    tenant_id: str,
    quota: str,
    default: float | None,
    watched: str,
    used: Callable[[redis.client.Pipeline], float],
    adding: float,
    write: Callable[[redis.client.Pipeline], object],
) -> list[Any]:
    """Runs ``write`` in a MULTI, and answers its results, if ``used`` (read with ``watched``
    WATCHed) plus ``adding`` stays within the tenant's ``quota`` (its own value, else
    ``default``; 0: no limit), else raises :class:`QuotaExceededError`. ``default`` None: not
    checked (``write`` runs).
    ``used`` may read through the pipeline, whose commands run at once until the MULTI."""
    spec = QUOTAS[quota]
    for _ in range(_WATCH_ATTEMPTS):
        with client.pipeline() as pipe:
            try:
                if default is not None:
                    pipe.watch(watched)  # type: ignore[no-untyped-call]
                    limit = _limit(pipe.hget(keys.tenant_quotas(tenant_id), quota), default)
                    now = used(pipe)
                    if limit > 0 and now + adding > limit:
                        raise spec.exceeded(limit, now)
                pipe.multi()
                write(pipe)
                results: list[Any] = pipe.execute()
                return results
            except redis.WatchError:
                continue
    raise redis.WatchError(f"{quota} of tenant {tenant_id}: too many concurrent writers")


def active_job_ids(client: redis.Redis, tenant_id: str, ids: list[str]) -> list[str]:
    """Those of ``ids`` whose job is queued or running."""
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(keys.record("job", job_id), "status")
    active = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
    return [
        job_id
        for job_id, status in zip(ids, pipe.execute(), strict=True)
        if status is not None and text(status) in active
    ]


def ensure_stored_bytes_counted(client: redis.Redis, tenant_id: str) -> None:
    """Counts the tenant's stored bytes from its model and dataset records where it has no
    count yet (NOTE [ Tenant quotas ]); a no-op once it has one."""
    counted = keys.tenant_stored_bytes(tenant_id)
    if client.exists(counted):
        return
    total = 0
    for kind in ("model", "dataset"):
        for member, _ in client.zscan_iter(keys.tenant_index(tenant_id, kind)):
            resource_id = text(member).partition(":")[2]
            data = client.hget(keys.record(kind, resource_id), "data")
            if data is not None:
                total += int(json.loads(data).get("size_bytes", 0))
    for member, _ in client.zscan_iter(keys.tenant_index(tenant_id, "job")):
        job_id = text(member).partition(":")[2]
        checkpoint = client.hget(keys.record("job", job_id), CHECKPOINT_BYTES_FIELD)
        total += int(text(checkpoint)) if checkpoint is not None else 0
    client.set(counted, total, nx=True)


class TenantQuotas(RedisRecords):
    """A tenant's own quota values, what it uses, and the pre-checks that refuse work early."""

    def find_tenant(self, name_or_id: str) -> str | None:
        """The id of the tenant with this name (as given to ``bnadapt keys create``) or id."""
        found = self.client.get(keys.tenant_by_name(name_or_id))
        if found is not None:
            return text(found)
        return name_or_id if self.client.exists(keys.tenant(name_or_id)) else None

    def set_quota(self, tenant_id: str, name: str, value: float | None) -> None:
        """Gives the tenant its own value of quota ``name``; None: back to the setting's."""
        if name not in QUOTAS:
            raise ValueError(f"no quota {name!r}; the quotas are {', '.join(QUOTAS)}")
        if value is None:
            self.client.hdel(keys.tenant_quotas(tenant_id), name)
        else:
            self.client.hset(keys.tenant_quotas(tenant_id), name, repr(value))

    def quota_overrides(self, tenant_id: str) -> dict[str, float]:
        raw = self.client.hgetall(keys.tenant_quotas(tenant_id))
        return {text(k): float(text(v)) for k, v in raw.items() if text(k) in QUOTAS}

    def effective_quotas(self, tenant_id: str, settings: Settings) -> dict[str, float]:
        own = self.quota_overrides(tenant_id)
        return {name: own.get(name, q.default(settings)) for name, q in QUOTAS.items()}

    def quota_usage(self, tenant_id: str) -> dict[str, float]:
        """What the tenant uses now of each counted quota."""
        now = time.time()
        ids = [text(m) for m in self.client.smembers(keys.tenant_active_jobs(tenant_id))]
        ensure_stored_bytes_counted(self.client, tenant_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(keys.tenant_stored_bytes(tenant_id))
        pipe.zcount(keys.tenant_uploads(tenant_id), now, "+inf")
        pipe.zcount(keys.tenant_streams(tenant_id), now * 1000, "+inf")
        stored, uploads, streams = pipe.execute()
        return {
            "max_active_jobs": len(active_job_ids(self.client, tenant_id, ids)),
            "max_stored_bytes": int(stored or 0),
            "max_open_uploads": uploads,
            "max_streams": streams,
        }

    def check_stored_bytes(self, tenant_id: str, adding: int, default: float) -> None:
        """Raises :class:`QuotaExceededError` when ``adding`` bytes would not fit now: the
        early refusal before an upload is read (the registration checks again, atomically)."""
        ensure_stored_bytes_counted(self.client, tenant_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(keys.tenant_quotas(tenant_id), "max_stored_bytes")
        pipe.get(keys.tenant_stored_bytes(tenant_id))
        own, stored = pipe.execute()
        limit, used = _limit(own, default), int(stored or 0)
        if limit > 0 and used + max(adding, 0) > limit:
            raise QUOTAS["max_stored_bytes"].exceeded(limit, used)

    def check_open_uploads(self, tenant_id: str, default: float) -> None:
        """Raises :class:`QuotaExceededError` when no upload may be opened now (the early
        refusal; opening one checks again, atomically)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(keys.tenant_quotas(tenant_id), "max_open_uploads")
        pipe.zcount(keys.tenant_uploads(tenant_id), time.time(), "+inf")
        own, used = pipe.execute()
        limit = _limit(own, default)
        if limit > 0 and used + 1 > limit:
            raise QUOTAS["max_open_uploads"].exceeded(limit, used)


def open_upload_within(
    client: redis.Redis,
    tenant_id: str,
    upload_id: str,
    expires_at: float,
    default: float | None,
    write: Callable[[redis.client.Pipeline], object],
) -> None:
    """Runs ``write`` (the session's record) and counts the upload as open until
    ``expires_at``, in one MULTI, if the tenant may open one more (NOTE [ Tenant quotas ])."""
    key = keys.tenant_uploads(tenant_id)

    def write_counted(pipe: redis.client.Pipeline) -> None:
        write(pipe)
        pipe.zremrangebyscore(key, "-inf", time.time())
        pipe.zadd(key, {upload_id: expires_at})

    within_quota(
        client,
        tenant_id,
        "max_open_uploads",
        default,
        key,
        lambda pipe: float(pipe.zcount(key, time.time(), "+inf")),
        1,
        write_counted,
    )


# KEYS[1]: the tenant's bucket, KEYS[2]: its own quota values. ARGV[1], ARGV[2]: the default
# rate (per second) and burst. Returns {1, ""} when a token was taken (or there is no limit),
# else {0, seconds until one is there, the rate}. Server time, so every API process agrees.
_RATE_BUCKET_LUA: Final = """
local rate = tonumber(redis.call('HGET', KEYS[2], 'rate_per_s') or ARGV[1])
local burst = tonumber(redis.call('HGET', KEYS[2], 'rate_burst') or ARGV[2])
if rate <= 0 then return {1, ''} end
if burst < 1 then burst = math.max(1, rate) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(bucket[1]) or burst
local last = tonumber(bucket[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - last) * rate)
local taken = 0
if tokens >= 1 then
  tokens = tokens - 1
  taken = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
if taken == 1 then return {1, ''} end
return {0, tostring((1 - tokens) / rate), tostring(rate)}
"""

# KEYS[1]: the tenant's stream leases, KEYS[2]: its own quota values. ARGV[1]: the lease id,
# ARGV[2]: the lease (ms), ARGV[3]: the default limit. Drops expired leases; returns {1} when
# the lease was taken, else {0, open streams, the limit, ms until the first lease expires}.
_OPEN_STREAM_LUA: Final = """
local limit = tonumber(redis.call('HGET', KEYS[2], 'max_streams') or ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local open = redis.call('ZCARD', KEYS[1])
if limit > 0 and open >= limit then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, open, tostring(limit), tonumber(first[2]) - now}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + 1000)
return {1}
"""

# KEYS[1]: the tenant's stream leases. ARGV[1]: the lease id, ARGV[2]: the lease (ms).
_RENEW_STREAM_LUA: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + 1000)
"""


class AsyncTenantQuotas:
    """The quotas the API checks on the event loop: the request rate (every request) and the
    event streams' leases (NOTE [ Tenant quotas ])."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._take_token = client.register_script(_RATE_BUCKET_LUA)
        self._open_stream = client.register_script(_OPEN_STREAM_LUA)
        self._renew_stream = client.register_script(_RENEW_STREAM_LUA)

    async def take_request_token(self, tenant_id: str, rate_per_s: float, burst: int) -> None:
        """Takes one request from the tenant's bucket, or raises :class:`QuotaExceededError`
        with the seconds until the next one."""
        if rate_per_s <= 0:
            # No limit by default: a read decides, so a tenant without a rate of its own
            # costs no script (a write to Redis) per request.
            own = await self.client.hget(keys.tenant_quotas(tenant_id), "rate_per_s")
            if own is None or float(text(own)) <= 0:
                return
        result = await self._take_token(
            keys=[keys.tenant_rate(tenant_id), keys.tenant_quotas(tenant_id)],
            args=[repr(float(rate_per_s)), str(burst)],
        )
        if int(result[0]) == 1:
            return
        wait_s, rate = float(text(result[1])), float(text(result[2]))
        raise QUOTAS["rate_per_s"].exceeded(rate, None, retry_after_s=wait_s)

    async def open_stream(
        self, tenant_id: str, lease_id: str, default: int, lease_s: float = STREAM_LEASE_S
    ) -> None:
        """Takes a lease for one more event stream, or raises :class:`QuotaExceededError`."""
        result = await self._open_stream(
            keys=[keys.tenant_streams(tenant_id), keys.tenant_quotas(tenant_id)],
            args=[lease_id, str(int(lease_s * 1000)), str(default)],
        )
        if int(result[0]) == 1:
            return
        open_now, limit, wait_ms = int(result[1]), float(text(result[2])), int(result[3])
        raise QUOTAS["max_streams"].exceeded(limit, open_now, retry_after_s=wait_ms / 1000)

    async def renew_stream(
        self, tenant_id: str, lease_id: str, lease_s: float = STREAM_LEASE_S
    ) -> None:
        await self._renew_stream(
            keys=[keys.tenant_streams(tenant_id)], args=[lease_id, str(int(lease_s * 1000))]
        )

    async def close_stream(self, tenant_id: str, lease_id: str) -> None:
        await self.client.zrem(keys.tenant_streams(tenant_id), lease_id)
