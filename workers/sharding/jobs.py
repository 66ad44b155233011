"""Sharded adaptation on RQ: the parent's dispatch and the children's entry points.

- :func:`start_shards` — run by the worker that takes a job with ``shards > 1``: plans the
  shards, enqueues them, their merge and (with labels) the evaluation children and the finish,
  and returns.
- :func:`run_shard`, :func:`run_merge`, :func:`run_eval`, :func:`run_finish` — the RQ entry
  points of the children.
- :func:`fail_killed_child` — for the RQ worker, when a child's process died.

The computations are in workers/sharding/compute.py, how one child runs in
workers/sharding/child.py; see NOTE [ Sharded adaptation ] in workers/sharding/compute.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

from rq.job import Dependency, Job

from api_schemas import AdaptParams, JobPayload, JobStatus, Progress, utc_now
from service.formats.arrays import locate_arrays
from service.records.job_life.retries import child_retry, rerun_killed_child
from service.records.job_life.shards import (
    FINISH,
    MERGE,
    ChildState,
    ShardRecords,
    child_job_id,
    describe_child,
    eval_name,
    shard_name,
)
from service.records.sync import Records
from service.records.tenancy.turns import announce, turn_queue
from service.settings import Settings
from service.store.base import Store
from workers.errors import AdaptError, JobCanceled
from workers.passes.data import num_batches
from workers.running.evaluation import MetricSums
from workers.running.runtime import JobRuntime
from workers.running.saving import (
    SavedOutcome,
    StoredWeights,
    begin_saving,
    mark_succeeded,
    register_output,
    save_outcome,
    store_weights,
)
from workers.sharding.child import ChildRun, end_parent, rq_worker_name, run_child
from workers.sharding.compute import (
    ShardedJob,
    ShardResult,
    SumsMessage,
    collect_shard,
    compute_merged,
    evaluate_adapted,
    plan_evaluation,
    plan_shards,
    with_metrics,
)

__all__ = [
    "EVAL_FUNCTION",
    "FINISH_FUNCTION",
    "MERGE_FUNCTION",
    "SHARD_FUNCTION",
    "fail_killed_child",
    "run_eval",
    "run_finish",
    "run_merge",
    "run_shard",
    "start_shards",
]

log = logging.getLogger(__name__)


SHARD_FUNCTION: Final = "workers.sharding.jobs.run_shard"
MERGE_FUNCTION: Final = "workers.sharding.jobs.run_merge"
EVAL_FUNCTION: Final = "workers.sharding.jobs.run_eval"
FINISH_FUNCTION: Final = "workers.sharding.jobs.run_finish"
# The children's RQ results are tiny; what they hand on lives under keys.job_child_result.
RQ_RESULT_TTL_S: Final = 24 * 3600
RQ_FAILURE_TTL_S: Final = 7 * 24 * 3600


def _dataset_facts(job: JobPayload, store: Store) -> tuple[int, bool]:
    """The dataset's sample count and whether it has labels: from the payload, which carries
    what the API found on upload; read from the file only for payloads of older releases."""
    dataset = job.dataset
    if dataset.num_samples is not None and dataset.has_labels is not None:
        return dataset.num_samples, dataset.has_labels
    located = locate_arrays(store.local_path(dataset.sha256), dataset.format, max_elements=None)
    return located["x"].shape[0], "y" in located


def start_shards(
    job: JobPayload, records: Records, store: Store, runtime: JobRuntime, settings: Settings
) -> dict[str, str]:
    """Plans the running job's shards, records every child and enqueues them (the shards, the
    merge and, with labels, the evaluation children and the finish) on the settings' queue;
    returns the RQ result of the job that started them."""
    params = job.params
    assert isinstance(params, AdaptParams)
    num_samples, has_labels = _dataset_facts(job, store)
    total = params.estimation_batches(num_samples)  # the held-out samples are in no shard
    plan = plan_shards(total, params.shards)
    measured = params.measured_samples(num_samples)
    evaluation = plan_evaluation(measured, len(plan), params.batch_size) if has_labels else None
    evaluations = [] if evaluation is None else [eval_name(i) for i in range(len(plan))]
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
    after_merge = [*evaluations, FINISH] if evaluations else []
    shard_records.plan(job.job_id, [shard.batches for shard in plan], progress, after_merge)
    spec = ShardedJob(payload=job, plan=plan, evaluation=evaluation).model_dump(mode="json")
    # The children wait for workers of the class the job asked for (NOTE [ Queues by device ]),
    # in the job's own queue there (NOTE [ Fair turns ] in service/records/tenancy/turns.py).
    base = settings.job_queue(job.params.device)
    queue = turn_queue(records.client, base, job.tenant_id, job.priority)
    options: dict[str, Any] = {
        "timeout": job.timeout_s or settings.job_timeout_s,  # each child the job's own
        "result_ttl": RQ_RESULT_TTL_S,
        "failure_ttl": RQ_FAILURE_TTL_S,
    }
    options["retry"] = child_retry(records.max_attempts(job.job_id))  # NOTE [ Retried children ]

    def enqueue(
        function: str,
        child: str,
        args: tuple[Any, ...],
        depends_on: Job | list[Dependency | Job | str] | None = None,
    ) -> Job:
        return queue.enqueue_call(
            function,
            args=args,
            job_id=child_job_id(job.job_id, child),
            depends_on=depends_on,
            description=f"{describe_child(child, len(plan))} of {job.job_id}",
            **options,
        )

    shards: list[Dependency | Job | str] = [
        enqueue(SHARD_FUNCTION, shard_name(s.index), (spec, s.index)) for s in plan
    ]
    merge = enqueue(MERGE_FUNCTION, MERGE, (spec,), shards)
    if evaluations:
        evaluated: list[Dependency | Job | str] = [
            enqueue(EVAL_FUNCTION, child, (spec, index), merge)
            for index, child in enumerate(evaluations)
        ]
        enqueue(FINISH_FUNCTION, FINISH, (spec,), evaluated)
    announce(records.client, base, job.tenant_id, job.priority)
    shard_records.mark_dispatched(job.job_id)
    log.info("job %s: %d batches in %d shards queued", job.job_id, total, len(plan))
    return {"job_id": job.job_id, "status": JobStatus.RUNNING.value, "shards": str(len(plan))}


def run_shard(spec: dict[str, Any], index: int) -> dict[str, str]:
    """RQ entry point of shard ``index`` of the sharded job ``spec`` describes."""
    sharded = ShardedJob.model_validate(spec)

    def work(run: ChildRun) -> ShardResult:
        part = None if sharded.evaluation is None else sharded.evaluation[index]
        result = collect_shard(
            sharded.payload, run.store, sharded.plan[index], run.runtime, rq_worker_name(), part
        )
        if run.runtime.check_cancel_now():
            raise JobCanceled(f"job {sharded.payload.job_id} was canceled")
        return result

    def finish(run: ChildRun, result: ShardResult) -> None:
        run.shard_records.finish(
            sharded.payload.job_id, shard_name(index), ChildState.DONE, result.model_dump_json()
        )

    return run_child(sharded, shard_name(index), work, finish)


def run_merge(spec: dict[str, Any]) -> dict[str, str]:
    """RQ entry point of the merge of the sharded job ``spec`` describes: registers the model
    or, when evaluation children follow, hands the weights on to them."""
    sharded = ShardedJob.model_validate(spec)
    job = sharded.payload
    params = job.params
    assert isinstance(params, AdaptParams)
    parts = sharded.evaluation

    def work(run: ChildRun) -> SavedOutcome | StoredWeights:
        results = [_shard_result(run.shard_records, sharded, s.index) for s in sharded.plan]
        outcome = compute_merged(job, run.store, results, run.runtime, measure=parts is None)
        if parts is None:
            return save_outcome(job, outcome, run.records, run.store, run.runtime)
        weights = store_weights(outcome, run.store)
        ended = run.shard_records.hold_weights(job.job_id, weights.sha256)
        if ended is not None:
            raise JobCanceled(f"job {job.job_id} is {ended}")
        size = params.batch_size
        total = sum(num_batches(part.stop - part.start, size) for part in parts)
        run.runtime.start_phase("evaluate after", total, "batches", float(size))
        return weights

    def finish(run: ChildRun, done: SavedOutcome | StoredWeights) -> None:
        if isinstance(done, SavedOutcome):
            _succeed(run, sharded, done)
        else:
            run.shard_records.finish(job.job_id, MERGE, ChildState.DONE, done.model_dump_json())

    return run_child(sharded, MERGE, work, finish)


def run_eval(spec: dict[str, Any], index: int) -> dict[str, str]:
    """RQ entry point of evaluation child ``index``: the adapted model on part ``index``."""
    sharded = ShardedJob.model_validate(spec)
    assert sharded.evaluation is not None, "evaluation children need labels"
    part = sharded.evaluation[index]

    def work(run: ChildRun) -> MetricSums:
        weights = _merged_weights(run.shard_records, sharded)
        return evaluate_adapted(sharded.payload, run.store, weights.sha256, part, run.runtime)

    def finish(run: ChildRun, sums: MetricSums) -> None:
        job_id = sharded.payload.job_id
        run.shard_records.finish(
            job_id, eval_name(index), ChildState.DONE, SumsMessage.of(sums).model_dump_json()
        )
        params = sharded.payload.params
        assert isinstance(params, AdaptParams)
        run.shard_records.count_evaluated(job_id, num_batches(sums.num_samples, params.batch_size))

    return run_child(sharded, eval_name(index), work, finish)


def run_finish(spec: dict[str, Any]) -> dict[str, str]:
    """RQ entry point of the finish: the metrics of both rounds into the report, the model
    registered, the job succeeded."""
    sharded = ShardedJob.model_validate(spec)
    job = sharded.payload
    parts = range(len(sharded.plan))

    def work(run: ChildRun) -> SavedOutcome:
        results = [_shard_result(run.shard_records, sharded, i) for i in parts]
        after = [
            SumsMessage.model_validate_json(_child_result(run.shard_records, sharded, c)).sums()
            for c in map(eval_name, parts)
        ]
        weights = with_metrics(_merged_weights(run.shard_records, sharded), results, after)
        begin_saving(job, run.runtime)
        saved = register_output(job, weights, run.records, run.store)
        # The model holds the weights now; released before the job's end, so that no ending
        # of this process can leave the merge's reference behind.
        run.shard_records.release_weights(job.job_id)
        return saved

    def finish(run: ChildRun, saved: SavedOutcome) -> None:
        _succeed(run, sharded, saved)

    return run_child(sharded, FINISH, work, finish)


def _succeed(run: ChildRun, sharded: ShardedJob, saved: SavedOutcome) -> None:
    """The last child's end: the job succeeded, the children's results deleted."""
    job_id = sharded.payload.job_id
    last = MERGE if sharded.evaluation is None else FINISH
    mark_succeeded(sharded.payload, saved, run.records)
    run.shard_records.finish(job_id, last, ChildState.DONE)
    run.shard_records.delete_results(job_id, list(run.shard_records.children(job_id) or {}))


# NOTE [ Retried children ]
# A child whose process dies (SIGKILL, out of memory) while its parent runs is run again, as a
# job's attempt is (NOTE [ Job attempts ] in service/records/job_life/retries.py): each child's RQ
# job is enqueued with RQ's ``Retry`` of the job's ``max_attempts`` - 1, so when the RQ worker sees
# the process die, ``fail_killed_child`` marks the child queued again (with its heartbeat
# gone) and RQ puts the same RQ job back on the queue at once. Its dependents (the merge, the
# finish) keep waiting on that RQ id, so nothing else changes: the rerun's claim succeeds,
# it computes its part again and hands on its result as the first run would have. What a
# child writes is keyed by the job, never by the run: a shard's result overwrites, the merged
# weights are content-addressed, and registering the model goes through ``claim_output``, so
# a merge or finish killed after registering reuses that model (exactly one model). Once a
# child's retries are spent, or when it fails by raising, the parent fails as before. A child
# lost with its whole worker (no RQ worker left to see it die) is put back on its queue by the
# sweep instead, within the heartbeat bound (``rerun_lost_children`` in
# service/upkeep/reaper.py): a running one once its heartbeat and its RQ worker's holds key
# are gone (using one of its RQ retries, in the same script that requeues it), and one its
# worker took from the queue and never started (NOTE [ Dequeued and lost ] there) at the front
# of its queue, without using one.


def fail_killed_child(
    records: Records,
    func_name: str | None,
    args: Sequence[Any],
    how: str,
    retries_left: int | None = None,
) -> bool:
    """For the RQ worker, when a job's process died without raising: if it was a child of a
    sharded job (``func_name`` and ``args`` of its RQ job), marks it queued again when RQ has
    ``retries_left`` for it (NOTE [ Retried children ]), else fails the parent now with ``how``
    it died (else the reaper would, a heartbeat timeout later). False for any other job."""
    names: dict[str | None, Callable[[], str]] = {
        SHARD_FUNCTION: lambda: shard_name(int(args[1])),
        MERGE_FUNCTION: lambda: MERGE,
        EVAL_FUNCTION: lambda: eval_name(int(args[1])),
        FINISH_FUNCTION: lambda: FINISH,
    }
    if func_name not in names:
        return False
    sharded = ShardedJob.model_validate(args[0])
    child = names[func_name]()
    shard_records = ShardRecords(records.client)
    error = f"{describe_child(child, len(sharded.plan))} died: {how}"
    parent_id = sharded.payload.job_id
    # Killed before it claimed itself (the fork window), it is still queued: RQ's retry alone
    # runs it again.
    if rerun_killed_child(shard_records, parent_id, child, retries_left):
        log.warning("job %s: %s; run again (%d retries left)", parent_id, error, retries_left)
        return True
    end_parent(records, shard_records, sharded.payload.job_id, JobStatus.FAILED, error)
    shard_records.finish(sharded.payload.job_id, child, ChildState.FAILED)
    return True


def _child_result(shard_records: ShardRecords, sharded: ShardedJob, child: str) -> str:
    found = shard_records.result(sharded.payload.job_id, child)
    if found is None:
        raise AdaptError(
            f"what {describe_child(child, len(sharded.plan))} handed on is missing (kept for a "
            "week); submit the job again"
        )
    return found


def _shard_result(shard_records: ShardRecords, sharded: ShardedJob, index: int) -> ShardResult:
    return ShardResult.model_validate_json(_child_result(shard_records, sharded, shard_name(index)))


def _merged_weights(shard_records: ShardRecords, sharded: ShardedJob) -> StoredWeights:
    return StoredWeights.model_validate_json(_child_result(shard_records, sharded, MERGE))
