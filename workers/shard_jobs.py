"""Sharded adaptation on RQ: the parent's dispatch and the children's entry points.

- :func:`start_shards` — run by the worker that takes a job with ``shards > 1``: plans the
  shards, enqueues them and their merge, and returns.
- :func:`run_shard`, :func:`run_merge` — the RQ entry points of the children.
- :func:`fail_killed_child` — for the RQ worker, when a child's process died.

The computations are in workers/shards.py; see NOTE [ Sharded adaptation ] there.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from rq import Queue, get_current_job
from rq.job import Dependency, Job

from api_schemas import AdaptParams, JobPayload, JobStatus, Progress, utc_now
from service.arrays import read_arrays
from service.records import Records
from service.redis_conn import redis_client
from service.settings import Settings, get_settings
from service.shard_records import (
    MERGE,
    ChildState,
    ShardRecords,
    child_job_id,
    describe_child,
    shard_name,
)
from service.store import LocalStore, Store
from workers.data import num_batches
from workers.errors import AdaptError, JobCanceled
from workers.runtime import JobRuntime
from workers.saving import SavedOutcome, error_message, mark_succeeded, save_outcome
from workers.shards import (
    ShardedJob,
    ShardResult,
    collect_shard,
    compute_merged,
    plan_shards,
)

__all__ = [
    "MERGE_FUNCTION",
    "SHARD_FUNCTION",
    "fail_killed_child",
    "run_merge",
    "run_shard",
    "start_shards",
]

log = logging.getLogger(__name__)

R = TypeVar("R")

SHARD_FUNCTION: Final = "workers.shard_jobs.run_shard"
MERGE_FUNCTION: Final = "workers.shard_jobs.run_merge"
# The children's RQ results are tiny; their statistics live under keys.job_shard_result.
RQ_RESULT_TTL_S: Final = 24 * 3600
RQ_FAILURE_TTL_S: Final = 7 * 24 * 3600


class _ChildRuntime(JobRuntime):
    """A child's runtime: it stops on its parent's cancel flag or end (JobRuntime watches the
    parent's id), beats a heartbeat of its own, and a shard adds its progress to the parent's."""

    def __init__(
        self,
        records: Records,
        shard_records: ShardRecords,
        parent_id: str,
        child: str,
        heartbeat_ttl_s: float,
    ) -> None:
        super().__init__(records, parent_id, heartbeat_ttl_s)
        self._shard_records = shard_records
        self._child = child

    def _beat(self) -> None:
        self._records.beat(child_job_id(self._job_id, self._child), self._ttl_s)

    def _write_progress(self, progress: Progress) -> None:
        if self._child == MERGE:
            super()._write_progress(progress)  # the merge's phases, as one worker writes them
        else:
            self._shard_records.publish_progress(self._job_id, self._child, progress)


def _process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _rq_worker_name() -> str:
    current = get_current_job()
    if current is not None and current.worker_name:
        return current.worker_name
    return _process_name()


def start_shards(
    job: JobPayload, records: Records, store: Store, runtime: JobRuntime, settings: Settings
) -> dict[str, str]:
    """Plans the running job's shards, records them and enqueues them with their merge on
    the settings' queue; returns the RQ result of the job that started them."""
    params = job.params
    assert isinstance(params, AdaptParams)
    num_samples = len(read_arrays(store.local_path(job.dataset.sha256), job.dataset.format).x)
    total = num_batches(num_samples, params.batch_size, params.max_batches)
    plan = plan_shards(total, params.shards)
    if runtime.check_cancel_now():
        raise JobCanceled(f"job {job.job_id} was canceled")
    shard_records = ShardRecords(records.client)
    progress = Progress(
        done=0,
        total=total,
        unit="batches",
        samples_per_second=0.0,
        phase="adapt",
        updated_at=utc_now(),
    )
    shard_records.plan(job.job_id, [shard.batches for shard in plan], progress)
    spec = ShardedJob(payload=job, plan=plan).model_dump(mode="json")
    queue = Queue(settings.queue, connection=records.client, serializer="json")
    options: dict[str, Any] = {
        "timeout": settings.job_timeout_s,
        "result_ttl": RQ_RESULT_TTL_S,
        "failure_ttl": RQ_FAILURE_TTL_S,
    }
    enqueued: list[Dependency | Job | str] = [
        queue.enqueue_call(
            SHARD_FUNCTION,
            args=(spec, shard.index),
            job_id=child_job_id(job.job_id, shard_name(shard.index)),
            description=f"{describe_child(shard_name(shard.index), len(plan))} of {job.job_id}",
            **options,
        )
        for shard in plan
    ]
    queue.enqueue_call(
        MERGE_FUNCTION,
        args=(spec,),
        job_id=child_job_id(job.job_id, MERGE),
        depends_on=enqueued,
        description=f"merge of the {len(plan)} shards of {job.job_id}",
        **options,
    )
    shard_records.mark_dispatched(job.job_id)
    log.info("job %s: %d batches in %d shards queued", job.job_id, total, len(plan))
    return {"job_id": job.job_id, "status": JobStatus.RUNNING.value, "shards": str(len(plan))}


def run_shard(spec: dict[str, Any], index: int) -> dict[str, str]:
    """RQ entry point of shard ``index`` of the sharded job ``spec`` describes."""
    sharded = ShardedJob.model_validate(spec)

    def work(run: _ChildRun) -> ShardResult:
        result = collect_shard(
            sharded.payload, run.store, sharded.plan[index], run.runtime, _rq_worker_name()
        )
        if run.runtime.check_cancel_now():
            raise JobCanceled(f"job {sharded.payload.job_id} was canceled")
        return result

    def finish(run: _ChildRun, result: ShardResult) -> None:
        run.shard_records.finish(
            sharded.payload.job_id, shard_name(index), ChildState.DONE, (index, result.to_json())
        )

    return _run_child(sharded, shard_name(index), work, finish)


def run_merge(spec: dict[str, Any]) -> dict[str, str]:
    """RQ entry point of the merge of the sharded job ``spec`` describes."""
    sharded = ShardedJob.model_validate(spec)
    job = sharded.payload

    def work(run: _ChildRun) -> SavedOutcome:
        results = [_shard_result(run.shard_records, sharded, s.index) for s in sharded.plan]
        outcome = compute_merged(job, run.store, results, run.runtime)
        return save_outcome(job, outcome, run.records, run.store, run.runtime)

    def finish(run: _ChildRun, saved: SavedOutcome) -> None:
        mark_succeeded(job, saved, run.records)
        run.shard_records.finish(job.job_id, MERGE, ChildState.DONE)
        run.shard_records.delete_results(job.job_id, len(sharded.plan))

    return _run_child(sharded, MERGE, work, finish)


@dataclass(frozen=True)
class _ChildRun:
    records: Records
    shard_records: ShardRecords
    store: Store
    runtime: JobRuntime


def _run_child(
    sharded: ShardedJob,
    child: str,
    work: Callable[[_ChildRun], R],
    finish: Callable[[_ChildRun, R], None],
) -> dict[str, str]:
    """Claims ``child``, runs ``work`` under a runtime and ``finish`` after it (as run_job
    marks a job succeeded after its runtime ends), and ends the parent if the child fails or
    is stopped. Skips the child, returning at once, unless it is queued and the parent runs."""
    settings = get_settings()
    parent_id = sharded.payload.job_id
    records = Records(redis_client(settings.redis_url))
    shard_records = ShardRecords(records.client)
    answer = {"job_id": parent_id, "child": child}
    refused = shard_records.claim(parent_id, child, _process_name(), settings.heartbeat_timeout_s)
    if refused is not None:
        log.info("%s of job %s not run: %s", child, parent_id, refused)
        return answer | {"status": "skipped"}
    what = describe_child(child, len(sharded.plan))
    if child != MERGE:
        shard = sharded.plan[int(child.removeprefix("shard-"))]
        what += f" (batches {shard.first_batch} to {shard.first_batch + shard.batches - 1})"
    try:
        with _ChildRuntime(
            records, shard_records, parent_id, child, settings.heartbeat_timeout_s
        ) as runtime:
            run = _ChildRun(records, shard_records, LocalStore(settings.store_path), runtime)
            done = work(run)
        finish(run, done)
    # The parent is ended before the child's own state says why: the reaper fails a running
    # parent with a stopped or failed child, with a message that only points to the logs.
    except JobCanceled:
        if records.cancel_requested(parent_id):
            _end_parent(records, shard_records, parent_id, JobStatus.CANCELED)
        else:  # the parent ended elsewhere (kept), or this process lost Redis for too long
            error = f"{what} stopped: it lost Redis for longer than the heartbeat timeout"
            _end_parent(records, shard_records, parent_id, JobStatus.FAILED, error)
        shard_records.finish(parent_id, child, ChildState.STOPPED)
        return answer | {"status": ChildState.STOPPED.value}
    except Exception as exc:
        error = f"{what} failed: {error_message(exc)}"
        _end_parent(records, shard_records, parent_id, JobStatus.FAILED, error)
        shard_records.finish(parent_id, child, ChildState.FAILED)
        raise
    return answer | {"status": ChildState.DONE.value}


def fail_killed_child(
    records: Records, func_name: str | None, args: Sequence[Any], how: str
) -> bool:
    """For the RQ worker, when a job's process died without raising: if it was a shard or the
    merge (``func_name`` and ``args`` of its RQ job), fails the parent now with ``how`` it died
    (else the reaper would, a heartbeat timeout later). False for any other job."""
    if func_name not in (SHARD_FUNCTION, MERGE_FUNCTION):
        return False
    sharded = ShardedJob.model_validate(args[0])
    child = shard_name(int(args[1])) if func_name == SHARD_FUNCTION else MERGE
    shard_records = ShardRecords(records.client)
    error = f"{describe_child(child, len(sharded.plan))} died: {how}"
    _end_parent(records, shard_records, sharded.payload.job_id, JobStatus.FAILED, error)
    shard_records.finish(sharded.payload.job_id, child, ChildState.FAILED)
    return True


def _end_parent(
    records: Records,
    shard_records: ShardRecords,
    parent_id: str,
    status: JobStatus,
    error: str | None = None,
) -> None:
    """Ends the running parent (a parent that already ended keeps its status) and cancels the
    children still queued."""
    if records.mark_finished(parent_id, status, error=error):
        log.info("sharded job %s %s: %s", parent_id, status.value, error)
    shard_records.discard(parent_id)


def _shard_result(shard_records: ShardRecords, sharded: ShardedJob, index: int) -> ShardResult:
    text = shard_records.result(sharded.payload.job_id, index)
    if text is None:
        raise AdaptError(
            f"the statistics of {describe_child(shard_name(index), len(sharded.plan))} are "
            "missing (they expire after a week); submit the job again"
        )
    return ShardResult.from_json(text)
