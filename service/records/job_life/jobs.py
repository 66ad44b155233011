"""The life cycle of jobs: a job's record, its status, and the sets the sweeps read.

A job is a tenant's resource (the layout of service/records/stored/resources.py) whose hash adds the
fields that change while it runs (``status``, ``started_at``, ``finished_at``, ``error``,
``result``), changed only through :meth:`JobRecords.transition`, a compare-and-set in Lua
that keeps each job id in the set of its status (``keys.QUEUED_JOBS``, ``keys.RUNNING_JOBS``)
and an ended job in ``keys.FINISHED_JOBS``. How an interrupted run becomes a new attempt is
the retry policy's (service/records/job_life/retries.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, cast

import redis

from api_schemas import JobPayload, JobPublic, JobResultLinks, JobStatus, Page, utc_now
from service.records import keys
from service.records.format import job_from_fields, text
from service.records.job_life.idempotency import IDEMPOTENCY_FIELD, IdempotencyKeys
from service.records.paging import newest_first
from service.records.stored.resources import TenantResources
from service.records.stored.store_refs import release_sha_ref
from service.records.stored.train_checkpoints import CHECKPOINT_FIELD
from service.records.tenancy.quotas import (
    HELD_FIELD,
    ensure_stored_bytes_counted,
    hold_objects,
    keep_job_slot,
    release_objects,
    reserve_job_slot,
)

__all__ = ["JobFilter", "JobRecords", "status_keys"]

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
      -- It no longer counts against its tenant's active jobs (NOTE [ Tenant quotas ]).
      local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
      if tenant then
        redis.call('ZREM', 'bnadapt:tenant:' .. tenant .. ':active-job-slots', id)
      end
    end
    return ARGV[2]
  end
end
return current
"""


def status_keys(job_id: str) -> list[str]:
    """What a change of the job's status touches, as the KEYS of the scripts that make one
    (here and in service/records/job_life/retries.py): its hash and the sets of jobs by status."""
    return [keys.record("job", job_id), keys.RUNNING_JOBS, keys.QUEUED_JOBS, keys.FINISHED_JOBS]


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


class JobRecords(TenantResources):
    """Jobs written, read, moved between statuses and deleted."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        self._transition = client.register_script(_TRANSITION_LUA)

    def create_job(
        self,
        tenant_id: str,
        job: JobPublic,
        payload: JobPayload,
        uses: Mapping[str, int] | Iterable[str] = (),
        enqueue: Callable[[redis.client.Pipeline], object] | None = None,
        max_active_jobs: float | None = None,
    ) -> None:
        """Writes the job's record, marks the store objects ``uses`` (sha256 -> size, or
        sha256s of no size) as used and held by it (the job keeps its inputs: deleting the
        model or dataset later leaves their files, and their bytes in the tenant's count) and
        runs ``enqueue`` on the same pipeline: all in one MULTI, so a job is never queued
        without its record or recorded without being queued. First an active-job slot is
        reserved: with ``max_active_jobs`` (the setting; the tenant's own value wins) only if
        the tenant is under it, else :class:`~service.errors.QuotaExceededError` and nothing
        written (NOTE [ Tenant quotas ]); the slot is freed if the MULTI fails."""
        held = dict(uses) if isinstance(uses, Mapping) else dict.fromkeys(uses, 0)
        reserve_job_slot(self.client, tenant_id, job.id, max_active_jobs)
        try:
            pipe = self.client.pipeline()
            pipe.multi()  # explicit: RQ's enqueue on the pipeline expects it
            keep_job_slot(pipe, tenant_id, job.id)
            self._write_job(pipe, tenant_id, job, payload, held, enqueue)
            pipe.execute()
        except BaseException:
            with contextlib.suppress(redis.RedisError):
                self.client.zrem(keys.tenant_active_jobs(tenant_id), job.id)
            raise

    def _write_job(
        self,
        pipe: redis.client.Pipeline,
        tenant_id: str,
        job: JobPublic,
        payload: JobPayload,
        held: Mapping[str, int],
        enqueue: Callable[[redis.client.Pipeline], object] | None,
    ) -> None:
        self._put(pipe, tenant_id, "job", job.id, job, job.created_at)
        pipe.hset(
            keys.record("job", job.id),
            mapping={
                "status": job.status.value,
                "payload": payload.model_dump_json(),
                "attempt": "1",
                "max_attempts": str(job.max_attempts),
                "rq_id": job.id,
                HELD_FIELD: json.dumps(held),
            },
        )
        pipe.sadd(keys.QUEUED_JOBS, job.id)
        for sha256 in held:
            pipe.sadd(keys.sha_refs(sha256), job.id)
        hold_objects(self.client, tenant_id, job.id, held, pipe)
        if enqueue is not None:
            enqueue(pipe)

    def delete_job(self, tenant_id: str, job: JobPublic) -> None:
        """Only for a job that could not be enqueued."""
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, "job", job.id, job.created_at)
        pipe.srem(keys.QUEUED_JOBS, job.id)
        pipe.zrem(keys.tenant_active_jobs(tenant_id), job.id)
        held = self.client.hget(keys.record("job", job.id), HELD_FIELD)
        for sha256 in json.loads(held or "{}"):
            release_sha_ref(pipe, sha256, job.id)
        release_objects(self.client, tenant_id, job.id, json.loads(held or "{}"), pipe)
        pipe.execute()

    def get_job(self, tenant_id: str, job_id: str) -> JobPublic | None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.record("job", job_id))
        pipe.get(keys.job_progress(job_id))
        fields, progress = pipe.execute()
        return job_from_fields(tenant_id, fields, progress)

    def delete_finished_job(self, tenant_id: str, job: JobPublic) -> None:
        """Deletes an ended job's record, progress and logs, drops its uses of the store
        objects (its inputs', its report's and its training checkpoint's: the collector
        deletes those nothing else uses) and frees its Idempotency-Key. A model the job
        registered is a resource of its own and stays."""
        if not job.status.is_terminal:
            raise ValueError(f"job {job.id} is {job.status.value}; only an ended job is deleted")
        job_key = keys.record("job", job.id)
        ensure_stored_bytes_counted(self.client, tenant_id)
        payload, report, checkpoint, held, idempotency_key = cast(
            "list[bytes | None]",
            self.client.hmget(
                job_key,
                ["payload", "report_sha256", CHECKPOINT_FIELD, HELD_FIELD, IDEMPOTENCY_FIELD],
            ),
        )
        used: list[str] = list(json.loads(held or "{}"))
        if payload is not None:
            data = json.loads(payload)
            used += [data["model"]["weights_sha256"], data["dataset"]["sha256"]]
            if data.get("resume_sha256"):  # the checkpoint of the job it resumed from
                used.append(data["resume_sha256"])
        for stored in (report, checkpoint):  # NOTE [ Train checkpoint records ]
            if stored is not None:
                used.append(text(stored))
        pipe = self.client.pipeline()
        self._delete(pipe, tenant_id, "job", job.id, job.created_at)
        pipe.delete(
            keys.job_progress(job.id),
            keys.job_logs(job.id),
            keys.job_log_seq(job.id),
            keys.job_cancel(job.id),
            keys.job_epochs(job.id),
            keys.job_output(job.id),
            keys.job_shards(job.id),
            keys.job_shard_progress(job.id),
        )
        pipe.zrem(keys.FINISHED_JOBS, job.id)
        pipe.zrem(keys.tenant_active_jobs(tenant_id), job.id)
        used = list(dict.fromkeys(used))
        for sha256 in used:
            release_sha_ref(pipe, sha256, job.id)
        # NOTE [ Tenant quotas ]: what only this job held leaves the tenant's count.
        release_objects(self.client, tenant_id, job.id, used, pipe)
        if idempotency_key is not None:
            IdempotencyKeys.release_idempotency(pipe, tenant_id, text(idempotency_key), job.id)
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
        result = self._transition(keys=status_keys(job_id), args=args)
        return None if result is None else JobStatus(text(result))

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
