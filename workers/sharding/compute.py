"""Sharded adaptation: one adapt job's batches collected by several workers, then merged.

- :func:`plan_shards`, :func:`collect_shard`, :func:`compute_merged`, :func:`evaluate_adapted`,
  :func:`with_metrics` — the plain computations, testable without Redis (here);
- :func:`~workers.sharding.jobs.start_shards` and the children's RQ entry points — in
  workers/sharding/jobs.py.

See NOTE [ Sharded adaptation ]. About 400 lines on purpose: the NOTE, the messages the
children exchange and the computations they run are one design, read together.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
from pydantic import Field

from api_schemas import ESTIMATORS, AdaptParams, JobPayload, RequestModel
from api_schemas.reports import ShardSummary
from service.store.base import Store
from workers.errors import AdaptError
from workers.estimators.base import AdaptStats, Estimate, EstimatorTask, select_batchnorm
from workers.estimators.dispatch import load_merged_runner
from workers.estimators.layer_statistics import LayerStatistics, Weighting
from workers.estimators.precise import apply_statistics, collect_statistics
from workers.estimators.prior import mix_with_source
from workers.passes.data import num_batches
from workers.passes.hooks import JobHooks, NoHooks
from workers.passes.precision import adaptation_numerics
from workers.passes.predictions import split_target
from workers.passes.transfer import device_batches
from workers.running.adaptation import Adaptation
from workers.running.compute import JobOutcome, compute, one_sample_batch_explained
from workers.running.evaluation import Loss, MetricSums, contract_metrics, evaluate_sums, loss_for
from workers.running.loading import LoadedJob, load_job
from workers.running.saving import StoredWeights

__all__ = [
    "SampleRange",
    "ShardPlan",
    "ShardResult",
    "ShardedJob",
    "collect_shard",
    "compute_merged",
    "evaluate_adapted",
    "merge_statistics",
    "plan_evaluation",
    "plan_shards",
    "with_metrics",
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
# `Estimate` replaces the estimator), and saves through workers/running/saving.py. `ema` and
# `entropy` are sequential: the API refuses shards > 1 for them. `auto` shards as `precise`
# (its candidates are the source statistics, precise and prior mixes of the two): the merge
# runs its row's `merged_runner`, which scores the candidates on the held-out samples with the
# merged statistics and keeps the best, as one worker does after its own pass; its entropy
# candidate (allow_backward) is sequential, refused with shards > 1. With a holdout (auto's,
# or any job's `holdout`), every shard draws the held-out samples from the job's seed as one
# worker does (split_target) and the plan splits the estimation batches only
# (AdaptParams.estimation_batches). Only selected BatchNorm layers run
# in train mode and normalize with their batch statistics, so a batch's activations do not depend
# on the batches before it, on any worker: the merged result equals one worker's up to float
# rounding (cumulative: float64 sums against torch's float32 running average, below 1e-6).
#
# Jobs: the parent is the user's job; the worker that takes it only plans K contiguous runs of
# whole batches, records every child queued (service/records/job_life/shards.py), enqueues K shard
# jobs, a merge job that depends on them and, with labels, the evaluation children and the finish
# (see "evaluation" below; RQ ids `<parent>-shard-<i>`, `<parent>-merge`, `<parent>-eval-<i>`,
# `<parent>-finish`) and returns: waiting for the shards would deadlock a single worker.
# Children have no job record, so they never show in `GET /v1/jobs`; the parent's report lists
# the shards (Report.shards).
#
# Life cycle: a child claims itself (queued -> running, with a heartbeat of its own) only while
# the parent is running. A shard stores its statistics (JSON, a ShardResult) in Redis
# and is done; the merge reads them, computes and saves. The last child (the merge, or the
# finish) marks the parent succeeded and deletes what the children handed on.
# - progress: each shard's runtime adds its own count into the parent's Progress (done and total
#   over all shards' batches), the merge then writes its phases there as one worker would, and
#   each evaluation child adds the batches it measured.
# - cancel: a running child sees the parent's cancel flag at its next batch and ends the parent
#   canceled; the reaper does it when no child runs. Whoever ends the parent also cancels the
#   children still queued (they never run), and running ones stop because the parent is no
#   longer running.
# - failure: a failing child fails the parent with its message, prefixed with which shard.
# - reaper: judges a dispatched parent by its children (service/upkeep/reaper.py judge_sharded):
# queued   children may wait for workers indefinitely, a running child without heartbeat fails the
#   parent within the heartbeat timeout, a child RQ will never run fails it.
# - evaluation: when the dataset has labels, one worker measures the model before and after
#   adapting on all of it, two passes besides the one estimating. Sharded, each pass is split
#   too: shard i also measures the source model on its part of the dataset (K runs of whole
#   batches covering all samples, `ShardedJob.evaluation`, independent of max_batches), the
#   merge writes the adapted weights to the store (held by a reference of its own while the
#   parent runs) and hands them on, K evaluation children (`eval-i`, after the merge) measure
#   them on part i, and a finish job adds up the metric sums of both rounds
#   (workers/running/evaluation.py MetricSums: every batch is one a single worker measures, so the
#   accuracy is exactly its, the loss but for the order of float64 additions), registers the
#   model, drops the merge's reference and marks the parent succeeded. Without labels the
#   merge registers the model and ends the parent itself.


class ShardPlan(RequestModel):
    """Shard ``index``: the job's batches ``first_batch`` .. ``first_batch + batches - 1``."""

    index: int = Field(ge=0)
    first_batch: int = Field(ge=0)
    batches: int = Field(ge=1)

    def samples(self, batch_size: int, num_samples: int) -> SampleRange:
        """The samples of these batches, of ``num_samples`` in batches of ``batch_size``."""
        start = self.first_batch * batch_size
        return SampleRange(start=start, stop=min(start + self.batches * batch_size, num_samples))


class SampleRange(RequestModel):
    """Samples ``start`` .. ``stop - 1`` of the dataset."""

    start: int = Field(ge=0)
    stop: int = Field(ge=1)


class ShardedJob(RequestModel):
    """What each child receives (as JSON): the parent's payload, the plan of all shards and,
    when the dataset has labels, the part of it each shard and evaluation child measures."""

    payload: JobPayload
    plan: list[ShardPlan] = Field(min_length=2)
    evaluation: list[SampleRange] | None = None


class StatisticsMessage(RequestModel):
    """A layer's :class:`LayerStatistics` as JSON; float64 values round-trip exactly."""

    count: int = Field(ge=0)
    mean: list[float]
    m2: list[float]
    batches: int = Field(ge=0)
    mean_sum: list[float] | None = None
    var_sum: list[float] | None = None

    @classmethod
    def of(cls, stats: LayerStatistics) -> StatisticsMessage:
        def values(t: torch.Tensor | None) -> list[float] | None:
            return None if t is None else t.cpu().tolist()

        return cls(
            count=stats.count,
            mean=stats.mean.cpu().tolist(),
            m2=stats.m2.cpu().tolist(),
            batches=stats.batches,
            mean_sum=values(stats.mean_sum),
            var_sum=values(stats.var_sum),
        )

    def statistics(self) -> LayerStatistics:
        def tensor(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float64)

        mean_sum, var_sum = self.mean_sum, self.var_sum
        return LayerStatistics(
            self.count,
            tensor(self.mean),
            tensor(self.m2),
            self.batches,
            None if mean_sum is None else tensor(mean_sum),
            None if var_sum is None else tensor(var_sum),
        )


class SumsMessage(RequestModel):
    """:class:`MetricSums` as JSON: what a shard or an evaluation child measured."""

    loss: Loss
    num_samples: int = Field(ge=0)
    values_per_sample: int = Field(ge=1)
    loss_sum: float
    correct: int = Field(ge=0)

    @classmethod
    def of(cls, sums: MetricSums) -> SumsMessage:
        return cls.model_validate(dataclasses.asdict(sums))

    def sums(self) -> MetricSums:
        return MetricSums(**self.model_dump())


class ShardResult(RequestModel):
    """What a shard hands on: what it ran (as the report shows it), its statistics per
    BatchNorm layer and, with labels, the source model's metric sums on its part."""

    summary: ShardSummary
    layers: dict[str, StatisticsMessage]
    before: SumsMessage | None = None

    @classmethod
    def of(
        cls,
        summary: ShardSummary,
        layers: Mapping[str, LayerStatistics],
        before: MetricSums | None = None,
    ) -> ShardResult:
        return cls(
            summary=summary,
            layers={name: StatisticsMessage.of(stats) for name, stats in layers.items()},
            before=None if before is None else SumsMessage.of(before),
        )

    def statistics(self) -> dict[str, LayerStatistics]:
        return {name: message.statistics() for name, message in self.layers.items()}

    def before_sums(self) -> MetricSums | None:
        return None if self.before is None else self.before.sums()


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


def plan_evaluation(num_samples: int, parts: int, batch_size: int) -> list[SampleRange]:
    """``parts`` contiguous ranges of whole batches of ``batch_size`` covering all samples, as
    :func:`plan_shards` splits batches: each part measures exactly the batches one worker would,
    so the parts' metric sums add up to its sums but for the order of float64 additions."""
    plan = plan_shards(num_batches(num_samples, batch_size), parts)
    return [shard.samples(batch_size, num_samples) for shard in plan]


def collect_shard(
    payload: JobPayload,
    store: Store,
    shard: ShardPlan,
    hooks: JobHooks | None = None,
    worker: str = "in-process",
    evaluate_part: SampleRange | None = None,
) -> ShardResult:
    """Shard ``shard``'s statistics of the job's selected BatchNorm layers (one train-mode
    pass over its batches, :func:`workers.estimators.precise.collect_statistics`), after the source
    model's metric sums on ``evaluate_part`` of the dataset when given."""
    hooks = hooks or NoHooks()
    started = time.perf_counter()
    params = payload.params
    assert isinstance(params, AdaptParams), f"{payload.kind} jobs are not sharded"
    job = load_job(payload, store)
    size = params.batch_size
    before = None if evaluate_part is None else _measure_part(job, evaluate_part, size, hooks)
    layers = select_batchnorm(job.model, params.include, params.exclude)
    # The held-out samples, drawn from the job's seed as one worker draws them, are in no shard.
    split = split_target(job.x, size, params.max_batches, params.effective_holdout(), params.seed)
    estimation = split.estimation  # (N_e, ...): all of x when nothing is held out
    samples = shard.samples(size, len(estimation))
    part = estimation[samples.start : samples.stop]
    if num_batches(len(part), size) != shard.batches:
        held = f" ({len(split.held_out)} held out)" if split.is_held_out else ""
        raise AdaptError(
            f"shard {shard.index} should run batches {shard.first_batch} to "
            f"{shard.first_batch + shard.batches - 1} of {size} samples, but the dataset has "
            f"only {len(estimation)} samples to estimate on{held}; submit the job again"
        )
    hooks.start_phase("adapt", shard.batches, "batches", float(size))
    # (B, ...) on the device: NOTE [ Batches to the device ] in workers/passes/transfer.py
    data = device_batches(part, size, None, job.device, params.channels_last)
    with (
        one_sample_batch_explained(len(job.x), size, params.max_batches),
        adaptation_numerics(job.model, job.device, params.precision, params.channels_last),
    ):
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
    return ShardResult.of(summary, stats, before)


def _measure_part(
    job: LoadedJob, part: SampleRange, batch_size: int, hooks: JobHooks
) -> MetricSums:
    """The model's metric sums on samples ``part`` of the job's labelled dataset, as one
    worker measures all of it (workers/running/compute.py): in the job's batch size."""
    assert job.y is not None, "parts are measured only on datasets with labels"
    y = job.y[part.start : part.stop]
    return evaluate_sums(
        job.model,
        job.x[part.start : part.stop],
        y,
        batch_size=batch_size,
        loss=loss_for(y),
        device=job.device,
        should_stop=hooks.should_stop,
    )


def evaluate_adapted(
    payload: JobPayload,
    store: Store,
    weights_sha256: str,
    part: SampleRange,
    hooks: JobHooks | None = None,
) -> MetricSums:
    """The adapted model's (``weights_sha256`` in the store) metric sums on ``part``: what an
    evaluation child of a sharded job runs."""
    adapted = payload.model.model_copy(update={"weights_sha256": weights_sha256})
    job = load_job(payload.model_copy(update={"model": adapted}), store)
    params = payload.params
    assert isinstance(params, AdaptParams), f"{payload.kind} jobs are not sharded"
    return _measure_part(job, part, params.batch_size, hooks or NoHooks())


def with_metrics(
    weights: StoredWeights, results: Sequence[ShardResult], after: Sequence[MetricSums]
) -> StoredWeights:
    """The merge's ``weights`` with the report's metrics before and after: the sums of every
    shard's and every evaluation child's part."""
    before = [sums for r in results if (sums := r.before_sums()) is not None]
    if len(before) != len(results) or len(after) != len(results):
        raise AdaptError(
            f"the metrics of {len(results) - len(before)} shards and "
            f"{len(results) - len(after)} evaluations of the {len(results)} parts are missing; "
            "submit the job again"
        )
    update = {
        "metrics_before": contract_metrics(sum(before[1:], before[0]).metrics()),
        "metrics_after": contract_metrics(sum(after[1:], after[0]).metrics()),
    }
    return weights.model_copy(update={"report": weights.report.model_copy(update=update)})


def merge_statistics(results: Sequence[ShardResult]) -> dict[str, LayerStatistics]:
    """All shards' statistics per layer, merged in batch order."""
    merged: dict[str, LayerStatistics] = {}
    for result in sorted(results, key=lambda r: r.summary.first_batch):
        for name, stats in result.statistics().items():
            merged[name] = merged[name].merge(stats) if name in merged else stats
    return merged


def compute_merged(
    payload: JobPayload,
    store: Store,
    results: Sequence[ShardResult],
    hooks: JobHooks | None = None,
    measure: bool = True,
) -> JobOutcome:
    """The sharded job's new weights and report: :func:`workers.running.compute.compute` with the
    shards' merged statistics applied in place of the estimator's pass; ``measure``: as
    there."""
    shards = sorted((r.summary for r in results), key=lambda s: s.index)
    stats = AdaptStats(
        batches=sum(s.batches for s in shards), samples=sum(s.samples for s in shards)
    )
    params = payload.params
    assert isinstance(params, AdaptParams), f"{payload.kind} jobs are not sharded"
    merged = merge_statistics(results)
    merged_runner = params.spec.merged_runner
    if merged_runner is None:
        estimate = _apply_merged(merged, stats)
    else:
        run_merged = load_merged_runner(merged_runner)

        def estimate(task: EstimatorTask) -> AdaptStats:
            return run_merged(task, merged, stats)

    outcome = compute(payload, store, Adaptation(params, estimate), hooks, measure)
    return dataclasses.replace(outcome, report=outcome.report.model_copy(update={"shards": shards}))


def _apply_merged(merged: dict[str, LayerStatistics], stats: AdaptStats) -> Estimate:
    def estimate(task: EstimatorTask) -> AdaptStats:
        model, params, layers, hooks = task.model, task.params, task.layers, task.hooks
        hooks.start_phase("merge", 1, "batches", float(stats.samples))

        def apply(weighting: Weighting) -> AdaptStats:
            apply_statistics(model, merged, layers, weighting)
            return stats

        weighting = _weighting(params)
        if params.spec.sharding == "prior_base":
            mix_with_source(model, layers, params.prior_strength, lambda: apply(weighting))
        else:
            apply(weighting)
        hooks.report(1)
        return stats

    return estimate


def _weighting(params: AdaptParams) -> Weighting:
    """How the job's estimator pools per-batch statistics; AdaptError if it cannot."""
    pooling = params.spec.sharding
    if pooling == "prior_base":
        pooling = ESTIMATORS[params.prior_base].sharding
    if pooling not in ("elements", "batches"):
        raise AdaptError(
            f"the {params.estimator} estimator cannot be sharded; submit it with shards=1"
        )
    return pooling
