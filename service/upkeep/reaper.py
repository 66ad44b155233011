"""Ends jobs whose process is gone, so no job stays `queued` or `running` forever.

A running job refreshes its heartbeat key about twice a second from a thread of the job's own
process. If the worker or the job's process is killed (SIGKILL, out of memory, a machine
lost), the key expires and the next sweep marks the job failed. A queued job is compared with
RQ's view of it (:func:`reap_lost_queued_jobs`): its process may have died after RQ forked it
and before it marked itself running. Verdicts are compare-and-sets, so the API and every
worker supervisor may sweep at once. How fast: NOTE [ Heartbeat bound ]. What becomes of a
lost run, a new attempt or a failure, is the retry policy's (NOTE [ Retry policy ] in
service/records/job_life/retries.py).

A sharded job (see NOTE [ Sharded adaptation ] in workers/sharding/compute.py) has no process of
its own once its shards are queued: it is judged by its children instead (:func:`judge_sharded`). It
lives as long as each of them is queued, running with a heartbeat, or done; a child lost with its
whole worker is queued again (:func:`rerun_lost_children`) while it has retries left; the job
fails within a heartbeat timeout of a child's process dying otherwise, and ends canceled when a
cancel was asked for and no child is running to notice it.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Final, cast

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RqStatus

from api_schemas import JobStatus, utc_now
from service.records import keys
from service.records.format import text
from service.records.job_life.dequeues import DequeueHolds, Taken
from service.records.job_life.retries import enqueue_attempt
from service.records.job_life.shards import (
    ChildState,
    ShardRecords,
    child_job_id,
    describe_child,
    is_shard,
)
from service.records.sync import Records
from service.settings import Settings

__all__ = [
    "MAX_SWEEP_INTERVAL_S",
    "enqueue_ready_children",
    "heartbeat_key_ttl_s",
    "judge_sharded",
    "reap_lost_queued_jobs",
    "reap_stale_jobs",
    "rerun_lost_children",
    "sweep_interval_s",
]

# A child in one of these states while its parent still runs means the parent cannot finish.
_ENDED_EARLY: Final = (ChildState.FAILED, ChildState.STOPPED, ChildState.CANCELED)

log = logging.getLogger(__name__)

# NOTE [ Heartbeat bound ]
# A job whose process dies at time d ends terminal by d + BNADAPT_HEARTBEAT_TIMEOUT_S (T),
# while any API or worker runs sweeps. The heartbeat key lives ``heartbeat_key_ttl_s(T)`` =
# T - 2 I after the last beat (which came before d), with I = ``sweep_interval_s(T)``: the
# key is gone by d + T - 2 I, the next sweep starts within I of that, and one more I is left
# for the sweep's own round trips. A job just marked running is given the same TTL before its
# missing heartbeat counts (its first beat follows the mark within milliseconds). A queued job
# whose RQ job started (its process was forked) is judged the same way from RQ's start time.
# T = 30 s: sweeps every 5 s, heartbeat TTL 20 s. Heartbeats lost to a Redis outage do not
# count: a sweep judges them only after seeing Redis for a TTL again
# (service/upkeep/housekeeping.py), while the job rides the outage out (BNADAPT_REDIS_OUTAGE_S,
# service/records/connection.py).
MAX_SWEEP_INTERVAL_S: Final = 5.0


def sweep_interval_s(heartbeat_timeout_s: float) -> float:
    """How often housekeeping sweeps (NOTE [ Heartbeat bound ])."""
    return min(MAX_SWEEP_INTERVAL_S, heartbeat_timeout_s / 6)


def heartbeat_key_ttl_s(heartbeat_timeout_s: float) -> float:
    """The TTL of a job's heartbeat key (NOTE [ Heartbeat bound ])."""
    return heartbeat_timeout_s - 2 * sweep_interval_s(heartbeat_timeout_s)


def enqueue_ready_children(client: redis.Redis, queue_name: str) -> int:
    """Moves to the queue the children whose dependencies are done but that RQ left in its
    ready registry; returns how many.

    RQ 3 moves a finished job's dependents to the queue right away, under a WATCH on the whole
    ready registry of the queue: when another worker changes that registry meanwhile (its own
    job's dependents), the move is skipped and left to RQ's maintenance, which runs only every
    10 minutes and only between dequeues. A sharded job's merge, evaluation children or
    finish then sat idle for that long; this sweep moves them within a housekeeping interval.
    The move is RQ's own, safe against doing it twice."""
    queue = Queue(queue_name, connection=client, serializer="json")
    return len(queue.ready_job_registry.cleanup())


def reap_stale_jobs(records: Records, heartbeat_timeout_s: float) -> list[str]:
    """Marks failed every running job without a heartbeat; returns their ids."""
    reaped = []
    grace = timedelta(seconds=heartbeat_key_ttl_s(heartbeat_timeout_s))
    shard_records = ShardRecords(records.client)
    for job_id in records.running_jobs():
        children = shard_records.children(job_id)
        if children is not None:
            children = rerun_lost_children(
                records, shard_records, job_id, children, heartbeat_timeout_s
            )
            verdict = judge_sharded(records, shard_records, job_id, children, heartbeat_timeout_s)
            if verdict is not None:
                status, error = verdict
                if records.mark_finished(job_id, status, error=error):
                    log.warning(
                        "sharded job %s %s: %s",
                        job_id,
                        status.value,
                        error,
                        extra={"job_id": job_id},
                    )
                    reaped.append(job_id)
                shard_records.discard(job_id)
            continue
        if records.heartbeat_alive(job_id):
            continue
        started = records.started_at(job_id)
        if started is not None and utc_now() - started < grace:
            continue  # just started: its first heartbeat may not be written yet
        error = (
            f"the process running this job stopped sending heartbeats for "
            f"{heartbeat_timeout_s:g} s (killed, out of memory, or its machine was lost); "
            "nothing it was writing was kept"
        )
        now = records.interrupt(job_id, (JobStatus.RUNNING,), error)
        if now in (JobStatus.QUEUED, JobStatus.FAILED):
            log.warning("job %s lost its heartbeat: now %s", job_id, now, extra={"job_id": job_id})
            reaped.append(job_id)
    return reaped


# RQ states of a job that a worker will still take.
_WAITING: Final = frozenset(
    {
        RqStatus.CREATED,
        RqStatus.QUEUED,
        RqStatus.DEFERRED,
        RqStatus.SCHEDULED,
        RqStatus.RATE_LIMITED,
        RqStatus.READY_TO_ENQUEUE,
    }
)


_WAITING_ARG: Final = ",".join(sorted(status.value for status in _WAITING))


def _aware(moment: datetime) -> datetime:
    """RQ's timestamps are UTC, naive or not."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def reap_lost_queued_jobs(records: Records, settings: Settings) -> list[str]:
    """Enqueues the attempts whose backoff has passed, and ends the current attempt of every
    queued job that RQ will never run or whose process died between RQ's fork and the job
    marking itself running (NOTE [ Job attempts ] in service/records/job_life/retries.py); returns
    the ids of the jobs it changed.

    The record and the RQ job of a first attempt are written in one MULTI
    (service/jobs/submission.py); the job's process moves the record to running within
    milliseconds of RQ starting it."""
    changed = []
    ttl = timedelta(seconds=heartbeat_key_ttl_s(settings.heartbeat_timeout_s))
    holds = DequeueHolds(records.client)
    for job_id in _queued_jobs_to_check(records):
        rq_id, retry_at, payload = records.queue_entry(job_id)
        try:
            rq_job: Job | None = Job.fetch(rq_id, connection=records.client, serializer="json")
        except NoSuchJobError:
            rq_job = None
        if rq_job is None and retry_at is not None and payload is not None:
            if time.time() >= retry_at:
                enqueue_attempt(records, settings, job_id, rq_id, payload)
                changed.append(job_id)
            continue
        if rq_job is not None and retry_at is not None:
            records.mark_enqueued(job_id, rq_id)  # a sweep died after enqueueing it
        rq_status = None if rq_job is None else rq_job.get_status(refresh=False)
        taken, why = (
            holds.judge(rq_job.id, rq_job.origin, ttl.total_seconds())
            if rq_job is not None and rq_status is RqStatus.QUEUED
            else (Taken.WAITING, "")
        )
        if taken is Taken.LOST:
            assert rq_job is not None
            what = (
                f"a worker took it from the queue and was lost before it started it ({why}: "
                "killed, its machine lost, or Redis lost at that moment)"
            )
        elif rq_status in _WAITING:
            continue  # waiting for a worker, however long that takes
        elif rq_job is not None and rq_status is RqStatus.STARTED:
            started = rq_job.started_at
            if started is None or utc_now() - _aware(started) < ttl:
                continue  # forked a moment ago: it marks itself running in milliseconds
            what = (
                f"its process started over {ttl.total_seconds():g} s ago but never marked the "
                "job running (killed, out of memory, or its machine was lost)"
            )
        elif rq_status is None:
            what = "its queue entry is gone (removed from the queue outside bnadapt?)"
        else:
            what = f"its queue entry ended {rq_status.value} before the job started"
        status = records.interrupt(job_id, (JobStatus.QUEUED,), what, rq_id=rq_id)
        if status in (JobStatus.QUEUED, JobStatus.FAILED):
            log.warning("queued job %s: %s; now %s", job_id, what, status, extra={"job_id": job_id})
            changed.append(job_id)
            if taken is Taken.LOST and rq_job is not None:
                holds.forget(rq_job.id, rq_job.origin)
    return changed


# NOTE [ Dequeued and lost ]
# RQ's worker pops a job from its queue (onto the queue's intermediate list), records an
# execution of it in the queue's started ("wip") registry, forks, and only the forked process
# sets the job's status to started. A worker lost in between (SIGKILL, its machine lost, or a
# Redis kill: its client then fails and the worker exits) leaves a job whose status still says
# queued but that is in no queue list: RQ's own cleanups pass over it (the started registry's
# handles started jobs only, the intermediate list's runs every 10 minutes and fails it), so
# no worker would run it. So each RQ worker process records what it took
# (service/records/job_life/dequeues.py): right after the pop it names itself the job's holder, and
# a thread of it keeps ``keys.rq_worker_holds`` (the RQ id it holds) alive with the heartbeat
# TTL until it is done with the job. A sweep counts a job that RQ still calls queued as lost
# when its holder no longer holds it (the worker died: its key expired; or it went on
# without it), or, with no holder (the worker died, or Redis was lost, between the pop and
# that write), once sweeps have seen it taken for a heartbeat TTL. Both are decided in one
# script, so a sweep never reads a half-done hand-over. A job's attempt then ends as an
# interrupted one (NOTE [ Job attempts ] in service/records/job_life/retries.py); a sharded job's
# child goes back to the front of its queue (NOTE [ Retried children ] in workers/sharding/jobs.py).
# With a holder, that happens within the heartbeat bound: the holds key is gone a TTL after the
# worker died, and a sweep follows within a sweep interval (NOTE [ Heartbeat bound ]). With
# none (the pop's moment is recorded nowhere), the first sweep that sees the job taken starts
# the clock: within the bound plus one TTL of the worker's death, or of Redis being back for a
# TTL after an outage.


# Queued jobs looked at per script call.
_SWEEP_CHUNK: Final = 1000

# KEYS: none (a deployment's own server, never a cluster); ARGV[1]: the job record key prefix,
# ARGV[2]: RQ's job key prefix, ARGV[3]: the waiting RQ statuses joined by ",", ARGV[4...]: job
# ids. Returns the ids whose attempt is not simply waiting in RQ with nothing due.
_TO_CHECK_LUA: Final = """
local waiting = {}
for status in string.gmatch(ARGV[3], "[^,]+") do waiting[status] = true end
local found = {}
local in_queue = {}
for i = 4, #ARGV do
    local entry = redis.call("HMGET", ARGV[1] .. ARGV[i], "rq_id", "retry_at")
    local rq_id = entry[1] or ARGV[i]
    local status = redis.call("HGET", ARGV[2] .. rq_id, "status")
    if entry[2] or not status or not waiting[status] then
        table.insert(found, ARGV[i])
    elseif status == "queued" then
        -- Queued but no longer in its queue: taken by a worker, maybe one lost before it
        -- marked the job started (NOTE [ Dequeued and lost ]).
        local origin = redis.call("HGET", ARGV[2] .. rq_id, "origin") or ""
        if not in_queue[origin] then
            in_queue[origin] = {}
            for _, id in ipairs(redis.call("LRANGE", "rq:queue:" .. origin, 0, -1)) do
                in_queue[origin][id] = true
            end
        end
        if not in_queue[origin][rq_id] then table.insert(found, ARGV[i]) end
    end
end
return found
"""


def _queued_jobs_to_check(records: Records) -> list[str]:
    """The queued jobs :func:`reap_lost_queued_jobs` must look at one by one: all but those
    whose current attempt waits in RQ with nothing due, filtered in Redis by one script call
    per ``_SWEEP_CHUNK`` jobs. A long queue is the normal state of a busy deployment, and
    every API process and supervisor sweeps it every few seconds: two round trips and a decoded
    RQ job per waiting job took a large share of the API's core under load."""
    client = records.client
    script = client.register_script(_TO_CHECK_LUA)
    prefixes = [keys.record("job", ""), Job.redis_job_namespace_prefix, _WAITING_ARG]
    queued = records.queued_jobs()
    found: list[str] = []
    for start in range(0, len(queued), _SWEEP_CHUNK):
        chunk = queued[start : start + _SWEEP_CHUNK]
        found += [text(job_id) for job_id in cast("list[bytes]", script(args=[*prefixes, *chunk]))]
    return found


def rerun_lost_children(
    records: Records,
    shard_records: ShardRecords,
    job_id: str,
    children: dict[str, ChildState],
    heartbeat_timeout_s: float,
) -> dict[str, ChildState]:
    """Puts back on their queue the children of the running sharded job ``job_id`` that were
    lost with their whole worker: running ones whose heartbeat and RQ worker are gone (using
    one of their RQ retries), and queued ones their lost worker had taken from the queue
    (NOTE [ Dequeued and lost ], NOTE [ Retried children ] in workers/sharding/jobs.py).
    Returns ``children`` with the states after."""
    grace_s = heartbeat_key_ttl_s(heartbeat_timeout_s)
    holds = DequeueHolds(records.client)
    now = dict(children)
    candidates = [
        c
        for c, state in children.items()
        if state is ChildState.QUEUED
        or (state is ChildState.RUNNING and not shard_records.alive(job_id, c))
    ]
    if not candidates:
        return now
    rq_jobs = Job.fetch_many(
        [child_job_id(job_id, c) for c in candidates], connection=records.client, serializer="json"
    )
    for child, rq_job in zip(candidates, rq_jobs, strict=True):
        if rq_job is None:
            continue
        rq_status = rq_job.get_status(refresh=False)
        if children[child] is ChildState.RUNNING:
            # Its process is gone. A live RQ worker saw it die and runs it again itself
            # (``fail_killed_child``); with its worker gone too, nobody else would.
            if rq_status is not RqStatus.STARTED or not rq_job.retries_left:
                continue
            taken, why = holds.judge(rq_job.id, rq_job.origin, grace_s, started=True)
            if taken is not Taken.LOST or not shard_records.requeue(job_id, child):
                continue
            now[child] = ChildState.QUEUED
        elif rq_status is RqStatus.STARTED:
            # Forked but not claimed: its process claims it within milliseconds of the fork.
            started = rq_job.started_at
            if started is None or utc_now() - _aware(started) < timedelta(seconds=grace_s):
                continue
        elif rq_status is not RqStatus.QUEUED:
            continue
        taken, why = holds.judge(
            rq_job.id,
            rq_job.origin,
            grace_s,
            requeue=True,
            started=rq_status is RqStatus.STARTED,
        )
        if taken is Taken.REQUEUED:
            log.warning(
                "job %s: %s was lost with its worker (%s); queued again",
                job_id,
                describe_child(child, sum(1 for c in children if is_shard(c))),
                why,
                extra={"job_id": job_id},
            )
    return now


def judge_sharded(
    records: Records,
    shard_records: ShardRecords,
    job_id: str,
    children: dict[str, ChildState],
    heartbeat_timeout_s: float,
) -> tuple[JobStatus, str | None] | None:
    """None while the running sharded job ``job_id`` can still finish; else the status (and
    error) it ends with."""
    shards = sum(1 for child in children if is_shard(child))
    running = [c for c, state in children.items() if state is ChildState.RUNNING]
    for child in running:
        if not shard_records.alive(job_id, child):
            return JobStatus.FAILED, (
                f"{describe_child(child, shards)} stopped sending heartbeats for "
                f"{heartbeat_timeout_s:g} s (killed, out of memory, or its machine was lost); "
                "nothing was kept: submit the job again"
            )
    ended = [c for c, state in children.items() if state in _ENDED_EARLY]
    if ended:  # its process could not record why on the job (Redis was away)
        return JobStatus.FAILED, (
            f"{describe_child(ended[0], shards)} {children[ended[0]].value} before the job "
            "finished; the reason is in its worker's log: submit the job again"
        )
    if running:
        return None  # a running child notices a cancel, and its failure, itself
    if records.cancel_requested(job_id):
        return JobStatus.CANCELED, None
    queued = [c for c, state in children.items() if state is ChildState.QUEUED]
    if not queued:
        return JobStatus.FAILED, (
            "the shards and the other children of this job all ended without finishing it; "
            "submit the job again"
        )
    lost = shard_records.lost_from_queue(job_id, queued)
    if lost:
        child, rq_status = next(iter(lost.items()))
        return JobStatus.FAILED, (
            f"{describe_child(child, shards)} will never run: its queue entry is {rq_status} "
            "(removed from the queue outside bnadapt?); submit the job again"
        )
    return None  # waiting for free workers, however long that takes
