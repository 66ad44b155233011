"""Running one child of a sharded adapt job: it claims itself, runs under a runtime that stops
with its parent (and beats a heartbeat of its own), and ends the parent when it fails or is
stopped. The children's entry points are in workers/sharding/jobs.py; the design is NOTE [ Sharded
adaptation ] in workers/sharding/compute.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rq import get_current_job

from api_schemas import JobStatus, Progress
from service.public_text import opaque_name, worker_label
from service.records.connection import redis_client
from service.records.job_life.shards import (
    FINISH,
    MERGE,
    ChildState,
    ShardRecords,
    child_job_id,
    describe_child,
    is_shard,
)
from service.records.sync import Records
from service.settings import get_settings
from service.store import open_store
from service.store.base import Store
from workers.errors import JobCanceled
from workers.faults import delay_start
from workers.running.capacity import hold_job_to
from workers.running.failures import failure_message
from workers.running.loading import WORKER_DEVICE_ENV
from workers.running.logs import job_logging
from workers.running.runtime import JobRuntime
from workers.sharding.compute import ShardedJob

__all__ = [
    "ChildRun",
    "ChildRuntime",
    "end_parent",
    "process_name",
    "rq_worker_name",
    "run_child",
]

log = logging.getLogger(__name__)

R = TypeVar("R")


class ChildRuntime(JobRuntime):
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
        if is_shard(self._child):
            self._shard_records.publish_progress(self._job_id, self._child, progress)
        elif self._child in (MERGE, FINISH):
            super()._write_progress(progress)  # their phases, as one worker writes them
        # An evaluation child's pass is one of K at once: the merge announced their phase.


def process_name() -> str:
    """This process as reports show it to tenants: no hostname (service/public_text.py)."""
    return worker_label(os.getpid())


def rq_worker_name() -> str:
    """The RQ worker running this part, as reports show it: a stable name without the
    hostname RQ's worker name holds."""
    current = get_current_job()
    if current is not None and current.worker_name:
        return opaque_name(current.worker_name)
    return process_name()


@dataclass(frozen=True)
class ChildRun:
    records: Records
    shard_records: ShardRecords
    store: Store
    runtime: JobRuntime


def run_child(
    sharded: ShardedJob,
    child: str,
    work: Callable[[ChildRun], R],
    finish: Callable[[ChildRun, R], None],
) -> dict[str, str]:
    """Claims ``child``, runs ``work`` under a runtime and ``finish`` after it (as run_job
    marks a job succeeded after its runtime ends), and ends the parent if the child fails or
    is stopped. Skips the child, returning at once, unless it is queued and the parent runs."""
    settings = get_settings()
    parent_id = sharded.payload.job_id
    records = Records(redis_client(settings.redis_url, outage_s=settings.redis_outage_s))
    shard_records = ShardRecords(records.client)
    answer = {"job_id": parent_id, "child": child}
    # NOTE [ Activation estimate ] in service/jobs/submission.py: held as a job is.
    hold_job_to(settings.worker_memory_bytes, os.environ.get(WORKER_DEVICE_ENV, "auto"))
    delay_start()  # the fork window, for tests (workers/faults.py)
    refused = shard_records.claim(parent_id, child, process_name(), settings.heartbeat_timeout_s)
    if refused is not None:
        log.info("%s of job %s not run: %s", child, parent_id, refused)
        return answer | {"status": "skipped"}
    what = describe_child(child, len(sharded.plan))
    if is_shard(child):
        shard = sharded.plan[int(child.removeprefix("shard-"))]
        what += f" (batches {shard.first_batch} to {shard.first_batch + shard.batches - 1})"
    with job_logging(records, parent_id, part=child):  # NOTE [ Job logs ]
        log.info("%s of job %s started on %s", what, parent_id, process_name())
        answer = _run_claimed(sharded, child, what, records, shard_records, work, finish)
        log.info("%s of job %s ended %s", what, parent_id, answer["status"])
        return answer


def _run_claimed(
    sharded: ShardedJob,
    child: str,
    what: str,
    records: Records,
    shard_records: ShardRecords,
    work: Callable[[ChildRun], R],
    finish: Callable[[ChildRun, R], None],
) -> dict[str, str]:
    settings = get_settings()
    parent_id = sharded.payload.job_id
    answer = {"job_id": parent_id, "child": child}
    try:
        with ChildRuntime(
            records, shard_records, parent_id, child, settings.heartbeat_timeout_s
        ) as runtime:
            run = ChildRun(records, shard_records, open_store(settings), runtime)
            with run.store.pinning():  # NOTE [ Pinned copies ] in service/store/cache.py
                done = work(run)
        finish(run, done)
    # The parent is ended before the child's own state says why: the reaper fails a running
    # parent with a stopped or failed child, with a message that only points to the logs.
    except JobCanceled:
        if records.cancel_requested(parent_id):
            end_parent(records, shard_records, parent_id, JobStatus.CANCELED)
        else:  # the parent ended elsewhere (kept), or this process lost Redis for too long
            error = f"{what} stopped: it lost Redis for longer than the heartbeat timeout"
            end_parent(records, shard_records, parent_id, JobStatus.FAILED, error)
        shard_records.finish(parent_id, child, ChildState.STOPPED)
        return answer | {"status": ChildState.STOPPED.value}
    except Exception as exc:
        # Out of memory or timed out said in words (workers/running/failures.py).
        error = f"{what} failed: {failure_message(exc, sharded.payload.timeout_s)}"
        log.exception("%s", error)  # kept in the job's log, labelled by part
        end_parent(records, shard_records, parent_id, JobStatus.FAILED, error)
        shard_records.finish(parent_id, child, ChildState.FAILED)
        raise
    return answer | {"status": ChildState.DONE.value}


def end_parent(
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
