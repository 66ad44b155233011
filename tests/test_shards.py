"""Sharded adaptation computed in process: the shards' statistics, sent as JSON and merged, give
the single worker's result. No Redis here (the service path: tests/test_shards_e2e.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from api_schemas import AdaptParams, JobPayload, JobPayloadDataset, JobPayloadModel
from service.store import LocalStore
from tests.stack import npz_bytes
from tests.test_e2e import digits
from workers.architectures import build_model
from workers.compute import JobOutcome, compute, weights_bytes
from workers.errors import AdaptError
from workers.shards import (
    ShardPlan,
    ShardResult,
    collect_shard,
    compute_merged,
    plan_shards,
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


def test_sequential_estimators_refuse_shards() -> None:
    for estimator in ("ema", "entropy"):
        with pytest.raises(ValidationError, match=f"the {estimator} estimator is sequential"):
            AdaptParams.model_validate({"estimator": estimator, "shards": 2})
        assert AdaptParams.model_validate({"estimator": estimator}).shards == 1
    with pytest.raises(ValidationError, match="use shards=1, or estimator 'precise'"):
        AdaptParams(estimator="ema", shards=3)
    for estimator in ("precise", "cumulative", "prior"):
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
        ShardResult.from_json(collect_shard(job, store, shard, worker=f"w{shard.index}").to_json())
        for shard in plan
    ]
    return compute_merged(job, store, results)


def assert_same_adaptation(
    sharded: dict[str, torch.Tensor], single: dict[str, torch.Tensor], batches: int
) -> None:
    """Running statistics within 1e-6 relative (a mean near 0 measured against the spread, as
    in tests/test_precise.py), counters exact, every other tensor bitwise equal."""
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
