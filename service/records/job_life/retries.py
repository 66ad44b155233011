"""The retry policy: when a job's run ends without the job ending, what it becomes.

Every detector of a lost run calls this module for the verdict (NOTE [ Retry policy ] maps
them); it holds a job's attempts (:class:`JobAttempts`, with the script that ends one), the
enqueueing of the next attempt (:func:`enqueue_attempt`), and the retries of a sharded job's
children (:func:`child_retry`, :func:`rerun_killed_child`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Final, cast

import redis
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError

from api_schemas import JobStatus, utc_now
from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text
from service.records.job_life.jobs import status_keys
from service.records.job_life.queue import enqueue_run
from service.records.job_life.shards import ChildState, ShardRecords
from service.settings import Settings

__all__ = [
    "RETRY_BACKOFF_BASE_S",
    "RETRY_BACKOFF_MAX_S",
    "JobAttempts",
    "child_retry",
    "enqueue_attempt",
    "rerun_killed_child",
]

# NOTE [ Retry policy ]
# Whose fault a run's end was decides: the job's own (an exception in it: bad data, NaN, out
# of memory, its timeout, a bug, validation; or its process killed for memory or its
# timeout) fails it at once, since a retry would fail the same way; an interruption
# (its process or worker lost, its queue entry lost, Redis lost for too long) ends the
# attempt (NOTE [ Job attempts ]: another attempt while ``max_attempts`` allows, with
# backoff). Who sees which end, and what it calls:
#
#   what ended the run                          seen by                           verdict
#   an exception in the job                     run_job (workers/running/job.py)  failed
#   Redis lost past BNADAPT_REDIS_OUTAGE_S      run_job itself                    interrupt
#   the job's process died (a signal)           the RQ worker's horse_killed      interrupt
#                                               (workers/processes/rq_worker.py)
#   ... killed for memory or past its timeout   the same (workers/running/        failed
#                                               capacity.py)
#   out of memory, timed out, NaN (raised)      run_job (workers/running/         failed
#                                               failures.py)
#   running, its heartbeat gone                 reap_stale_jobs                   interrupt
#   queued, its RQ entry gone or ended; forked  reap_lost_queued_jobs             interrupt
#     but never marked running; taken from the  (service/upkeep/reaper.py; the
#     queue by a worker lost before the fork     last by DequeueHolds.judge)
#   an attempt's backoff has passed             reap_lost_queued_jobs             enqueue_attempt
#
# A sharded job's children (NOTE [ Retried children ] in workers/sharding/jobs.py) are RQ jobs
# enqueued with :func:`child_retry`; a child whose process died runs again while RQ has
# retries left for it (:func:`rerun_killed_child`, from fail_killed_child there); one lost
# with its whole worker is put back on its queue by the sweep (``rerun_lost_children`` in
# service/upkeep/reaper.py, through DequeueHolds.judge); a child that raised, or whose
# retries are spent, fails its parent (``end_parent`` in workers/sharding/child.py), and the
# sweep fails a parent whose child died for good (``judge_sharded`` in the reaper). The
# parent itself is never retried as a whole: its children are.

# NOTE [ Job attempts ]
# A job runs up to ``max_attempts`` times when its runs are interrupted (the process killed,
# the heartbeat lost, the queue entry lost); a job failing for its own reasons (an exception
# in the job: bad data, NaN, validation) is failed at once. An interruption is one atomic
# step (_INTERRUPT_LUA): the ended attempt is appended to the record's ``attempts``, and the
# job either goes back to ``queued`` with ``attempt`` + 1, a fresh RQ id ``<job>-attempt-<n>``
# (an RQ maintenance run may still mark the old RQ job failed: it must not touch the new one)
# and ``retry_at`` (exponential backoff), or, after the last attempt, to ``failed``. The RQ
# job of the new attempt is enqueued by the sweep once ``retry_at`` has passed
# (:func:`enqueue_attempt`, from service/upkeep/reaper.py), so a crash between the two steps
# loses nothing. Effects happen once: the first attempt to register a model claims
# ``keys.job_output`` and later ones reuse that model (workers/running/saving.py).
RETRY_BACKOFF_BASE_S: Final = 1.0
RETRY_BACKOFF_MAX_S: Final = 30.0

log = logging.getLogger(__name__)

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
-- It no longer counts against its tenant's active jobs (NOTE [ Tenant quotas ]).
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if tenant then redis.call('ZREM', 'bnadapt:tenant:' .. tenant .. ':active-job-slots', id) end
return 'failed'
"""

# KEYS[1]: the job hash. ARGV[1]: the RQ id just enqueued. A compare-and-delete of the due
# ``retry_at``: only while ARGV[1] is still the current attempt's RQ id.
_MARK_ENQUEUED_LUA: Final = (
    "if redis.call('HGET', KEYS[1], 'rq_id') == ARGV[1] then "
    "redis.call('HDEL', KEYS[1], 'retry_at') end"
)


class JobAttempts(RedisRecords):
    """A job's attempts: how many it may have, how one ends, and when the next is due."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        self._interrupt = client.register_script(_INTERRUPT_LUA)
        self._mark_enqueued = client.register_script(_MARK_ENQUEUED_LUA)

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
            keys=status_keys(job_id),
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


def enqueue_attempt(
    attempts: JobAttempts, settings: Settings, job_id: str, rq_id: str, payload: str
) -> None:
    """Queues the attempt ``rq_id`` whose backoff has passed where the first one waited: the
    queue of the job's device (NOTE [ Queues by device ] in service/settings.py)."""
    fields = json.loads(payload)
    device = str(fields.get("params", {}).get("device", "auto"))
    queue = Queue(settings.job_queue(device), connection=attempts.client, serializer="json")
    with contextlib.suppress(DuplicateJobError):  # another sweep enqueued it a moment ago
        timeout_s = int(fields.get("timeout_s") or settings.job_timeout_s)  # the first's
        enqueue_run(queue, fields, rq_id, timeout_s, f"{job_id} (retry)")
    attempts.mark_enqueued(job_id, rq_id)
    log.info("job %s: attempt %s queued", job_id, rq_id, extra={"job_id": job_id})


def child_retry(max_attempts: int) -> Retry | None:
    """The RQ retry each child of a sharded job of ``max_attempts`` is enqueued with: a child
    runs as many times as the job would (NOTE [ Retried children ] in
    workers/sharding/jobs.py)."""
    return Retry(max=max_attempts - 1) if max_attempts > 1 else None


def rerun_killed_child(
    shard_records: ShardRecords, parent_id: str, child: str, retries_left: int | None
) -> bool:
    """Whether the child ``child`` of the running sharded job ``parent_id``, whose process
    died without raising, runs again: while RQ has ``retries_left`` for it, marked queued
    again (its heartbeat gone) so that its next run claims it, or left queued if it died
    before claiming itself (the fork window). False: the parent must fail."""
    return bool(retries_left) and (
        shard_records.requeue(parent_id, child)
        or (shard_records.children(parent_id) or {}).get(child) is ChildState.QUEUED
    )
