"""Fails running jobs whose process is gone, so no job stays `running` forever.

A running job refreshes its heartbeat key (TTL ``heartbeat_timeout_s``) about twice a second
from a thread of the job's own process. If the worker or the job's process is killed (SIGKILL,
out of memory, a machine lost), the key expires and the next sweep marks the job failed. The
sweep is a compare-and-set, so the API and every worker supervisor may run it at once.

A sharded job (see NOTE [ Sharded adaptation ] in workers/sharding/compute.py) has no process of
its own once its shards are queued: it is judged by its children instead (:func:`judge_sharded`). It
lives as long as each of them is queued, running with a heartbeat, or done; it fails within a
heartbeat timeout of a child's process dying, and ends canceled when a cancel was asked for and
no child is running to notice it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Final

import redis
from rq import Queue

from api_schemas import JobStatus, utc_now
from service.records.shards import ChildState, ShardRecords, describe_child, is_shard
from service.records.sync import Records

__all__ = ["enqueue_ready_children", "judge_sharded", "reap_stale_jobs"]

# A child in one of these states while its parent still runs means the parent cannot finish.
_ENDED_EARLY: Final = (ChildState.FAILED, ChildState.STOPPED, ChildState.CANCELED)

log = logging.getLogger(__name__)


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
    grace = timedelta(seconds=heartbeat_timeout_s)
    shard_records = ShardRecords(records.client)
    for job_id in records.running_jobs():
        children = shard_records.children(job_id)
        if children is not None:
            verdict = judge_sharded(records, shard_records, job_id, children, heartbeat_timeout_s)
            if verdict is not None:
                status, error = verdict
                if records.mark_finished(job_id, status, error=error):
                    log.warning("sharded job %s %s: %s", job_id, status.value, error)
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
            "nothing it was writing was kept: submit the job again"
        )
        if records.mark_finished(job_id, JobStatus.FAILED, error=error):
            log.warning("job %s failed: no heartbeat", job_id)
            reaped.append(job_id)
    return reaped


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
