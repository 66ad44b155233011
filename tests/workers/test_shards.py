"""Sharded adaptation computed in process: the shards' statistics, sent as JSON and merged, give
the single worker's result. No Redis here (the service path: tests/e2e/test_shards_e2e.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import safetensors.torch
import torch
from pydantic import ValidationError

from api_schemas import AdaptParams, JobPayload, JobPayloadDataset, JobPayloadModel
from harness.digits import digits
from harness.stack import npz_bytes
from service.store.local import LocalStore
from workers.errors import AdaptError
from workers.kinds.changing import compute
from workers.models.architectures import build_model
from workers.running.compute import JobOutcome
from workers.running.evaluation import Loss, MetricSums, evaluate_sums
from workers.running.saving import StoredWeights, store_weights, weights_bytes
from workers.sharding.compute import (
    ShardPlan,
    ShardResult,
    SumsMessage,
    collect_shard,
    compute_merged,
    evaluate_adapted,
    plan_evaluation,
    plan_shards,
    with_metrics,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 1797 digits in batches of 100: 18 batches, the last one of 97 samples.
SAMPLES, BATCH_SIZE, BATCHES = 1797, 100, 18


def test_plan_shards_covers_the_batches_in_contiguous_runs() -> None:
    for total in (1, 2, 7, 18, 100):
        for shards in range(1, min(total, 9) + 1):
            plan = plan_shards(total, shards)
            assert [s.index for s in plan] == list(range(shards))
            assert plan[0].first_batch == 0
            for before, after in itertools.pairwise(plan):
                assert after.first_batch == before.first_batch + before.batches
            assert sum(s.batches for s in plan) == total
            assert max(s.batches for s in plan) - min(s.batches for s in plan) <= 1
    assert [s.batches for s in plan_shards(18, 4)] == [5, 5, 4, 4]
    with pytest.raises(AdaptError, match="5 shards need at least 5 batches but the job runs 4"):
        plan_shards(4, 5)


def test_plan_evaluation_splits_the_samples_in_whole_batches() -> None:
    for samples, batch in ((1, 1), (7, 2), (1797, 100), (1797, 64), (30, 7)):
        total = -(-samples // batch)
        for parts in range(1, min(total, 9) + 1):
            ranges = plan_evaluation(samples, parts, batch)
            assert ranges[0].start == 0 and ranges[-1].stop == samples
            for before, after in itertools.pairwise(ranges):
                assert after.start == before.stop
                assert before.stop % batch == 0  # only the last part ends in a short batch
    assert [(r.start, r.stop) for r in plan_evaluation(1797, 3, 100)] == [
        (0, 600),
        (600, 1200),
        (1200, 1797),
    ]
    with pytest.raises(AdaptError, match="4 shards need at least 4 batches"):
        plan_evaluation(30, 4, 10)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_metric_sums_of_parts_add_up_to_the_whole(loss: Loss) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", {"in_features": 12, "hidden": 16, "num_classes": 3})
    x = torch.randn(101, 12)
    y = torch.randint(0, 3, (101,)) if loss == "cross_entropy" else torch.randn(101, 3)
    whole = evaluate_sums(model, x, y, batch_size=32, loss=loss).metrics()
    parts = [
        evaluate_sums(model, x[a:b], y[a:b], batch_size=32, loss=loss)
        for a, b in [(0, 40), (40, 41), (41, 101)]
    ]
    # Through JSON, as they travel between workers.
    parts = [
        SumsMessage.model_validate_json(SumsMessage.of(p).model_dump_json()).sums() for p in parts
    ]
    summed = (parts[0] + parts[1] + parts[2]).metrics()
    assert summed.num_samples == whole.num_samples == 101
    assert summed.loss == pytest.approx(whole.loss, rel=1e-6)
    assert (summed.accuracy, summed.mse is None) == (whole.accuracy, whole.mse is None)
    if loss == "mse":
        assert summed.mse == pytest.approx(whole.mse, rel=1e-6)
    with pytest.raises(ValueError, match="cannot add metric sums"):
        _ = parts[0] + MetricSums("mse", 1, 1, 0.0, 0)


def test_sequential_estimators_refuse_shards() -> None:
    for estimator in ("ema", "entropy"):
        with pytest.raises(ValidationError, match=f"the {estimator} estimator is sequential"):
            AdaptParams.model_validate({"estimator": estimator, "shards": 2})
        assert AdaptParams.model_validate({"estimator": estimator}).shards == 1
    with pytest.raises(
        ValidationError,
        match="use shards=1, or estimator 'cumulative', 'precise', 'prior' or 'auto'",
    ):
        AdaptParams(estimator="ema", shards=3)
    for estimator in ("precise", "cumulative", "prior", "auto"):
        assert AdaptParams.model_validate({"estimator": estimator, "shards": 4}).shards == 4
    with pytest.raises(ValidationError, match="shards"):
        AdaptParams(shards=0)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    return LocalStore(tmp_path_factory.mktemp("store"))


def adapt_payload(
    store: LocalStore,
    dataset: bytes,
    params: AdaptParams,
    width: int = 8,
    job_id: str = "job_sharded",
    tenant_id: str = "tn_test",
) -> JobPayload:
    """An adapt job on a digits_cnn of ``width`` (seeded) and an npz ``dataset``, both put in
    ``store``, as the API would enqueue it."""
    torch.manual_seed(5)
    model = build_model("digits_cnn", {"width": width})
    return JobPayload(
        job_id=job_id,
        tenant_id=tenant_id,
        kind="adapt",
        model=JobPayloadModel(
            id="mdl_source",
            architecture="digits_cnn",
            kwargs={"width": width},
            weights_sha256=store.put_bytes(weights_bytes(model.state_dict())),
        ),
        dataset=JobPayloadDataset(id="ds_target", sha256=store.put_bytes(dataset), format="npz"),
        params=params,
    )


def payload(store: LocalStore, params: dict[str, Any], labels: bool = True) -> JobPayload:
    """On the 1797 shifted digits, in batches of 100."""
    x, y = digits(shifted=True)
    data = npz_bytes(x=x, y=y) if labels else npz_bytes(x=x)
    adapt = AdaptParams.model_validate({"batch_size": BATCH_SIZE, **params})
    return adapt_payload(store, data, adapt)


def run_sharded(job: JobPayload, store: LocalStore, plan: list[ShardPlan]) -> JobOutcome:
    # Each shard's result crosses a process boundary as JSON, as through Redis.
    results = [
        ShardResult.model_validate_json(
            collect_shard(job, store, shard, worker=f"w{shard.index}").model_dump_json()
        )
        for shard in plan
    ]
    return compute_merged(job, store, results)


def run_sharded_measured(
    job: JobPayload, store: LocalStore, plan: list[ShardPlan]
) -> tuple[JobOutcome, StoredWeights]:
    """The path of a job on labelled data: the shards also measure the source model on their
    part, the merge stores the weights unmeasured, K evaluation children measure them, and the
    finish adds up both rounds (workers/sharding/jobs.py runs the same calls)."""
    parts = plan_evaluation(SAMPLES, len(plan), BATCH_SIZE)
    results = [
        ShardResult.model_validate_json(
            collect_shard(job, store, shard, evaluate_part=part).model_dump_json()
        )
        for shard, part in zip(plan, parts, strict=True)
    ]
    merged = compute_merged(job, store, results, measure=False)
    assert (merged.report.metrics_before, merged.report.metrics_after) == (None, None)
    weights = StoredWeights.model_validate_json(store_weights(merged, store).model_dump_json())
    after = [
        SumsMessage.model_validate_json(
            SumsMessage.of(evaluate_adapted(job, store, weights.sha256, part)).model_dump_json()
        ).sums()
        for part in parts
    ]
    return merged, with_metrics(weights, results, after)


def assert_same_adaptation(
    sharded: dict[str, torch.Tensor], single: dict[str, torch.Tensor], batches: int
) -> None:
    """Running statistics within 1e-6 relative (a mean near 0 measured against the spread, as
    in tests/workers/estimators/test_precise.py), counters exact, every other tensor bitwise
    equal."""
    assert set(sharded) == set(single)  # safetensors keeps no key order
    layers = [key.removesuffix(".running_mean") for key in single if key.endswith("running_mean")]
    assert layers
    for layer in layers:
        mean, var = (
            single[f"{layer}.running_mean"].double(),
            single[f"{layer}.running_var"].double(),
        )
        mean_error = (sharded[f"{layer}.running_mean"].double() - mean).abs()
        var_error = (sharded[f"{layer}.running_var"].double() - var).abs()
        assert (mean_error / (mean.abs() + var.sqrt())).max() <= 1e-6, layer
        assert (var_error / var).max() <= 1e-6, layer
        assert int(sharded[f"{layer}.num_batches_tracked"]) == batches
        assert int(single[f"{layer}.num_batches_tracked"]) == batches
    for key, value in single.items():
        if not key.endswith(("running_mean", "running_var")):
            assert torch.equal(sharded[key], value), key


@pytest.mark.parametrize(
    "params",
    [
        {"estimator": "precise"},
        {"estimator": "cumulative"},
        {"estimator": "prior", "prior_base": "precise", "prior_strength": 300.0},
        {"estimator": "prior", "prior_base": "cumulative", "prior_strength": 300.0},
    ],
    ids=["precise", "cumulative", "prior-precise", "prior-cumulative"],
)
def test_merged_shards_equal_one_worker(store: LocalStore, params: dict[str, Any]) -> None:
    job = payload(store, params)
    single = compute(job, store)
    plan = plan_shards(BATCHES, 3)
    sharded = run_sharded(job, store, plan)
    assert_same_adaptation(sharded.state_dict, single.state_dict, BATCHES)

    report = sharded.report
    assert (report.batches, report.samples) == (BATCHES, SAMPLES)
    assert (report.batches, report.samples) == (single.report.batches, single.report.samples)
    assert [(s.index, s.first_batch, s.batches, s.worker) for s in report.shards] == [
        (0, 0, 6, "w0"),
        (1, 6, 6, "w1"),
        (2, 12, 6, "w2"),
    ]
    assert [s.samples for s in report.shards] == [600, 600, 597]
    assert single.report.shards == []
    assert all(layer.consistent and layer.reset for layer in report.batchnorm)
    assert report.metrics_after is not None
    assert single.report.metrics_after is not None
    assert report.metrics_after.accuracy == single.report.metrics_after.accuracy


def test_shards_leave_the_held_out_samples_out(store: LocalStore) -> None:
    """With a holdout the shards split the estimation batches: the samples one worker holds
    out (drawn from the seed) are in no shard, and the merge is one worker's."""
    job = payload(store, {"estimator": "precise", "holdout": 0.25, "seed": 2}, labels=False)
    params = job.params
    assert isinstance(params, AdaptParams)
    total = params.estimation_batches(SAMPLES)
    assert total == 14  # 1797 - 449 held out = 1348 samples
    single = compute(job, store)
    sharded = run_sharded(job, store, plan_shards(total, 3))
    assert_same_adaptation(sharded.state_dict, single.state_dict, total)
    assert (sharded.report.batches, sharded.report.samples) == (total, 1348)
    assert (single.report.batches, single.report.samples) == (total, 1348)
    assert [s.samples for s in sharded.report.shards] == [500, 500, 348]


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_sharded_evaluation_equals_one_workers(store: LocalStore, shards: int) -> None:
    job = payload(store, {"estimator": "precise"})
    single = compute(job, store)
    merged, measured = run_sharded_measured(job, store, plan_shards(BATCHES, shards))
    assert_same_adaptation(merged.state_dict, single.state_dict, BATCHES)
    stored = safetensors.torch.load(store.local_path(measured.sha256).read_bytes())
    assert all(torch.equal(stored[k], v) for k, v in merged.state_dict.items())
    for which in ("metrics_before", "metrics_after"):
        got, want = getattr(measured.report, which), getattr(single.report, which)
        assert got is not None and want is not None, which
        assert (got.num_samples, got.accuracy, got.mse) == (want.num_samples, want.accuracy, None)
        # The same batches: only the order of the float64 additions of batch sums differs.
        assert got.loss == pytest.approx(want.loss, rel=1e-12), which
    # Adapting changed the metrics: the sums are not the source model's twice.
    assert measured.report.metrics_after != measured.report.metrics_before
    assert measured.report.shards == merged.report.shards
    assert measured.size_bytes == store.local_path(measured.sha256).stat().st_size


def test_statistics_differ_from_the_source(store: LocalStore) -> None:
    # Guards the test above: a merge that wrote nothing would leave the source statistics,
    # which are far from the adapted ones.
    job = payload(store, {"estimator": "precise"}, labels=False)
    source = build_model("digits_cnn", {"width": 8})
    sharded = run_sharded(job, store, plan_shards(BATCHES, 2))
    for key, value in source.state_dict().items():
        if key.endswith("running_var"):
            assert not torch.allclose(sharded.state_dict[key], value, rtol=1e-2), key
    assert sharded.report.metrics_before is None


def test_a_shard_runs_only_its_batches(store: LocalStore) -> None:
    job = payload(store, {"estimator": "precise", "max_batches": 7}, labels=False)
    plan = plan_shards(7, 2)
    results = [collect_shard(job, store, shard) for shard in plan]
    assert [(r.summary.batches, r.summary.samples) for r in results] == [(4, 400), (3, 300)]
    for result in results:
        assert {stats.batches for stats in result.layers.values()} == {result.summary.batches}
        counts = {stats.count for stats in result.layers.values()}
        assert counts == {result.summary.samples * 8 * 8}  # N * H * W elements per channel
    single = compute(job, store)
    assert_same_adaptation(run_sharded(job, store, plan).state_dict, single.state_dict, 7)


def test_shard_beyond_the_data_is_an_error(store: LocalStore) -> None:
    job = payload(store, {"estimator": "cumulative"}, labels=False)
    with pytest.raises(AdaptError, match="only 1797 samples"):
        collect_shard(job, store, ShardPlan(index=3, first_batch=17, batches=2))
