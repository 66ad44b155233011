"""Quotas per tenant: the table of quotas, a tenant's own values, and the counts they bound.

# NOTE [ Tenant quotas ]
Each quota is a setting (``BNADAPT_TENANT_<NAME>``, the default of every tenant) that a tenant
may have its own value of (``keys.tenant_quotas``, set by ``bnadapt tenants set-quota``); 0
means no limit. A request past one raises :class:`~service.errors.QuotaExceededError`, which
the API answers 429 with ``Retry-After``. Every check and the write it guards are one Lua
script (or a reservation taken by one), so two API processes, or any number of requests
racing in one, never both take the last unit and never fail for having raced (no WATCH, no
retries: a WATCH that loses to every concurrent writer can only give up):

- active jobs: ``keys.tenant_active_jobs``, a sorted set. A submission first reserves a slot
  (``_RESERVE_JOB_LUA``: counts, refuses at the limit, else adds the job's id scored by
  server time plus ``JOB_SLOT_GRACE_S``), then writes the record and RQ's enqueue in one MULTI
  without WATCH (RQ's enqueue is a pipeline: it cannot go into Lua), which also scores the id
  +inf; if that MULTI fails the slot is released. A crash between the two steps leaves a
  reservation that lapses after the grace period. A job's end (``_TRANSITION_LUA`` in
  service/records/job_life/jobs.py, ``_INTERRUPT_LUA`` in service/records/job_life/retries.py)
  removes its id in the script that ends it, so the set is exactly the tenant's queued and running
  jobs plus submissions in flight. At the limit the script also drops members whose job is not
  queued or running, before refusing; the set an earlier release kept (``...:active-jobs``,
  read by status) is moved in by the first reservation.
- stored bytes: the bytes of the DISTINCT store objects the tenant holds. A holder is a
  model, a dataset, a job (its inputs, its training checkpoint; a checkpoint it resumed
  from) or an open upload (``upload:<id>``: its reservation, or its parts as they land).
  Per tenant: ``tenant_held_sizes`` (object -> size), ``tenant_held_counts`` (object -> how
  many holders) and ``tenant_holders`` (``<object> <holder>``), with the total in
  ``tenant_stored_bytes``. Holding (``hold`` in ``_PRELUDE_LUA``) adds the holder, and the
  size only for the object's first holder; releasing subtracts only for its last. So two
  resources of the same bytes count once, and deleting a model whose weights a job still
  holds leaves them counted until the job is deleted too (ended jobs are deleted after
  ``BNADAPT_JOB_RETENTION_S``, 30 days by default). A registration with a limit checks
  ``used + what the hold adds`` in the script that writes the record. A model a job
  registers is counted but never refused (the job was admitted); instead a job that will
  register one is refused at submission while the tenant has no room for a model of its
  input's size (service/jobs/submission.py). A train job's training checkpoint is held by the
  job, within the quota (NOTE [ Train checkpoint records ]); past it the job fails with that
  error (not retried: the next attempt would be refused the same). The store's collector
  reads ``keys.sha_refs``, which this leaves as it was.
  A tenant whose holdings were never counted (its resources came before this count) is
  counted once from its records (:func:`ensure_stored_bytes_counted`, one script that holds
  what each record that still exists refers to and sets the total to the sum of the sizes
  held), before the count is first read or changed.
- open uploads: ``keys.tenant_uploads``, one member per resumable or direct upload (and per
  dataset import while it runs) scored by its expiry, added by the script that writes the
  session. An upload reserves its declared bytes (a resumable upload's ``size_bytes``, else
  each part as it lands; a direct upload's size), held as ``upload:<id>``
  (``tenant_upload_holds`` lists what each holds). Completing one releases them (the
  dataset it registers then holds its object), and so does deleting it; an upload nobody
  ends stops counting, bytes included, when it expires: every script first drops the
  tenant's expired uploads and their holds, so nothing needs sweeping.
- event streams: ``keys.tenant_streams``, a lease per open stream scored by its expiry (Redis
  server time), taken by a Lua script that drops expired leases and counts, renewed by the
  stream while it runs and removed when it ends (client gone included). A stream whose API
  process died stops counting when its lease expires, ``STREAM_LEASE_S`` at most.
- requests per second: a token bucket per tenant (``keys.tenant_rate``) in a Lua script on
  Redis server time, so every API process draws from the same bucket.

The scripts that end a job or reserve a slot read keys they build from a job's id or tenant
(``bnadapt:job:<id>``, ``bnadapt:tenant:<id>:active-job-slots``): the service runs on one
Redis (or a primary with replicas), never on a cluster, where that would not be allowed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import redis
import redis.asyncio
from redis.commands.core import Script

from service.errors import QuotaExceededError
from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text
from service.settings import Settings

__all__ = [
    "CHECKPOINT_BYTES_FIELD",
    "CHECKPOINT_SHA_FIELD",
    "HELD_FIELD",
    "JOB_SLOT_GRACE_S",
    "QUOTAS",
    "STREAM_LEASE_S",
    "AsyncTenantQuotas",
    "Quota",
    "TenantQuotas",
    "ensure_stored_bytes_counted",
    "hold_objects",
    "hold_record",
    "hold_upload_objects",
    "keep_job_slot",
    "open_upload",
    "parse_quota_value",
    "release_objects",
    "release_upload",
    "replace_checkpoint",
    "reserve_job_slot",
    "tenant_keys",
]

# The field of a job's hash that holds its training checkpoint's size, counted in its
# tenant's stored bytes (NOTE [ Tenant quotas ]).
CHECKPOINT_BYTES_FIELD: Final = "train_checkpoint_bytes"
# How long an event stream's lease lasts; the stream renews it every third of that.
STREAM_LEASE_S: Final = 30.0
# The field of a job's hash that names its training checkpoint (NOTE [ Train checkpoint
# records ]), and the one that holds the store objects the job holds from its creation
# (JSON: sha256 -> size; its inputs), read when a tenant's holdings are counted from records.
CHECKPOINT_SHA_FIELD: Final = "train_checkpoint"
HELD_FIELD: Final = "held_objects"
# How long an active-job slot reserved for a submission counts before its job record is
# written; a submission that died between the two steps frees its slot after that.
JOB_SLOT_GRACE_S: Final = 60.0


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
            "bytes of distinct stored objects that your models, datasets, jobs (inputs and "
            "training checkpoints) and open uploads hold",
            "delete models or datasets you no longer need (DELETE /v1/models/{id}, "
            "DELETE /v1/datasets/{id}) and the ended jobs that still use them or hold "
            "training checkpoints (DELETE /v1/jobs/{id}), or open uploads you abandoned "
            "(DELETE /v1/uploads/{id})",
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


def tenant_keys(tenant_id: str) -> list[str]:
    """The KEYS every holdings script starts with (``_PRELUDE_LUA``), in its order."""
    return [
        keys.tenant_stored_bytes(tenant_id),
        keys.tenant_held_sizes(tenant_id),
        keys.tenant_held_counts(tenant_id),
        keys.tenant_holders(tenant_id),
        keys.tenant_uploads(tenant_id),
        keys.tenant_upload_holds(tenant_id),
        keys.tenant_quotas(tenant_id),
    ]


# What every holdings script starts with (NOTE [ Tenant quotas ]): KEYS[1..7] are
# ``tenant_keys``. ``hold`` and ``release`` answer the bytes they added or took away.
_PRELUDE_LUA: Final = """
local STORED, SIZES, COUNTS, HOLDERS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local UPLOADS, UPLOAD_HOLDS, QUOTAS = KEYS[5], KEYS[6], KEYS[7]
local function hold(object, size, holder)
  if redis.call('HSETNX', HOLDERS, object .. ' ' .. holder, 1) == 0 then return 0 end
  if redis.call('HINCRBY', COUNTS, object, 1) == 1 then
    redis.call('HSET', SIZES, object, size)
    redis.call('INCRBY', STORED, size)
    return tonumber(size)
  end
  return 0
end
local function release(object, holder)
  if redis.call('HDEL', HOLDERS, object .. ' ' .. holder) == 0 then return 0 end
  if redis.call('HINCRBY', COUNTS, object, -1) > 0 then return 0 end
  local size = tonumber(redis.call('HGET', SIZES, object) or '0')
  redis.call('HDEL', COUNTS, object)
  redis.call('HDEL', SIZES, object)
  redis.call('DECRBY', STORED, size)
  return size
end
local function adds(object, size)
  if redis.call('HEXISTS', COUNTS, object) == 1 then return 0 end
  return tonumber(size)
end
local function used()
  return tonumber(redis.call('GET', STORED) or '0')
end
local function limit_of(name, default)
  if default == '' then return 0 end
  return tonumber(redis.call('HGET', QUOTAS, name) or default)
end
local function release_upload(id, keep_open)
  local held = redis.call('HGET', UPLOAD_HOLDS, id)
  if held then
    for _, object in ipairs(cjson.decode(held)) do release(object, 'upload:' .. id) end
    redis.call('HDEL', UPLOAD_HOLDS, id)
  end
  if not keep_open then redis.call('ZREM', UPLOADS, id) end
end
local function upload_hold(id, object, size)
  local held = cjson.decode(redis.call('HGET', UPLOAD_HOLDS, id) or '[]')
  local known = false
  for _, o in ipairs(held) do if o == object then known = true end end
  if not known then
    table.insert(held, object)
    redis.call('HSET', UPLOAD_HOLDS, id, cjson.encode(held))
  end
  return hold(object, size, 'upload:' .. id)
end
local function drop_expired(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', UPLOADS, '-inf', '(' .. now)) do
    release_upload(id, false)
  end
end
"""

# ARGV[1]: now (s); ARGV[2]: the holder; ARGV[3..]: object, size pairs. No limit.
_HOLD_LUA: Final = (
    _PRELUDE_LUA
    + """
drop_expired(ARGV[1])
for i = 3, #ARGV, 2 do hold(ARGV[i], ARGV[i + 1], ARGV[2]) end
return used()
"""
)

# ARGV[1]: the holder; ARGV[2..]: objects.
_RELEASE_LUA: Final = (
    _PRELUDE_LUA
    + """
for i = 2, #ARGV do release(ARGV[i], ARGV[1]) end
return used()
"""
)

# KEYS[8]: a record's hash, KEYS[9]: its tenant's index, KEYS[10]: the object's sha_refs.
# ARGV[1]: now; ARGV[2]: the default max_stored_bytes ('': not checked); ARGV[3], ARGV[4]: the
# object and its size; ARGV[5]: the holder (the record's id); ARGV[6]: its index member;
# ARGV[7..]: the record's field, value pairs. Returns {1, bytes added} or {0, used, limit}.
_HOLD_RECORD_LUA: Final = (
    _PRELUDE_LUA
    + """
drop_expired(ARGV[1])
local limit = limit_of('max_stored_bytes', ARGV[2])
if limit > 0 and used() + adds(ARGV[3], ARGV[4]) > limit then
  return {0, used(), tostring(limit)}
end
redis.call('HSET', KEYS[8], unpack(ARGV, 7))
redis.call('ZADD', KEYS[9], 0, ARGV[6])
redis.call('SADD', KEYS[10], ARGV[5])
return {1, hold(ARGV[3], ARGV[4], ARGV[5])}
"""
)

# A train job's new training checkpoint in place of its last (NOTE [ Train checkpoint
# records ]). KEYS[8]: the job's hash, KEYS[9]: the new object's sha_refs, KEYS[10]: the old
# one's (or the new one's again), KEYS[11]: STORE_RELEASED. ARGV[1]: now; ARGV[2]: the default
# max_stored_bytes ('': not checked); ARGV[3], ARGV[4]: the new object and its size; ARGV[5]:
# the job; ARGV[6]: the old object ('' when none); ARGV[7], ARGV[8]: the fields that name the
# checkpoint and its size. Returns {1} or {0, used, limit}.
_REPLACE_CHECKPOINT_LUA: Final = (
    _PRELUDE_LUA
    + """
drop_expired(ARGV[1])
local new, old, job = ARGV[3], ARGV[6], ARGV[5]
local limit = limit_of('max_stored_bytes', ARGV[2])
if limit > 0 then
  local freed = 0
  if old ~= '' and old ~= new and redis.call('HEXISTS', HOLDERS, old .. ' ' .. job) == 1
      and tonumber(redis.call('HGET', COUNTS, old) or '0') == 1 then
    freed = tonumber(redis.call('HGET', SIZES, old) or '0')
  end
  if used() - freed + adds(new, ARGV[4]) > limit then return {0, used(), tostring(limit)} end
end
redis.call('SADD', KEYS[9], job)
redis.call('HSET', KEYS[8], ARGV[7], new, ARGV[8], ARGV[4])
hold(new, ARGV[4], job)
if old ~= '' and old ~= new then
  release(old, job)
  redis.call('SREM', KEYS[10], job)
  redis.call('ZADD', KEYS[11], 'GT', ARGV[1], old)
end
return {1}
"""
)

# KEYS[8]: the upload's own record (a hash; written only when ARGV[8..] gives fields).
# ARGV[1]: now; ARGV[2]: the upload's id; ARGV[3]: when it expires (s); ARGV[4]: the default
# max_open_uploads ('': not checked); ARGV[5]: the bytes it reserves (0: none);
# ARGV[6]: the default max_stored_bytes ('': not checked); ARGV[7]: the record's TTL (s);
# ARGV[8..]: the record's field, value pairs. Returns {1} or {0, quota, used, limit}.
_OPEN_UPLOAD_LUA: Final = (
    _PRELUDE_LUA
    + """
drop_expired(ARGV[1])
local open_limit = limit_of('max_open_uploads', ARGV[4])
local open = redis.call('ZCARD', UPLOADS)
if open_limit > 0 and open + 1 > open_limit then
  return {0, 'max_open_uploads', open, tostring(open_limit)}
end
local reserve = tonumber(ARGV[5])
local object = 'upload:' .. ARGV[2]
if reserve > 0 then
  local limit = limit_of('max_stored_bytes', ARGV[6])
  if limit > 0 and used() + adds(object, reserve) > limit then
    return {0, 'max_stored_bytes', used(), tostring(limit)}
  end
end
redis.call('ZADD', UPLOADS, ARGV[3], ARGV[2])
if reserve > 0 then upload_hold(ARGV[2], object, reserve) end
if #ARGV > 7 then
  redis.call('HSET', KEYS[8], unpack(ARGV, 8))
  redis.call('EXPIRE', KEYS[8], ARGV[7])
end
return {1}
"""
)

# ARGV[1]: now; ARGV[2]: the upload; ARGV[3]: the default max_stored_bytes ('': not
# checked); ARGV[4..]: object, size pairs it holds from now on. Returns {1}, {0, used, limit},
# or {2} when the upload is no longer open.
_UPLOAD_HOLD_LUA: Final = (
    _PRELUDE_LUA
    + """
drop_expired(ARGV[1])
if not redis.call('ZSCORE', UPLOADS, ARGV[2]) then return {2} end
local limit = limit_of('max_stored_bytes', ARGV[3])
if limit > 0 then
  local adding = 0
  for i = 4, #ARGV, 2 do adding = adding + adds(ARGV[i], ARGV[i + 1]) end
  if used() + adding > limit then return {0, used(), tostring(limit)} end
end
for i = 4, #ARGV, 2 do upload_hold(ARGV[2], ARGV[i], ARGV[i + 1]) end
return {1}
"""
)

# ARGV[1]: the upload; ARGV[2]: '1' to keep it open (its holds only are released).
_RELEASE_UPLOAD_LUA: Final = (
    _PRELUDE_LUA
    + """
release_upload(ARGV[1], ARGV[2] == '1')
return used()
"""
)

# ARGV[1]: now. Returns {stored bytes, open uploads}, the expired ones dropped.
_USAGE_LUA: Final = (
    _PRELUDE_LUA
    + """
drop_expired(ARGV[1])
return {used(), redis.call('ZCARD', UPLOADS)}
"""
)

# Counting a tenant's holdings from its records (NOTE [ Tenant quotas ]). KEYS[8]: the
# tenant's holdings-counted marker; KEYS[9..]: one record's hash per ARGV triple. ARGV: object,
# size, holder triples. Holds what each record still there holds, then sets the total.
_COUNT_FROM_RECORDS_LUA: Final = (
    _PRELUDE_LUA
    + """
if redis.call('EXISTS', KEYS[8]) == 1 then return 0 end
for i = 1, #ARGV, 3 do
  if redis.call('EXISTS', KEYS[8 + (i + 2) / 3]) == 1 then
    hold(ARGV[i], ARGV[i + 1], ARGV[i + 2])
  end
end
local total = 0
local sizes = redis.call('HVALS', SIZES)
for _, size in ipairs(sizes) do total = total + tonumber(size) end
redis.call('SET', STORED, total)
redis.call('SET', KEYS[8], 1)
return 1
"""
)

# KEYS[1]: the tenant's active-job slots, KEYS[2]: its own quota values, KEYS[3]: the set of
# its active jobs an earlier release kept (moved into KEYS[1] once). ARGV[1]: the job;
# ARGV[2]: the default max_active_jobs ('': not checked); ARGV[3]: the reservation's grace
# (s); ARGV[4]: the prefix of a job's record key. Returns {1} or {0, active, limit}.
_RESERVE_JOB_LUA: Final = """
if redis.call('EXISTS', KEYS[3]) == 1 then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    local status = redis.call('HGET', ARGV[4] .. id, 'status')
    if status == 'queued' or status == 'running' then redis.call('ZADD', KEYS[1], 'inf', id) end
  end
  redis.call('DEL', KEYS[3])
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
local limit = 0
if ARGV[2] ~= '' then
  limit = tonumber(redis.call('HGET', KEYS[2], 'max_active_jobs') or ARGV[2])
end
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '+inf', '+inf')) do
    local status = redis.call('HGET', ARGV[4] .. id, 'status')
    if status ~= 'queued' and status ~= 'running' then redis.call('ZREM', KEYS[1], id) end
  end
  local active = redis.call('ZCARD', KEYS[1])
  if active >= limit then return {0, active, tostring(limit)} end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return {1}
"""

_SCRIPTS: dict[str, Script] = {}


def _script(client: redis.Redis, source: str) -> Script:
    script = _SCRIPTS.get(source)
    if script is None:
        script = _SCRIPTS.setdefault(source, client.register_script(source))
    return script


def _run(
    client: redis.Redis,
    source: str,
    script_keys: list[str],
    args: list[Any],
    pipe: redis.client.Pipeline | None = None,
) -> Any:
    """Runs one of the scripts above on ``client``, or queued on ``pipe`` (a MULTI)."""
    if pipe is not None:
        # EVAL with the source, not the Script object: on a pipeline, redis-py asks SCRIPT
        # EXISTS for its scripts before every EXEC (one round trip more per submission), and
        # an EVALSHA that met NOSCRIPT inside a MULTI would fail alone while the rest ran.
        # Redis caches the compiled script by its digest either way.
        return pipe.eval(source, len(script_keys), *script_keys, *args)
    return _script(client, source)(keys=script_keys, args=args, client=client)


def _default(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _refusal(quota: str, result: list[Any]) -> QuotaExceededError:
    used, limit = float(text(result[-2])), float(text(result[-1]))
    return QUOTAS[quota].exceeded(limit, used)


def hold_objects(
    client: redis.Redis,
    tenant_id: str,
    holder: str,
    objects: Mapping[str, int],
    pipe: redis.client.Pipeline | None = None,
) -> None:
    """Makes ``holder`` (a model, dataset or job id) hold each store object of ``objects``
    (sha256 -> size) in its tenant's stored bytes, without a limit; on ``pipe`` when given."""
    args: list[Any] = [repr(time.time()), holder]
    for sha256, size in objects.items():
        args += [sha256, int(size)]
    _run(client, _HOLD_LUA, tenant_keys(tenant_id), args, pipe)


def release_objects(
    client: redis.Redis,
    tenant_id: str,
    holder: str,
    objects: Iterable[str],
    pipe: redis.client.Pipeline | None = None,
) -> None:
    """Drops ``holder``'s holds of ``objects`` (those it does not hold: nothing)."""
    _run(client, _RELEASE_LUA, tenant_keys(tenant_id), [holder, *objects], pipe)


def hold_record(
    client: redis.Redis,
    tenant_id: str,
    record_key: str,
    index_key: str,
    index_member: str,
    fields: Mapping[str, str],
    sha256: str,
    size: int,
    holder: str,
    max_stored_bytes: float | None,
) -> None:
    """Writes a resource's record and index entry, marks its use of ``sha256`` for the store's
    collector and holds the object as ``holder``: one script, within the tenant's stored-bytes
    quota when ``max_stored_bytes`` (the setting) is given, else
    :class:`QuotaExceededError` and nothing written."""
    ensure_stored_bytes_counted(client, tenant_id)
    args: list[Any] = [
        repr(time.time()),
        _default(max_stored_bytes),
        sha256,
        int(size),
        holder,
        index_member,
    ]
    for name, value in fields.items():
        args += [name, value]
    result = _run(
        client,
        _HOLD_RECORD_LUA,
        [*tenant_keys(tenant_id), record_key, index_key, keys.sha_refs(sha256)],
        args,
    )
    if int(result[0]) != 1:
        raise _refusal("max_stored_bytes", result)


def replace_checkpoint(
    client: redis.Redis,
    tenant_id: str,
    job_id: str,
    sha256: str,
    size: int,
    old: str | None,
    fields: tuple[str, str],
    max_stored_bytes: float | None,
) -> None:
    """``_REPLACE_CHECKPOINT_LUA``: the job's training checkpoint ``sha256`` in place of
    ``old``, within the quota when ``max_stored_bytes`` is given."""
    ensure_stored_bytes_counted(client, tenant_id)
    result = _run(
        client,
        _REPLACE_CHECKPOINT_LUA,
        [
            *tenant_keys(tenant_id),
            keys.record("job", job_id),
            keys.sha_refs(sha256),
            keys.sha_refs(old or sha256),
            keys.STORE_RELEASED,
        ],
        [
            repr(time.time()),
            _default(max_stored_bytes),
            sha256,
            int(size),
            job_id,
            old or "",
            *fields,
        ],
    )
    if int(result[0]) != 1:
        raise _refusal("max_stored_bytes", result)


def open_upload(
    client: redis.Redis,
    tenant_id: str,
    upload_id: str,
    expires_at: float,
    max_open_uploads: float | None,
    *,
    reserve_bytes: int = 0,
    max_stored_bytes: float | None = None,
    record_key: str | None = None,
    fields: Mapping[str, str | int | float] | None = None,
    ttl_s: float = 0,
) -> None:
    """Counts an upload (or an import) open until ``expires_at``, reserving ``reserve_bytes``
    of the tenant's stored bytes, and writes its ``fields`` to ``record_key`` with a TTL: one
    script, if the tenant may open one more (``max_open_uploads``) and the bytes fit
    (``max_stored_bytes``; None: not checked), else :class:`QuotaExceededError`."""
    if reserve_bytes:
        ensure_stored_bytes_counted(client, tenant_id)
    args: list[Any] = [
        repr(time.time()),
        upload_id,
        repr(expires_at),
        _default(max_open_uploads),
        int(reserve_bytes),
        _default(max_stored_bytes),
        max(1, math.ceil(ttl_s)),
    ]
    for name, value in (fields or {}).items():
        args += [name, str(value)]
    result = _run(
        client,
        _OPEN_UPLOAD_LUA,
        [*tenant_keys(tenant_id), record_key or keys.upload(upload_id)],
        args,
    )
    if int(result[0]) != 1:
        raise _refusal(text(result[1]), result)


def hold_upload_objects(
    client: redis.Redis,
    tenant_id: str,
    upload_id: str,
    objects: Mapping[str, int],
    max_stored_bytes: float | None,
) -> bool:
    """Makes the open upload hold ``objects`` (its parts as they land, or its reservation
    again); within the quota when ``max_stored_bytes`` is given, else
    :class:`QuotaExceededError`. False when the upload is no longer open."""
    ensure_stored_bytes_counted(client, tenant_id)
    args: list[Any] = [repr(time.time()), upload_id, _default(max_stored_bytes)]
    for sha256, size in objects.items():
        args += [sha256, int(size)]
    result = _run(client, _UPLOAD_HOLD_LUA, tenant_keys(tenant_id), args)
    if int(result[0]) == 0:
        raise _refusal("max_stored_bytes", result)
    return int(result[0]) == 1


def release_upload(
    client: redis.Redis,
    tenant_id: str,
    upload_id: str,
    *,
    keep_open: bool = False,
    pipe: redis.client.Pipeline | None = None,
) -> None:
    """Ends the upload's count (unless ``keep_open``) and releases what it holds."""
    _run(
        client,
        _RELEASE_UPLOAD_LUA,
        tenant_keys(tenant_id),
        [upload_id, "1" if keep_open else "0"],
        pipe,
    )


def reserve_job_slot(
    client: redis.Redis,
    tenant_id: str,
    job_id: str,
    max_active_jobs: float | None,
    grace_s: float = JOB_SLOT_GRACE_S,
) -> None:
    """Reserves an active-job slot for ``job_id`` for ``grace_s`` (the MULTI that writes the
    job keeps it: :func:`keep_job_slot`), or raises :class:`QuotaExceededError` when the
    tenant has ``max_active_jobs`` (the setting; its own value wins) already."""
    result = _run(
        client,
        _RESERVE_JOB_LUA,
        [
            keys.tenant_active_jobs(tenant_id),
            keys.tenant_quotas(tenant_id),
            f"{keys.PREFIX}:tenant:{tenant_id}:active-jobs",  # an earlier release's set
        ],
        [job_id, _default(max_active_jobs), repr(float(grace_s)), keys.record("job", "")],
    )
    if int(result[0]) != 1:
        raise _refusal("max_active_jobs", result)


def keep_job_slot(pipe: redis.client.Pipeline, tenant_id: str, job_id: str) -> None:
    """In the MULTI that writes the job: its slot counts until the job ends."""
    pipe.zadd(keys.tenant_active_jobs(tenant_id), {job_id: math.inf})


def ensure_stored_bytes_counted(client: redis.Redis, tenant_id: str) -> None:
    """Counts the tenant's holdings from its records where they never were (NOTE [ Tenant
    quotas ]); a no-op once they were."""
    marker = keys.tenant_holdings_counted(tenant_id)
    if client.exists(marker):
        return
    record_keys: list[str] = []
    args: list[Any] = []

    def held(record_key: str, sha256: str, size: int, holder: str) -> None:
        record_keys.append(record_key)
        args.extend([sha256, int(size), holder])

    for kind in ("model", "dataset"):
        for member, _ in client.zscan_iter(keys.tenant_index(tenant_id, kind)):
            resource_id = text(member).partition(":")[2]
            record_key = keys.record(kind, resource_id)
            data = client.hget(record_key, "data")
            if data is not None:
                resource = json.loads(data)
                sha256 = resource.get("sha256")
                if sha256:
                    held(record_key, sha256, int(resource.get("size_bytes", 0)), resource_id)
    for member, _ in client.zscan_iter(keys.tenant_index(tenant_id, "job")):
        job_id = text(member).partition(":")[2]
        record_key = keys.record("job", job_id)
        inputs, checkpoint, checkpoint_bytes = cast(
            "list[bytes | None]",
            client.hmget(record_key, [HELD_FIELD, CHECKPOINT_SHA_FIELD, CHECKPOINT_BYTES_FIELD]),
        )
        for sha256, size in json.loads(inputs or "{}").items():
            held(record_key, sha256, int(size), job_id)
        if checkpoint is not None and checkpoint_bytes is not None:
            held(record_key, text(checkpoint), int(text(checkpoint_bytes)), job_id)
    _run(client, _COUNT_FROM_RECORDS_LUA, [*tenant_keys(tenant_id), marker, *record_keys], args)


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

    def _stored_and_uploads(self, tenant_id: str) -> tuple[int, int]:
        ensure_stored_bytes_counted(self.client, tenant_id)
        stored, uploads = _run(self.client, _USAGE_LUA, tenant_keys(tenant_id), [repr(time.time())])
        return int(stored), int(uploads)

    def quota_usage(self, tenant_id: str) -> dict[str, float]:
        """What the tenant uses now of each counted quota (active jobs: queued or running,
        with the submissions in flight)."""
        stored, uploads = self._stored_and_uploads(tenant_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.zcount(keys.tenant_active_jobs(tenant_id), time.time(), "+inf")
        pipe.zcount(keys.tenant_streams(tenant_id), time.time() * 1000, "+inf")
        active, streams = pipe.execute()
        return {
            "max_active_jobs": active,
            "max_stored_bytes": stored,
            "max_open_uploads": uploads,
            "max_streams": streams,
        }

    def check_stored_bytes(
        self, tenant_id: str, adding: int, default: float, sha256: str | None = None
    ) -> None:
        """Raises :class:`QuotaExceededError` when ``adding`` bytes would not fit now: the
        early refusal before an upload is read or a job that registers a model is queued
        (what writes the bytes checks again, atomically). ``sha256``: the object they are,
        which adds nothing when the tenant holds it already.

        Reads only, on the request path: a script that writes would wait out a pause of
        Redis' writes (a failover, ``CLIENT PAUSE WRITE``) on a thread of the request pool.
        Only a refusal runs the script that drops expired uploads first, so an upload nobody
        ended never refuses a registration."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(keys.tenant_quotas(tenant_id), "max_stored_bytes")
        pipe.exists(keys.tenant_holdings_counted(tenant_id))
        pipe.get(keys.tenant_stored_bytes(tenant_id))
        pipe.hexists(keys.tenant_held_counts(tenant_id), sha256 or "")
        own, counted, stored, held = pipe.execute()
        limit = _limit(own, default)
        if limit <= 0:
            return
        if not counted:
            ensure_stored_bytes_counted(self.client, tenant_id)
            stored = self.client.get(keys.tenant_stored_bytes(tenant_id))
            held = self.client.hexists(keys.tenant_held_counts(tenant_id), sha256 or "")
        adding = 0 if sha256 is not None and held else max(adding, 0)
        if int(stored or 0) + adding <= limit:
            return
        used = self._stored_and_uploads(tenant_id)[0]
        if used + adding > limit:
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
