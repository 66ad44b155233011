"""Sharded adaptation: one adapt job's batches collected by several workers, then merged.

- :func:`start_shards` — run by the worker that takes a job with ``shards > 1``: plans the
  shards, enqueues them and their merge, and returns.
- :func:`run_shard`, :func:`run_merge` — the RQ entry points of the children.
- :func:`plan_shards`, :func:`collect_shard`, :func:`compute_merged` — the plain computations,
  testable without Redis.

See NOTE [ Sharded adaptation ].
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from pydantic import Field
from rq import Queue, get_current_job
from rq.job import Dependency, Job
from torch import nn

from api_schemas import AdaptParams, JobPayload, JobStatus, Progress, RequestModel, utc_now
from api_schemas.reports import ShardSummary
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
from workers.compute import Estimate, JobHooks, JobOutcome, NoHooks, compute, load_job
from workers.data import iter_batches, num_batches
from workers.errors import AdaptError, JobCanceled
from workers.estimators import AdaptStats, select_batchnorm
from workers.precise import (
    LayerStatistics,
    Weighting,
    apply_statistics,
    collect_statistics,
    mix_with_source,
)
from workers.runtime import JobRuntime
from workers.saving import SavedOutcome, error_message, mark_succeeded, save_outcome

__all__ = [
    "MERGE_FUNCTION",
    "SHARD_FUNCTION",
    "ShardPlan",
    "ShardResult",
    "ShardedJob",
    "collect_shard",
    "compute_merged",
    "fail_killed_child",
    "merge_statistics",
    "plan_shards",
    "run_merge",
    "run_shard",
    "start_shards",
]

log = logging.getLogger(__name__)

R = TypeVar("R")

# NOTE [ Sharded adaptation ]
#
# What can be sharded: an estimator whose result is a function of per-batch statistics pooled
# in any order. `precise` pools every element (count, mean, M2 merged by Chan et al.),
# `cumulative` averages the batch means and unbiased batch variances with equal weight (sums),
# `prior` mixes either with the source statistics. One collection pass gives either (see
# LayerStatistics and collect_statistics' weighting); the merge applies them with the
# functions one worker uses (apply_statistics, mix_with_source) inside the same compute() (an
# `Estimate` replaces the estimator), and saves through workers/saving.py. `ema` and `entropy`
# are sequential: the API refuses shards > 1 for them. Only selected BatchNorm layers run in
# train mode and normalize with their batch statistics, so a batch's activations do not depend
# on the batches before it, on any worker: the merged result equals one worker's up to float
# rounding (cumulative: float64 sums against torch's float32 running average, below 1e-6).
#
# Jobs: the parent is the user's job; the worker that takes it only plans K contiguous runs of
# whole batches, records every child queued (service/shard_records.py), enqueues K shard jobs
# and a merge job that depends on them (RQ ids `<parent>-shard-<i>`, `<parent>-merge`) and
# returns: waiting for the shards would deadlock a single worker. Children have no job record,
# so they never show in `GET /v1/jobs`; the parent's report lists them (Report.shards).
#
# Life cycle: a child claims itself (queued -> running, with a heartbeat of its own) only while
# the parent is running. A shard stores its statistics (JSON, LayerStatistics.to_dict) in Redis
# and is done; the merge reads them, computes, saves, marks the parent succeeded, deletes them.
# - progress: each shard's runtime adds its own count into the parent's Progress (done and total
#   over all shards' batches), the merge then writes its phases there as one worker would.
# - cancel: a running child sees the parent's cancel flag at its next batch and ends the parent
#   canceled; the reaper does it when no child runs. Whoever ends the parent also cancels the
#   children still queued (they never run), and running ones stop because the parent is no
#   longer running.
# - failure: a failing child fails the parent with its message, prefixed with which shard.
# - reaper: judges a dispatched parent by its children (service/reaper.py judge_sharded): queued
#   children may wait for workers indefinitely, a running child without heartbeat fails the
#   parent within the heartbeat timeout, a child RQ will never run fails it.
# - cost: only the estimation pass is split. The merge loads the whole dataset and, when it has
#   labels, measures the model before and after on all of it, as one worker does.

SHARD_FUNCTION: Final = "workers.shards.run_shard"
MERGE_FUNCTION: Final = "workers.shards.run_merge"
# The children's RQ results are tiny; their statistics live under keys.job_shard_result.
RQ_RESULT_TTL_S: Final = 24 * 3600
RQ_FAILURE_TTL_S: Final = 7 * 24 * 3600
# Which pooling of the shards' statistics each shardable estimator (or prior base) writes.
WEIGHTINGS: Final[Mapping[str, Weighting]] = {"precise": "elements", "cumulative": "batches"}


class ShardPlan(RequestModel):
    """Shard ``index``: the job's batches ``first_batch`` .. ``first_batch + batches - 1``."""

    index: int = Field(ge=0)
    first_batch: int = Field(ge=0)
    batches: int = Field(ge=1)


class ShardedJob(RequestModel):
    """What each child receives (as JSON): the parent's payload and the plan of all shards."""

    payload: JobPayload
    plan: list[ShardPlan] = Field(min_length=2)


@dataclass(frozen=True)
class ShardResult:
    """What a shard hands to the merge: what it ran (as the report shows it) and its
    statistics per BatchNorm layer."""

    summary: ShardSummary
    layers: dict[str, LayerStatistics]

    def to_json(self) -> str:
        """JSON only; float64 values round-trip exactly (Python's float repr)."""
        layers = {name: stats.to_dict() for name, stats in self.layers.items()}
        return json.dumps({"summary": self.summary.model_dump(mode="json"), "layers": layers})

    @classmethod
    def from_json(cls, text: str) -> ShardResult:
        fields: dict[str, Any] = json.loads(text)
        return cls(
            summary=ShardSummary.model_validate(fields["summary"]),
            layers={name: LayerStatistics.from_dict(d) for name, d in fields["layers"].items()},
        )


def plan_shards(total_batches: int, shards: int) -> list[ShardPlan]:
    """``shards`` contiguous runs of whole batches covering ``total_batches``, sizes differing
    by at most one (the longer ones first)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > total_batches:
        raise AdaptError(
            f"{shards} shards need at least {shards} batches but the job runs "
            f"{total_batches}; use shards <= {total_batches}, or a smaller batch_size"
        )
    size, longer = divmod(total_batches, shards)
    plan, first = [], 0
    for index in range(shards):
        batches = size + (1 if index < longer else 0)
        plan.append(ShardPlan(index=index, first_batch=first, batches=batches))
        first += batches
    return plan


def collect_shard(
    payload: JobPayload,
    store: Store,
    shard: ShardPlan,
    hooks: JobHooks | None = None,
    worker: str = "in-process",
) -> ShardResult:
    """Shard ``shard``'s statistics of the job's selected BatchNorm layers (one train-mode
    pass over its batches, :func:`workers.precise.collect_statistics`)."""
    hooks = hooks or NoHooks()
    started = time.perf_counter()
    params = payload.params
    assert isinstance(params, AdaptParams), f"{payload.kind} jobs are not sharded"
    job = load_job(payload, store)
    layers = select_batchnorm(job.model, params.include, params.exclude)
    size = params.batch_size
    part = job.x[shard.first_batch * size : (shard.first_batch + shard.batches) * size]
    if num_batches(len(part), size) != shard.batches:
        raise AdaptError(
            f"shard {shard.index} should run batches {shard.first_batch} to "
            f"{shard.first_batch + shard.batches - 1} of {size} samples, but the dataset has "
            f"only {len(job.x)} samples; submit the job again"
        )
    hooks.start_phase("adapt", shard.batches, "batches", float(size))
    data = (batch.to(job.device) for batch in iter_batches(part, size))  # (B, ...)
    stats = collect_statistics(
        job.model,
        data,
        layers=layers,
        progress=hooks.report,
        should_stop=hooks.should_stop,
        weighting=_weighting(params),
    )
    summary = ShardSummary(
        **shard.model_dump(),
        samples=len(part),
        worker=worker,
        compute_s=time.perf_counter() - started,
    )
    return ShardResult(summary, stats)


def merge_statistics(results: Sequence[ShardResult]) -> dict[str, LayerStatistics]:
    """All shards' statistics per layer, merged in batch order."""
    merged: dict[str, LayerStatistics] = {}
    for result in sorted(results, key=lambda r: r.summary.first_batch):
        for name, stats in result.layers.items():
            merged[name] = merged[name].merge(stats) if name in merged else stats
    return merged


def compute_merged(
    payload: JobPayload,
    store: Store,
    results: Sequence[ShardResult],
    hooks: JobHooks | None = None,
) -> JobOutcome:
    """The sharded job's new weights and report: :func:`workers.compute.compute` with the
    shards' merged statistics applied in place of the estimator's pass."""
    shards = sorted((r.summary for r in results), key=lambda s: s.index)
    stats = AdaptStats(
        batches=sum(s.batches for s in shards), samples=sum(s.samples for s in shards)
    )
    outcome = compute(
        payload, store, hooks, estimate=_apply_merged(merge_statistics(results), stats)
    )
    return dataclasses.replace(outcome, report=outcome.report.model_copy(update={"shards": shards}))


def _apply_merged(merged: dict[str, LayerStatistics], stats: AdaptStats) -> Estimate:
    def estimate(
        model: nn.Module, params: AdaptParams, layers: list[str], hooks: JobHooks
    ) -> AdaptStats:
        hooks.start_phase("merge", 1, "batches", float(stats.samples))

        def apply(weighting: Weighting) -> AdaptStats:
            apply_statistics(model, merged, layers, weighting)
            return stats

        weighting = _weighting(params)
        if params.estimator == "prior":
            mix_with_source(model, layers, params.prior_strength, lambda: apply(weighting))
        else:
            apply(weighting)
        hooks.report(1)
        return stats

    return estimate


def _weighting(params: AdaptParams) -> Weighting:
    """How the job's estimator pools per-batch statistics; AdaptError if it cannot."""
    estimator = params.prior_base if params.estimator == "prior" else params.estimator
    if estimator not in WEIGHTINGS:
        raise AdaptError(f"the {estimator} estimator cannot be sharded; submit it with shards=1")
    return WEIGHTINGS[estimator]


# --- the RQ side ------------------------------------------------------------------------------


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
