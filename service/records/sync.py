"""Records of tenants, API keys, models, datasets and jobs, kept in Redis.

Each resource is a hash ``bnadapt:<kind>:<id>`` with its ``tenant_id`` and its public JSON
(``data``); jobs add the fields that change while they run (``status``, ``started_at``,
``finished_at``, ``error``, ``result``), changed only through :meth:`Records.transition`, a
compare-and-set in Lua. A lookup for another tenant's resource answers None, exactly like a
missing one, so the API can only ever say 404.

One class, the records in Redis; its NOTE blocks (attempts, idempotency) map the subtle
parts.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, TypeVar, cast

import redis
from pydantic import BaseModel

from api_schemas import (
    DatasetPublic,
    JobPayload,
    JobPublic,
    JobResultLinks,
    JobStatus,
    ModelPublic,
    Page,
    Progress,
    new_id,
    utc_now,
)
from api_schemas.jobs.public import JobLogEntry
from service.records import keys
from service.records.format import (
    API_KEY_FIELDS,
    API_KEY_PREFIX,
    RESOURCE_FIELDS,
    hash_secret,
    index_member,
    job_from_fields,
    owned_resource,
    split_api_key,
    text,
    verify_api_key,
)
from service.records.paging import newest_first

__all__ = [
    "JOB_LOG_MAX_ENTRIES",
    "ApiKey",
    "JobFilter",
    "JobLogEntry",
    "Records",
    "release_sha_ref",
]

# A job keeps its latest this many log entries (NOTE [ Job logs ] in workers/running/logs.py).
JOB_LOG_MAX_ENTRIES: Final = 500

R = TypeVar("R", bound=BaseModel)

# KEYS[1]: the job hash, KEYS[2]: the running-jobs set, KEYS[3]: the queued-jobs set, KEYS[4]:
# the finished-jobs sorted set. ARGV[1]: allowed current statuses, comma-separated; ARGV[2]:
# the new status; ARGV[3..]: field, value pairs to set with it. Returns the status after the
# call: ARGV[2] if applied, else the unchanged current one. Keeps each job id in the set of its
# status (if any), and an ended job in the finished set, scored by the server's clock.
_TRANSITION_LUA: Final = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if allowed == current then
    redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 3))
    local id = string.sub(KEYS[1], string.len('bnadapt:job:') + 1)
    redis.call('SREM', KEYS[2], id)
    redis.call('SREM', KEYS[3], id)
    if ARGV[2] == 'running' then redis.call('SADD', KEYS[2], id) end
    if ARGV[2] == 'queued' then redis.call('SADD', KEYS[3], id) end
    if ARGV[2] == 'succeeded' or ARGV[2] == 'failed' or ARGV[2] == 'canceled' then
      redis.call('ZADD', KEYS[4], redis.call('TIME')[1], id)
    end
    return ARGV[2]
  end
end
return current
"""


# NOTE [ Job attempts ]
# A job runs up to ``max_attempts`` times when its runs are interrupted (the process killed,
# the heartbeat lost, the queue entry lost); a job failing for its own reasons (an exception
# in the job: bad data, NaN, validation) is failed at once. An interruption is one atomic
# step (_INTERRUPT_LUA): the ended attempt is appended to the record's ``attempts``, and the
# job either goes back to ``queued`` with ``attempt`` + 1, a fresh RQ id ``<job>-attempt-<n>``
# (an RQ maintenance run may still mark the old RQ job failed: it must not touch the new one)
# and ``retry_at`` (exponential backoff), or, after the last attempt, to ``failed``. The RQ
# job of the new attempt is enqueued by the sweep once ``retry_at`` has passed
# (service/upkeep/reaper.py), so a crash between the two steps loses nothing. Effects happen once:
# the first attempt to register a model claims ``keys.job_output`` and later ones reuse that
# model (workers/running/saving.py).
RETRY_BACKOFF_BASE_S: Final = 1.0
RETRY_BACKOFF_MAX_S: Final = 30.0

# KEYS[1]: the job hash, KEYS[2]: the running-jobs set, KEYS[3]: the queued-jobs set, KEYS[4]:
# the finished-jobs sorted set. ARGV[1]: allowed current statuses, comma-separated; ARGV[2]:
# why the attempt ended; ARGV[3]: now (ISO 8601); ARGV[4]: now (seconds since the epoch);
# ARGV[5], ARGV[6]: backoff base and cap (s); ARGV[7]: the RQ id of the attempt that ended,
# or '' for the current one (an old attempt's process must not end a newer attempt). Returns
# the status after the call (see NOTE [ Job attempts ]).
_INTERRUPT_LUA: Final = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
local ok = false
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if allowed == current then ok = true end
end
if not ok then return current end
local rq_id = redis.call('HGET', KEYS[1], 'rq_id')
if ARGV[7] ~= '' and rq_id and rq_id ~= ARGV[7] then return current end
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '1')
local max = tonumber(redis.call('HGET', KEYS[1], 'max_attempts') or '1')
local history = cjson.decode(redis.call('HGET', KEYS[1], 'attempts') or '[]')
local worker = redis.call('HGET', KEYS[1], 'worker')
table.insert(history, {attempt = attempt, worker = worker or cjson.null,
                       ended_at = ARGV[3], reason = ARGV[2]})
local id = string.sub(KEYS[1], string.len('bnadapt:job:') + 1)
redis.call('SREM', KEYS[2], id)
if attempt < max then
  local delay = math.min(tonumber(ARGV[5]) * 2 ^ (attempt - 1), tonumber(ARGV[6]))
  redis.call('HSET', KEYS[1], 'status', 'queued', 'attempt', attempt + 1,
             'attempts', cjson.encode(history), 'retry_at', tonumber(ARGV[4]) + delay,
             'rq_id', id .. '-attempt-' .. (attempt + 1))
  redis.call('HDEL', KEYS[1], 'started_at', 'worker')
  redis.call('SADD', KEYS[3], id)
  return 'queued'
end
local error = ARGV[2]
if max > 1 then error = error .. ' (attempt ' .. attempt .. ' of ' .. max .. ')' end
redis.call('HSET', KEYS[1], 'status', 'failed', 'attempts', cjson.encode(history),
           'error', error, 'finished_at', ARGV[3])
redis.call('SREM', KEYS[3], id)
redis.call('ZADD', KEYS[4], redis.call('TIME')[1], id)
return 'failed'
"""


class ApiKey(BaseModel):
    tenant_id: str
    key: str


@dataclass(frozen=True)
class JobFilter:
    """What GET /v1/jobs filters on; every field given must match (tags: each pair)."""

    kind: str | None = None
    status: JobStatus | None = None
    model_id: str | None = None
    dataset_id: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)

    def matches(self, job: JobPublic) -> bool:
        return (
            (self.kind is None or job.kind == self.kind)
            and (self.status is None or job.status is self.status)
            and (self.model_id is None or job.model_id == self.model_id)
            and (self.dataset_id is None or job.dataset_id == self.dataset_id)
            and all(job.tags.get(k) == v for k, v in self.tags.items())
        )


def release_sha_ref(pipe: redis.client.Pipeline, sha256: str, owner_id: str) -> None:
    """Drops ``owner_id``'s use of a store object, noting when for the store's collector
    (NOTE [ Store garbage collection ] in service/store/gc.py)."""
    pipe.srem(keys.sha_refs(sha256), owner_id)
    pipe.zadd(keys.STORE_RELEASED, {sha256: time.time()})


class Records:
    """All record reads and writes, over one redis-py client (thread-safe, pooled)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._transition = client.register_script(_TRANSITION_LUA)
        self._interrupt = client.register_script(_INTERRUPT_LUA)
        self._mark_enqueued = client.register_script(
            "if redis.call('HGET', KEYS[1], 'rq_id') == ARGV[1] then "
            "redis.call('HDEL', KEYS[1], 'retry_at') end"
        )

    # --- tenants and API keys -------------------------------------------------------------

    def create_api_key(self, tenant_name: str) -> ApiKey:
        """A new key for the tenant named ``tenant_name`` (created on first use). Only the
        secret's sha256 is stored: the key is shown once."""
        tenant_id = self._tenant_id(tenant_name)
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        self.client.hset(
            keys.api_key(key_id),
            mapping={
                "tenant_id": tenant_id,
                "secret_sha256": hash_secret(secret),
                "created_at": utc_now().isoformat(),
            },
        )
        return ApiKey(tenant_id=tenant_id, key=f"{API_KEY_PREFIX}_{key_id}_{secret}")

    def _tenant_id(self, name: str) -> str:
        candidate = new_id("tn")
        # SET NX makes two concurrent creations agree on one id.
        self.client.set(keys.tenant_by_name(name), candidate, nx=True)
        tenant_id = text(self.client.get(keys.tenant_by_name(name)))
        if tenant_id == candidate:
            self.client.hset(
                keys.tenant(tenant_id), mapping={"name": name, "created_at": utc_now().isoformat()}
            )
        return tenant_id

    def list_api_keys(self) -> list[dict[str, str]]:
        """Every key's id, tenant (id and name) and creation time; never its secret (only
        its hash is stored). For operators: a scan of all keys."""
        found = []
        for name in self.client.scan_iter(match=keys.api_key("*"), count=500):
            fields = self._fields(text(name))
            if fields is None:
                continue
            tenant_name = self.client.hget(keys.tenant(fields["tenant_id"]), "name")
            found.append(
                {
                    "key_id": text(name).rsplit(":", 1)[1],
                    "tenant_id": fields["tenant_id"],
                    "tenant": "" if tenant_name is None else text(tenant_name),
                    "created_at": fields.get("created_at", ""),
                }
            )
        return sorted(found, key=lambda k: k["created_at"])

    def revoke_api_key(self, key_or_id: str) -> bool:
        """Deletes a key, named by its id or given whole; False if there is no such key."""
        parts = split_api_key(key_or_id)
        key_id = parts[0] if parts is not None else key_or_id
        return bool(self.client.delete(keys.api_key(key_id)))

    def tenant_for_key(self, presented: str) -> str | None:
        """The tenant a presented key belongs to, or None (see :func:`verify_api_key`)."""
        parts = split_api_key(presented)
        if parts is None:
            return None
        stored = cast(
            "list[bytes | None]", self.client.hmget(keys.api_key(parts[0]), API_KEY_FIELDS)
        )
        return verify_api_key(parts[1], stored)

    # --- models and datasets --------------------------------------------------------------

    def put_model(self, tenant_id: str, model: ModelPublic) -> None:
        pipe = self.client.pipeline()
        self._put(pipe, tenant_id, "model", model.id, model, model.created_at)
        pipe.sadd(keys.sha_refs(model.sha256), model.id)
        pipe.execute()

    def get_model(self, tenant_id: str, model_id: str) -> ModelPublic | None:
        return self._get(tenant_id, "model", model_id, ModelPublic)

    def list_models(self, tenant_id: str, page_size: int, token: str | None) -> Page[ModelPublic]:
        return self._list(tenant_id, "model", ModelPublic, page_size, token)

    def delete_model(self, tenant_id: str, model: ModelPublic) -> None:
        """Deletes the record and drops its reference to the weights, which the store's
        collector deletes once nothing else uses them (NOTE [ Store garbage collection ])."""
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, "model", model.id, model.created_at)
        release_sha_ref(pipe, model.sha256, model.id)
        pipe.execute()

    def put_dataset(self, tenant_id: str, dataset: DatasetPublic) -> None:
        pipe = self.client.pipeline()
        self._put(pipe, tenant_id, "dataset", dataset.id, dataset, dataset.created_at)
        pipe.sadd(keys.sha_refs(dataset.sha256), dataset.id)
        pipe.execute()

    def get_dataset(self, tenant_id: str, dataset_id: str) -> DatasetPublic | None:
        return self._get(tenant_id, "dataset", dataset_id, DatasetPublic)

    def get_model_and_dataset(
        self, tenant_id: str, model_id: str, dataset_id: str
    ) -> tuple[ModelPublic | None, DatasetPublic | None]:
        """Both in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.record("model", model_id), RESOURCE_FIELDS)
        pipe.hmget(keys.record("dataset", dataset_id), RESOURCE_FIELDS)
        model, dataset = pipe.execute()
        return owned_resource(tenant_id, model, ModelPublic), owned_resource(
            tenant_id, dataset, DatasetPublic
        )

    def list_datasets(
        self, tenant_id: str, page_size: int, token: str | None
    ) -> Page[DatasetPublic]:
        return self._list(tenant_id, "dataset", DatasetPublic, page_size, token)

    def delete_dataset(self, tenant_id: str, dataset: DatasetPublic) -> None:
        """Deletes the record and drops its reference to the file (see :meth:`delete_model`)."""
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, "dataset", dataset.id, dataset.created_at)
        release_sha_ref(pipe, dataset.sha256, dataset.id)
        pipe.execute()

    def add_sha_ref(self, sha256: str, owner_id: str) -> None:
        """Marks a store object as used by ``owner_id`` (a model, dataset or job)."""
        self.client.sadd(keys.sha_refs(sha256), owner_id)

    # --- jobs -----------------------------------------------------------------------------

    def create_job(
        self,
        tenant_id: str,
        job: JobPublic,
        payload: JobPayload,
        uses: Iterable[str] = (),
        enqueue: Callable[[redis.client.Pipeline], object] | None = None,
    ) -> None:
        """Writes the job's record, marks the store objects ``uses`` as used by it (the job
        keeps its inputs: deleting the model or dataset later leaves their files) and runs
        ``enqueue`` on the same pipeline: all in one MULTI, so a job is never queued without
        its record or recorded without being queued."""
        pipe = self.client.pipeline()
        pipe.multi()
        self._put(pipe, tenant_id, "job", job.id, job, job.created_at)
        pipe.hset(
            keys.record("job", job.id),
            mapping={
                "status": job.status.value,
                "payload": payload.model_dump_json(),
                "attempt": "1",
                "max_attempts": str(job.max_attempts),
                "rq_id": job.id,
            },
        )
        pipe.sadd(keys.QUEUED_JOBS, job.id)
        for sha256 in uses:
            pipe.sadd(keys.sha_refs(sha256), job.id)
        if enqueue is not None:
            enqueue(pipe)
        pipe.execute()

    def delete_job(self, tenant_id: str, job: JobPublic) -> None:
        """Only for a job that could not be enqueued."""
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, "job", job.id, job.created_at)
        pipe.srem(keys.QUEUED_JOBS, job.id)
        pipe.execute()

    def get_job(self, tenant_id: str, job_id: str) -> JobPublic | None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.record("job", job_id))
        pipe.get(keys.job_progress(job_id))
        fields, progress = pipe.execute()
        return job_from_fields(tenant_id, fields, progress)

    def delete_finished_job(self, tenant_id: str, job: JobPublic) -> None:
        """Deletes an ended job's record, progress and logs, and drops its uses of the store
        objects: its inputs' and its report's (the collector deletes those nothing else uses).
        A model the job registered is a resource of its own and stays."""
        if not job.status.is_terminal:
            raise ValueError(f"job {job.id} is {job.status.value}; only an ended job is deleted")
        job_key = keys.record("job", job.id)
        payload, report = cast(
            "list[bytes | None]", self.client.hmget(job_key, ["payload", "report_sha256"])
        )
        used: list[str] = []
        if payload is not None:
            data = json.loads(payload)
            used += [data["model"]["weights_sha256"], data["dataset"]["sha256"]]
        if report is not None:
            used.append(text(report))
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, "job", job.id, job.created_at)
        pipe.delete(
            keys.job_progress(job.id),
            keys.job_logs(job.id),
            keys.job_log_seq(job.id),
            keys.job_cancel(job.id),
            keys.job_output(job.id),
            keys.job_shards(job.id),
            keys.job_shard_progress(job.id),
        )
        pipe.zrem(keys.FINISHED_JOBS, job.id)
        for sha256 in used:
            release_sha_ref(pipe, sha256, job.id)
        pipe.execute()

    def jobs_finished_before(self, epoch_s: float, limit: int) -> list[tuple[str, str]]:
        """Up to ``limit`` (job id, tenant id) of jobs that ended before ``epoch_s``, oldest
        first; ids whose record is gone are dropped from the finished set on the way."""
        ids = [
            text(m)
            for m in self.client.zrangebyscore(keys.FINISHED_JOBS, "-inf", epoch_s, 0, limit)
        ]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keys.record("job", job_id), "tenant_id")
        found: list[tuple[str, str]] = []
        for job_id, tenant_id in zip(ids, pipe.execute(), strict=True):
            if tenant_id is None:
                self.client.zrem(keys.FINISHED_JOBS, job_id)
            else:
                found.append((job_id, text(tenant_id)))
        return found

    def append_job_logs(
        self,
        job_id: str,
        entries: Iterable[tuple[str, str, str, str]],
        part: str | None = None,
    ) -> None:
        """Appends (at, level, logger, message) entries, keeping the latest
        :data:`JOB_LOG_MAX_ENTRIES`; ``part`` labels them with the part of a sharded job that
        logged them."""
        entries = list(entries)
        if not entries:
            return
        last = int(self.client.incrby(keys.job_log_seq(job_id), len(entries)))
        first = last - len(entries) + 1
        labelled = {} if part is None else {"part": part}
        lines = [
            json.dumps(
                {"seq": first + i, "at": at, "level": level, "logger": name, "message": msg}
                | labelled
            )
            for i, (at, level, name, msg) in enumerate(entries)
        ]
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(keys.job_logs(job_id), *lines)
        pipe.ltrim(keys.job_logs(job_id), -JOB_LOG_MAX_ENTRIES, -1)
        pipe.execute()

    def job_logs(self, job_id: str, after: int = 0) -> list[JobLogEntry]:
        """The kept entries with ``seq`` > ``after``, oldest first."""
        raw = self.client.lrange(keys.job_logs(job_id), 0, -1)
        entries = [JobLogEntry.model_validate_json(line) for line in raw]
        return [entry for entry in entries if entry.seq > after]

    def job_status(self, job_id: str) -> JobStatus | None:
        status = self.client.hget(keys.record("job", job_id), "status")
        return None if status is None else JobStatus(text(status))

    def list_jobs(
        self,
        tenant_id: str,
        page_size: int,
        token: str | None,
        status: JobStatus | None = None,
        where: JobFilter | None = None,
    ) -> Page[JobPublic]:
        where = where or JobFilter(status=status)
        if status is not None and where.status is None:
            where = JobFilter(where.kind, status, where.model_id, where.dataset_id, where.tags)

        def load(job_id: str) -> JobPublic | None:
            job = self.get_job(tenant_id, job_id)
            return job if job is not None and where.matches(job) else None

        return newest_first(
            self.client, keys.tenant_index(tenant_id, "job"), load, page_size, token
        )

    def transition(
        self,
        job_id: str,
        allowed: tuple[JobStatus, ...],
        new: JobStatus,
        fields: Mapping[str, str] | None = None,
    ) -> JobStatus | None:
        """Sets ``new`` (and ``fields``) only if the status is one of ``allowed``, atomically.
        Returns the status after the call (None if there is no such job)."""
        args: list[str] = [",".join(s.value for s in allowed), new.value]
        for name, value in (fields or {}).items():
            args += [name, value]
        result = self._transition(
            keys=[
                keys.record("job", job_id),
                keys.RUNNING_JOBS,
                keys.QUEUED_JOBS,
                keys.FINISHED_JOBS,
            ],
            args=args,
        )
        return None if result is None else JobStatus(text(result))

    def interrupt(
        self,
        job_id: str,
        allowed: tuple[JobStatus, ...],
        reason: str,
        rq_id: str | None = None,
    ) -> JobStatus | None:
        """Ends the current attempt of a job whose run was interrupted: back to ``queued`` for
        another attempt, or ``failed`` with ``reason`` after the last one (NOTE [ Job
        attempts ]). Only if the status is one of ``allowed`` and, with ``rq_id``, if that is
        the current attempt's RQ id; returns the status after."""
        now = utc_now()
        result = self._interrupt(
            keys=[
                keys.record("job", job_id),
                keys.RUNNING_JOBS,
                keys.QUEUED_JOBS,
                keys.FINISHED_JOBS,
            ],
            args=[
                ",".join(s.value for s in allowed),
                reason,
                now.isoformat(),
                now.timestamp(),
                RETRY_BACKOFF_BASE_S,
                RETRY_BACKOFF_MAX_S,
                rq_id or "",
            ],
        )
        return None if result is None else JobStatus(text(result))

    def queue_entry(self, job_id: str) -> tuple[str, float | None, str | None]:
        """The RQ id of the job's current attempt, when it may be enqueued (seconds since
        the epoch) if its enqueueing is still due, and its payload."""
        rq_id, retry_at, payload = cast(
            "list[bytes | None]",
            self.client.hmget(keys.record("job", job_id), ["rq_id", "retry_at", "payload"]),
        )
        return (
            text(rq_id) if rq_id else job_id,
            float(text(retry_at)) if retry_at else None,
            None if payload is None else text(payload),
        )

    def mark_enqueued(self, job_id: str, rq_id: str) -> None:
        """The RQ job ``rq_id`` exists: if it is still the current attempt's, nothing more is
        due (a compare-and-delete: an interruption meanwhile made a newer attempt due)."""
        self._mark_enqueued(keys=[keys.record("job", job_id)], args=[rq_id])

    def max_attempts(self, job_id: str) -> int:
        """How many runs the job may have (NOTE [ Job attempts ]); 1 for a job without the
        field (earlier releases)."""
        raw = self.client.hget(keys.record("job", job_id), "max_attempts")
        return int(text(raw)) if raw else 1

    def claim_output(self, job_id: str, model_id: str) -> str:
        """The id of the model job ``job_id`` registers: ``model_id`` if no attempt of the job
        claimed one before, else that one's (NOTE [ Job attempts ])."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.job_output(job_id), model_id, nx=True)
        pipe.get(keys.job_output(job_id))
        return text(pipe.execute()[1])

    def release_output(self, job_id: str) -> None:
        self.client.delete(keys.job_output(job_id))

    def mark_started(self, job_id: str, worker: str) -> bool:
        new = self.transition(
            job_id,
            (JobStatus.QUEUED,),
            JobStatus.RUNNING,
            {"started_at": utc_now().isoformat(), "worker": worker},
        )
        if new is JobStatus.RUNNING:
            # What it showed while queued ("waiting for a cuda worker") no longer holds.
            self.client.delete(keys.job_progress(job_id))
        return new is JobStatus.RUNNING

    def mark_finished(
        self,
        job_id: str,
        status: JobStatus,
        *,
        error: str | None = None,
        result: JobResultLinks | None = None,
        report_sha256: str | None = None,
        allowed: tuple[JobStatus, ...] = (JobStatus.RUNNING,),
    ) -> bool:
        fields = {"finished_at": utc_now().isoformat()}
        if report_sha256 is not None:
            fields["report_sha256"] = report_sha256
        if error is not None:
            fields["error"] = error
        if result is not None:
            fields["result"] = result.model_dump_json()
        return self.transition(job_id, allowed, status, fields) is status

    def report_sha256(self, job_id: str) -> str | None:
        value = self.client.hget(keys.record("job", job_id), "report_sha256")
        return None if value is None else text(value)

    def started_at(self, job_id: str) -> datetime | None:
        value = self.client.hget(keys.record("job", job_id), "started_at")
        return None if not value else datetime.fromisoformat(text(value))

    def running_jobs(self) -> list[str]:
        return sorted(text(m) for m in self.client.smembers(keys.RUNNING_JOBS))

    def queued_jobs(self) -> list[str]:
        return sorted(text(m) for m in self.client.smembers(keys.QUEUED_JOBS))

    def request_cancel(self, job_id: str) -> None:
        self.client.set(keys.job_cancel(job_id), "1")

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.client.exists(keys.job_cancel(job_id)))

    def write_progress(self, job_id: str, progress: Progress) -> None:
        self.client.set(keys.job_progress(job_id), progress.model_dump_json())

    def beat(self, job_id: str, ttl_s: float) -> None:
        self.client.set(keys.job_heartbeat(job_id), "1", px=int(ttl_s * 1000))

    def heartbeat_alive(self, job_id: str) -> bool:
        return bool(self.client.exists(keys.job_heartbeat(job_id)))

    def remember_idempotency(
        self, tenant_id: str, key: str, body_sha256: str, job_id: str, ttl_s: float
    ) -> tuple[str, str]:
        """Binds ``key`` to (body hash, job id) for ``ttl_s`` unless already bound; returns the
        binding. The API binds with a short lease, made long by :meth:`bind_idempotency` in
        the MULTI that writes the job: NOTE [ Idempotency lease ] in service/api/routes/jobs.py."""
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

    # --- shared ---------------------------------------------------------------------------

    def _fields(self, name: str) -> dict[str, str] | None:
        raw = cast("dict[bytes, bytes]", self.client.hgetall(name))
        if not raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}

    def _put(
        self,
        pipe: redis.client.Pipeline,
        tenant_id: str,
        kind: keys.ResourceKind,
        resource_id: str,
        resource: BaseModel,
        created_at: datetime,
    ) -> None:
        pipe.hset(
            keys.record(kind, resource_id),
            mapping={"tenant_id": tenant_id, "data": resource.model_dump_json()},
        )
        pipe.zadd(keys.tenant_index(tenant_id, kind), {index_member(created_at, resource_id): 0})

    def _delete(
        self,
        pipe: redis.client.Pipeline,
        tenant_id: str,
        kind: keys.ResourceKind,
        resource_id: str,
        created_at: datetime,
    ) -> None:
        pipe.delete(keys.record(kind, resource_id))
        pipe.zrem(keys.tenant_index(tenant_id, kind), index_member(created_at, resource_id))

    def _get(
        self, tenant_id: str, kind: keys.ResourceKind, resource_id: str, schema: type[R]
    ) -> R | None:
        stored = self.client.hmget(keys.record(kind, resource_id), RESOURCE_FIELDS)
        return owned_resource(tenant_id, cast("list[bytes | None]", stored), schema)

    def _list(
        self,
        tenant_id: str,
        kind: keys.ResourceKind,
        schema: type[R],
        page_size: int,
        token: str | None,
    ) -> Page[R]:
        return newest_first(
            self.client,
            keys.tenant_index(tenant_id, kind),
            lambda resource_id: self._get(tenant_id, kind, resource_id, schema),
            page_size,
            token,
        )
