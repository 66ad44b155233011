"""The ``auto`` estimator and the prediction diagnostics of every adapt job: the candidates and
the choice are reported, the choice follows the rule of NOTE [ Choosing without labels ], the
kept candidate is bitwise what the fixed estimator gives on the same estimation samples, auto on
the source's own distribution keeps the source, and the whole path runs through the service."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from api_schemas import AdaptParams, JobPayload
from api_schemas.reports import AutoChoice, Predictions, Report
from harness.stack import Stack, npz_bytes
from service.local.demo import digits_split
from service.local.summary import diagnostic_lines
from service.store.local import LocalStore
from tests.workers.test_shards import assert_same_adaptation
from workers.errors import AdaptError
from workers.estimators.auto import (
    MARGINAL_GAIN,
    SCORE_MARGIN,
    SOURCE_WEIGHTS,
    TENT_MARGINS,
    cross_fit_folds,
    margin_for,
    statistics_eligible,
    tent_replaces,
)
from workers.estimators.base import select_batchnorm
from workers.estimators.precise import collect_statistics
from workers.kinds.changing import compute
from workers.models.architectures import build_model
from workers.passes.data import iter_batches
from workers.passes.predictions import split_target
from workers.running.compute import JobOutcome
from workers.running.loading import load_job
from workers.running.saving import weights_bytes
from workers.sharding.compute import (
    ShardPlan,
    ShardResult,
    collect_shard,
    compute_merged,
    merge_statistics,
    plan_shards,
)
from workers.training.training import TrainSettings, train_model

TRAIN_EPOCHS = 6


@pytest.fixture(scope="module")
def digits() -> dict[str, Any]:
    return trained_digits()


def trained_digits() -> dict[str, Any]:
    """The demo's digits split and the digits CNN trained on it in-process (a few seconds)."""
    split = digits_split()
    torch.manual_seed(0)
    model = build_model("digits_cnn", {})
    train_model(
        model,
        torch.from_numpy(split.x_train),
        torch.from_numpy(split.y_train),
        TrainSettings(
            epochs=TRAIN_EPOCHS,
            batch_size=32,
            optimizer="sgd",
            lr=0.05,
            momentum=0.9,
            weight_decay=0.0,
            loss="cross_entropy",
            validation_fraction=0.0,
            seed=0,
            device=torch.device("cpu"),
        ),
    )
    return {"split": split, "weights": weights_bytes(model.state_dict())}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def run_adapt(
    store: LocalStore, digits: dict[str, Any], x: np.ndarray, **params: Any
) -> JobOutcome:
    return compute(adapt_payload(store, digits, x, **params), store)


def adapt_payload(
    store: LocalStore, digits: dict[str, Any], x: np.ndarray, **params: Any
) -> JobPayload:
    weights = store.put_bytes(digits["weights"])
    dataset = store.put_bytes(npz_bytes(x=x, y=digits["split"].y_test))
    return JobPayload.model_validate(
        {
            "job_id": "job_x",
            "tenant_id": "tn_1",
            "kind": "adapt",
            "model": {
                "id": "mdl_a",
                "architecture": "digits_cnn",
                "kwargs": {},
                "weights_sha256": weights,
            },
            "dataset": {"id": "ds_b", "sha256": dataset, "format": "npz"},
            "params": {"batch_size": 64, "device": "cpu", **params},
        }
    )


def accuracy(report: Report, when: str) -> float:
    metrics = report.metrics_before if when == "before" else report.metrics_after
    assert metrics is not None and metrics.accuracy is not None
    return metrics.accuracy


def assert_rule_holds(report: Report) -> None:
    """The kept candidate follows NOTE [ Choosing without labels ], read here from the table
    alone: margin m = 0.1 / sqrt(samples scored); a statistics candidate is eligible when its score
    beats the source's by m and it lowers the mean entropy or raises the marginal entropy by
    0.25; the best eligible score (or the source) is kept, ties to the earlier; entropy then
    replaces it when it beats the source by 4 m and entropy's score beats it by m."""
    auto = report.auto
    assert auto is not None
    source = auto.candidates[0]
    assert source.name == "source" and source.eligible and source.changed_fraction == 0
    m = 0.1 / auto.scored() ** 0.5  # over every sample scored (NOTE [ Cross-fitting ])
    best = 0
    for index, candidate in enumerate(auto.candidates[1:], start=1):
        if candidate.name == "entropy":
            continue
        lowers = candidate.predictions.mean_entropy < source.predictions.mean_entropy
        spreads = (
            candidate.predictions.marginal_entropy > source.predictions.marginal_entropy + 0.25
        )
        ok = candidate.score > source.score + m and (lowers or spreads)
        assert candidate.eligible == ok, (index, candidate)
        if ok and candidate.score > auto.candidates[best].score:
            best = index
    for index, candidate in enumerate(auto.candidates):
        if candidate.name == "entropy":
            chosen = auto.candidates[best].score
            ok = best != 0 and chosen > source.score + 4 * m and candidate.score > chosen + m
            assert candidate.eligible == ok, candidate
            best = index if ok else best
    assert auto.chosen_index == best
    assert auto.chosen == auto.candidates[auto.chosen_index].name
    assert auto.kept_source == (auto.chosen_index == 0)


def test_choice_rule_parts() -> None:
    """Each gate of NOTE [ Choosing without labels ] on its own: the margin shrinks with the
    held-out samples; a statistics candidate needs a score above the source's by the margin and
    a lower mean entropy or a marginal entropy raised by 0.25 nats; entropy (TENT) replaces the
    choice only when that choice beats the source by 4 margins and TENT beats it by one more."""
    assert margin_for(4) == pytest.approx(SCORE_MARGIN / 2)
    assert margin_for(100) == pytest.approx(SCORE_MARGIN / 10)
    m = margin_for(16)  # 0.025

    def seen(mean_entropy: float, marginal_entropy: float) -> Predictions:
        return Predictions(
            mean_entropy=mean_entropy, mean_max_probability=0.5, marginal_entropy=marginal_entropy
        )

    source = seen(1.0, 2.0)  # score 1.0
    # A score above the margin with a lower mean entropy: eligible; within the margin: not.
    assert statistics_eligible(1.0, source, 1.0 + 2 * m, seen(0.9, 1.9 + 2 * m), m)
    assert not statistics_eligible(1.0, source, 1.0 + m / 2, seen(0.9, 1.9 + m / 2), m)
    # A higher mean entropy is let in only by predictions spread by more than MARGINAL_GAIN.
    assert not statistics_eligible(1.0, source, 1.1, seen(1.1, 2.2), m)
    spread = seen(1.2, 2.0 + MARGINAL_GAIN + 0.1)
    assert statistics_eligible(1.0, source, spread.marginal_entropy - 1.2, spread, m)
    # A lower mean entropy with a collapse of the marginal lowers the score: not eligible.
    assert not statistics_eligible(1.0, source, 0.5, seen(0.5, 1.0), m)
    # TENT's gate.
    strong = 1.0 + TENT_MARGINS * m + 0.01
    assert tent_replaces(1.0, strong, strong + 2 * m, m)
    assert not tent_replaces(1.0, strong, strong + m / 2, m)  # not better by a margin
    weak = 1.0 + (TENT_MARGINS - 1) * m
    assert not tent_replaces(1.0, weak, weak + 10 * m, m)  # the choice's evidence too weak


def test_auto_options_are_checked() -> None:
    assert AdaptParams(estimator="auto").effective_holdout() == 0.25
    assert AdaptParams(estimator="precise").effective_holdout() == 0.0
    # Sharded auto (and sharded fixed estimators with a holdout) are accepted: the shards split
    # the estimation batches, the merge scores the candidates (tests/workers/test_shards.py).
    assert AdaptParams(estimator="auto", shards=2).shards == 2
    assert AdaptParams(estimator="precise", holdout=0.25, shards=2).effective_holdout() == 0.25
    for bad, match in [
        (
            {"estimator": "auto", "shards": 2, "allow_backward": True},
            "use shards=1 to include entropy, or drop allow_backward",
        ),
        ({"estimator": "auto", "reset": True}, "drop reset"),
        ({"estimator": "auto", "holdout": 0}, "holdout must be > 0"),
        ({"estimator": "precise", "allow_backward": True}, "option of the auto estimator"),
        ({"estimator": "auto", "holdout": 0.6}, "less than or equal to 0.5"),
    ]:
        with pytest.raises(ValidationError, match=match):
            AdaptParams.model_validate(bad)


def test_split_is_seeded_disjoint_and_in_order() -> None:
    x = torch.arange(100.0)[:, None]  # (100, 1)
    split = split_target(x, batch_size=16, max_batches=5, fraction=0.25, seed=3)
    est, held = split.estimation[:, 0], split.held_out[:, 0]
    assert len(held) == 20 and len(est) == 60  # of the 80 samples 5 batches of 16 use
    assert torch.equal(torch.cat([est, held]).sort().values, torch.arange(80.0))
    assert torch.equal(est, est.sort().values) and torch.equal(held, held.sort().values)
    again = split_target(x, batch_size=16, max_batches=5, fraction=0.25, seed=3)
    assert torch.equal(again.held_out, split.held_out)
    other = split_target(x, batch_size=16, max_batches=5, fraction=0.25, seed=4)
    assert not torch.equal(other.held_out, split.held_out)
    whole = split_target(x, batch_size=16, max_batches=None, fraction=0.0, seed=3)
    assert whole.estimation is x and not whole.is_held_out and len(whole.held_out) == 100


def test_auto_on_the_source_distribution_keeps_the_source(
    store: LocalStore, digits: dict[str, Any]
) -> None:
    """Clean test digits come from the training distribution: auto keeps the source
    statistics (or a candidate that changes no held-out prediction), and accuracy moves by at
    most 0.2 point."""
    outcome = run_adapt(store, digits, digits["split"].x_test, estimator="auto")
    report = outcome.report
    assert report.auto is not None
    assert_rule_holds(report)
    kept = report.auto.candidates[report.auto.chosen_index]
    assert report.auto.kept_source or kept.changed_fraction == 0.0
    assert abs(accuracy(report, "after") - accuracy(report, "before")) <= 0.002
    if report.auto.kept_source:
        assert not any(t.changed for t in report.tensors)
        assert report.batches == 0
    assert all(layer.consistent for layer in report.batchnorm)


def test_auto_adapts_a_global_shift_and_equals_the_fixed_estimator(
    store: LocalStore, digits: dict[str, Any]
) -> None:
    """On faint digits (x * 0.05) auto adapts; it is deterministic; the kept candidate is
    bitwise the fixed estimator on the same estimation samples (the same holdout and seed);
    the report lists the candidates and the diagnostics on the held-out samples."""
    x = (digits["split"].x_test * 0.05).astype(np.float32)
    outcome = run_adapt(store, digits, x, estimator="auto", seed=5)
    report = outcome.report
    auto = report.auto
    assert auto is not None
    assert_rule_holds(report)
    assert [c.name for c in auto.candidates] == ["source", "precise", *["prior"] * 3]
    assert [c.source_weight for c in auto.candidates[2:]] == list(SOURCE_WEIGHTS)
    assert auto.held_out_samples == round(0.25 * len(x))
    assert auto.estimation_samples == len(x) - auto.held_out_samples
    assert not auto.kept_source
    assert accuracy(report, "after") > accuracy(report, "before") + 0.5
    assert all(layer.consistent for layer in report.batchnorm)
    found = report.diagnostics
    assert found is not None and found.held_out and found.samples == auto.held_out_samples
    kept = auto.candidates[auto.chosen_index]
    assert found.after == kept.predictions
    assert found.before == auto.candidates[0].predictions
    assert found.changed_fraction == kept.changed_fraction
    assert found.after.mean_entropy < found.before.mean_entropy

    again = run_adapt(store, digits, x, estimator="auto", seed=5)
    assert again.report.auto == auto
    assert all(torch.equal(v, again.state_dict[k]) for k, v in outcome.state_dict.items())

    fixed: dict[str, Any] = {"estimator": kept.name, "holdout": 0.25, "seed": 5}
    if kept.name == "prior":
        fixed |= {"prior_strength": kept.prior_strength, "prior_base": "precise"}
    same = run_adapt(store, digits, x, **fixed)
    assert same.report.samples == auto.estimation_samples
    assert all(torch.equal(v, same.state_dict[k]) for k, v in outcome.state_dict.items())
    assert same.report.diagnostics == found


@pytest.mark.parametrize("backward", [False, True], ids=["statistics", "with-entropy"])
def test_few_samples_are_cross_fitted(
    store: LocalStore, digits: dict[str, Any], backward: bool
) -> None:
    """16 target samples hold out 4: every candidate is estimated again without each of 3
    more folds of 4 and predicts it, so the scores are over all 16 samples; the kept candidate
    is still the one estimated on the 12 estimation samples, bitwise the fixed estimator with
    the same holdout and seed; the progress units add up; deterministic."""
    x = (digits["split"].x_test * 0.05).astype(np.float32)  # the job uses the first 16
    extra: dict[str, Any] = {"allow_backward": True, "steps": 4, "lr": 1e-3} if backward else {}
    extra |= {"batch_size": 16, "max_batches": 1}
    outcome = run_adapt(store, digits, x, estimator="auto", seed=3, **extra)
    auto = outcome.report.auto
    assert auto is not None
    assert (auto.held_out_samples, auto.estimation_samples) == (4, 12)
    assert (auto.folds, auto.scored(), auto.scored_samples) == (4, 16, 16)
    assert_rule_holds(outcome.report)
    assert "cross-fitted over 4 folds (16 samples scored)" in "\n".join(
        diagnostic_lines(outcome.report)
    )
    again = run_adapt(store, digits, x, estimator="auto", seed=3, **extra)
    assert again.report.auto == auto
    kept = auto.candidates[auto.chosen_index]
    if kept.name in ("precise", "prior"):
        fixed: dict[str, Any] = {"estimator": kept.name, "holdout": 0.25, "seed": 3}
        if kept.name == "prior":
            fixed |= {"prior_strength": kept.prior_strength, "prior_base": "precise"}
        same = run_adapt(store, digits, x, batch_size=16, max_batches=1, **fixed)
        assert all(torch.equal(v, same.state_dict[k]) for k, v in outcome.state_dict.items())
    # 64 held out and more: one fold, the held-out samples only.
    wide = run_adapt(store, digits, x, estimator="auto", seed=3, max_batches=4).report.auto
    assert wide is not None and (wide.folds, wide.scored()) == (1, wide.held_out_samples) == (1, 64)


def test_cross_fit_folds_partition_the_samples() -> None:
    """The folds come from the held-out draw's permutation: fold 0 is the held-out set, the
    others cut the estimation samples, and each fold's estimation set is every other sample."""
    x = torch.arange(40.0).reshape(40, 1)
    split = split_target(x, 8, None, 0.25, 7)
    assert split.order is not None and len(split.held_out) == 10

    class Task:
        params = AdaptParams(estimator="auto", batch_size=8)

    task = Task()
    task.x = x  # type: ignore[attr-defined]
    folds = cross_fit_folds(task, split)  # type: ignore[arg-type]
    assert len(folds) == 3
    seen = [set(split.held_out.flatten().tolist())]
    for train, fold in folds:
        fold_set, train_set = set(fold.flatten().tolist()), set(train.flatten().tolist())
        assert fold_set.isdisjoint(train_set) and len(fold_set | train_set) == 40
        assert fold.flatten().tolist() == sorted(fold_set)  # the dataset's order
        assert train.flatten().tolist() == sorted(train_set)
        seen.append(fold_set)
    assert sorted(len(f) for f in seen) == [10, 10, 10, 10]
    assert set().union(*seen) == set(range(40))


def test_allow_backward_adds_entropy(store: LocalStore, digits: dict[str, Any]) -> None:
    x = (digits["split"].x_test * 0.4).astype(np.float32)
    outcome = run_adapt(store, digits, x, estimator="auto", allow_backward=True, steps=8, lr=1e-3)
    auto = outcome.report.auto
    assert auto is not None
    assert [c.name for c in auto.candidates][-1] == "entropy"
    assert_rule_holds(outcome.report)
    assert all(layer.consistent for layer in outcome.report.batchnorm)


# How far a sharded auto job's scores may be from one worker's: the merged statistics differ
# from one pass's only by the order of float64 additions (below 1e-12 relative), so the
# float32 statistics differ by at most an ulp and the held-out predictions' entropies by far
# less than this (nats).
SHARDED_SCORE_ABS = 1e-5


def assert_same_choice(sharded: AutoChoice, single: AutoChoice) -> None:
    """A sharded auto job's choice is one worker's: the same candidates, choice and counts,
    every score and prediction summary within SHARDED_SCORE_ABS, and the same predictions
    changed (float rounding moves no held-out argmax here)."""
    assert sharded.criterion == single.criterion
    assert (sharded.chosen, sharded.chosen_index, sharded.kept_source) == (
        single.chosen,
        single.chosen_index,
        single.kept_source,
    )
    assert (sharded.estimation_samples, sharded.held_out_samples) == (
        single.estimation_samples,
        single.held_out_samples,
    )
    assert len(sharded.candidates) == len(single.candidates)
    for got, want in zip(sharded.candidates, single.candidates, strict=True):
        assert (got.name, got.source_weight, got.eligible) == (
            want.name,
            want.source_weight,
            want.eligible,
        )
        assert got.prior_strength == want.prior_strength  # w / (1 - w) * estimation samples
        assert got.score == pytest.approx(want.score, abs=SHARDED_SCORE_ABS)
        for field in ("mean_entropy", "mean_max_probability", "marginal_entropy"):
            assert getattr(got.predictions, field) == pytest.approx(
                getattr(want.predictions, field), abs=SHARDED_SCORE_ABS
            ), (got.name, field)
        assert got.changed_fraction == want.changed_fraction


@pytest.mark.parametrize("scale", [0.05, 1.0], ids=["faint", "clean"])
def test_sharded_auto_equals_one_worker(
    store: LocalStore, digits: dict[str, Any], scale: float
) -> None:
    """The shards collect precise on their runs of the estimation batches (the held-out
    samples, drawn from the seed, in none of them); merged, the statistics are one pass's up to
    float rounding, and the merge's scores, choice and kept statistics are one worker's. Faint
    digits: auto adapts; clean ones: it keeps (or nearly keeps) the source."""
    x = (digits["split"].x_test * scale).astype(np.float32)  # 597 digits
    job = adapt_payload(store, digits, x, estimator="auto", seed=5, shards=3)
    params = job.params
    assert isinstance(params, AdaptParams)
    single = compute(job, store)  # what one worker computes: compute() ignores `shards`
    total = params.estimation_batches(len(x))
    assert total == 7  # 597 - 149 held out = 448 samples, 7 batches of 64
    plan = plan_shards(total, 3)
    results = [
        ShardResult.model_validate_json(collect_shard(job, store, shard).model_dump_json())
        for shard in plan
    ]
    assert [r.summary.samples for r in results] == [192, 128, 128]

    # The merge of the shards' statistics is one pass's over the same estimation samples.
    loaded = load_job(job, store)
    layers = select_batchnorm(loaded.model, params.include, params.exclude)
    split = split_target(loaded.x, 64, None, 0.25, 5)
    one_pass = collect_statistics(loaded.model, iter_batches(split.estimation, 64), layers=layers)
    merged = merge_statistics(results)
    assert set(merged) == set(one_pass) == set(layers)
    for name, want in one_pass.items():
        got = merged[name]
        assert (got.count, got.batches) == (want.count, want.batches) == (448 * 8 * 8, 7)
        assert torch.allclose(got.mean, want.mean, rtol=1e-12, atol=1e-12), name
        assert torch.allclose(got.m2, want.m2, rtol=1e-12, atol=0.0), name

    sharded = compute_merged(job, store, results)
    got, want = sharded.report.auto, single.report.auto
    assert got is not None and want is not None
    assert_same_choice(got, want)
    assert_rule_holds(sharded.report)
    assert (sharded.report.batches, sharded.report.samples) == (
        single.report.batches,
        single.report.samples,
    )
    assert [s.batches for s in sharded.report.shards] == [3, 2, 2]
    if scale == 0.05:
        assert not got.kept_source
    if got.kept_source:  # the source model unchanged, on both
        assert all(torch.equal(v, single.state_dict[k]) for k, v in sharded.state_dict.items())
        assert not any(t.changed for t in sharded.report.tensors)
    else:
        assert_same_adaptation(sharded.state_dict, single.state_dict, single.report.batches)
    assert [layer.reset for layer in sharded.report.batchnorm] == [
        layer.reset for layer in single.report.batchnorm
    ]
    assert all(layer.consistent for layer in sharded.report.batchnorm)


def test_sharded_auto_cross_fits_as_one_worker(store: LocalStore, digits: dict[str, Any]) -> None:
    """40 faint digits in batches of 8 hold out 10: the merge of 2 shards runs the folds'
    extra passes itself and chooses as one worker, with the same folds and samples scored."""
    x = (digits["split"].x_test * 0.05).astype(np.float32)
    job = adapt_payload(
        store, digits, x, estimator="auto", seed=2, shards=2, batch_size=8, max_batches=5
    )
    params = job.params
    assert isinstance(params, AdaptParams)
    single = compute(job, store)
    plan = plan_shards(params.estimation_batches(len(x)), 2)
    results = [collect_shard(job, store, shard) for shard in plan]
    sharded = compute_merged(job, store, results)
    got, want = sharded.report.auto, single.report.auto
    assert got is not None and want is not None
    assert (got.folds, got.scored(), got.held_out_samples) == (4, 40, 10)
    assert_same_choice(got, want)
    assert_rule_holds(sharded.report)


def test_sharded_auto_refuses_entropy_and_too_few_batches(
    store: LocalStore, digits: dict[str, Any]
) -> None:
    """entropy is sequential: allow_backward with shards is refused before the job runs (the
    API's 422, tests/e2e/test_shards_e2e.py); the shards split the estimation batches only,
    so the plan counts those, not the job's."""
    with pytest.raises(ValidationError, match="cannot be split across 2 workers"):
        AdaptParams(estimator="auto", shards=2, allow_backward=True)
    params = AdaptParams(estimator="auto", batch_size=64, shards=7)
    assert params.estimation_batches(597) == 7  # of the job's 10 batches
    assert AdaptParams(estimator="precise", batch_size=64).estimation_batches(597) == 10
    assert AdaptParams(estimator="auto", batch_size=64, max_batches=4).estimation_batches(597) == 3
    x = digits["split"].x_test
    job = adapt_payload(store, digits, x, estimator="auto", shards=2)
    with pytest.raises(
        AdaptError, match=re.escape("only 448 samples to estimate on (149 held out)")
    ):
        collect_shard(job, store, ShardPlan(index=1, first_batch=6, batches=2))


@pytest.mark.parametrize("holdout", [None, 0.25])
def test_fixed_estimators_report_diagnostics(
    store: LocalStore, digits: dict[str, Any], holdout: float | None
) -> None:
    """Without a holdout the diagnostics use the samples the estimator used (all of them,
    which it still sees, so its result is as before); with one, the held-out samples."""
    x = (digits["split"].x_test * 0.4 + 0.1).astype(np.float32)
    outcome = run_adapt(store, digits, x, estimator="precise", holdout=holdout)
    found = outcome.report.diagnostics
    assert found is not None and outcome.report.auto is None
    if holdout is None:
        assert not found.held_out and found.samples == len(x)
        assert outcome.report.samples == len(x)
    else:
        assert found.held_out and found.samples == round(0.25 * len(x))
        assert outcome.report.samples == len(x) - found.samples
    assert 0.0 < found.changed_fraction <= 1.0
    assert found.after.mean_max_probability > found.before.mean_max_probability
    assert outcome.report.timings.measure_s > 0.0


def test_measure_batches_bounds_the_diagnostics(store: LocalStore, digits: dict[str, Any]) -> None:
    """The diagnostics are a measurement like the metrics: bounded by measure_batches, and
    timed in measure_s, not in compute_s (the estimation alone)."""
    x = (digits["split"].x_test * 0.4 + 0.1).astype(np.float32)
    outcome = run_adapt(store, digits, x, estimator="precise", measure_batches=2)
    report = outcome.report
    assert report.diagnostics is not None and report.diagnostics.samples == 2 * 64
    assert report.metrics_before is not None and report.metrics_before.num_samples == 2 * 64
    assert report.samples == len(x)  # the estimation still saw every sample
    timings = report.timings
    assert timings.measure_s > 0.0
    assert timings.load_s + timings.compute_s + timings.measure_s <= timings.total_s


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def test_auto_through_the_service(stack: Stack, digits: dict[str, Any]) -> None:
    client = stack.client("tn_auto")
    model = client.add_model("digits_cnn", weights=digits["weights"]).json()
    x = (digits["split"].x_test * 0.2).astype(np.float32)
    dataset = client.add_dataset(npz_bytes(x=x, y=digits["split"].y_test)).json()
    body = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"estimator": "auto", "batch_size": 64},
    }
    job = client.wait(client.submit(body).json()["id"])
    assert job["status"] == "succeeded", job
    report = Report.model_validate(client.http.get(f"/v1/jobs/{job['id']}/report").json())
    assert report.estimator == "auto" and report.auto is not None
    assert_rule_holds(report)
    assert report.diagnostics is not None and report.diagnostics.held_out
    lines = diagnostic_lines(report)
    assert any("<- kept" in line for line in lines)
    assert lines[-1] in ("auto kept the source model unchanged", f"auto chose {report.auto.chosen}")
    json.dumps(report.model_dump(mode="json"))  # plain JSON all the way

    # `bnadapt jobs show` prints the same summary on stderr (stdout stays the job's JSON).
    key = client.http.headers["Authorization"].removeprefix("Bearer ")
    argv = ["--url", stack.url, "--key", key, "jobs", "show", job["id"]]
    shown = subprocess.run(
        [sys.executable, "-m", "service.local.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(shown.stdout)["id"] == job["id"]
    assert shown.stderr.splitlines() == lines
