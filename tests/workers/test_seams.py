"""The architecture's seams: the estimator and job-kind tables are what every part reads, jobs
enqueued under the dotted paths of earlier releases still run, and a new estimator costs its
module plus one row (``ema_momentum``, added that way)."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from rq import Queue
from torch import nn

import workers.jobs
import workers.shard_jobs
from api_schemas import (
    ESTIMATORS,
    JOB_KINDS,
    AdaptParams,
    JobPayload,
    JobPublic,
    JobStatus,
    new_id,
    utc_now,
)
from service.local.cli import _parser as build_parser
from tests.stack import Stack, job_payload, npz_bytes
from workers.estimators.dispatch import load_runner, run_estimator
from workers.estimators.moving_averages import adapt_batchnorm
from workers.passes.hooks import NoHooks
from workers.sharding import jobs as sharding_jobs


def test_every_runner_of_both_tables_resolves() -> None:
    for name, spec in ESTIMATORS.items():
        assert callable(load_runner(spec.runner)), name
    for kind, kind_spec in JOB_KINDS.items():
        module, _, function = kind_spec.runner.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), kind


def test_schema_reads_the_estimator_table() -> None:
    assert AdaptParams.model_json_schema()["properties"]["estimator"]["enum"] == list(ESTIMATORS)
    with pytest.raises(ValidationError, match="Input should be 'ema'"):
        AdaptParams(estimator="nope")
    for name, spec in ESTIMATORS.items():
        assert AdaptParams(estimator=name).effective_reset() is spec.resets
        if spec.sharding is None:
            with pytest.raises(ValidationError, match=spec.sequential_reason):
                AdaptParams(estimator=name, shards=2)
        else:
            assert AdaptParams(estimator=name, shards=2).shards == 2


def test_cli_offers_the_tables() -> None:
    parser = build_parser()
    args = parser.parse_args(["jobs", "submit", "evaluate", "--model", "m", "--dataset", "d"])
    assert args.kind == "evaluate"
    with pytest.raises(SystemExit):
        parser.parse_args(["jobs", "submit", "nope", "--model", "m", "--dataset", "d"])


def test_old_shard_entry_points_are_the_new_functions() -> None:
    for name in ("run_shard", "run_merge", "run_eval", "run_finish"):
        assert getattr(workers.shard_jobs, name) is getattr(sharding_jobs, name)
        assert f"workers.sharding.jobs.{name}" in {
            sharding_jobs.SHARD_FUNCTION,
            sharding_jobs.MERGE_FUNCTION,
            sharding_jobs.EVAL_FUNCTION,
            sharding_jobs.FINISH_FUNCTION,
        }


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def test_ema_momentum_is_the_ema_loop_with_the_jobs_momentum() -> None:
    x = torch.randn(40, 4) * 3 + 1
    model = _bn_model()
    expected = copy.deepcopy(model)
    run_estimator(
        model,
        AdaptParams(estimator="ema_momentum", momentum=0.5, batch_size=8),
        ["1"],
        NoHooks(),
        x=x,
        reset=False,
        device=torch.device("cpu"),
    )
    # By hand: the train-mode loop with momentum 0.5, the layer's momentum put back after.
    bn = expected[1]
    assert isinstance(bn, nn.BatchNorm1d)
    bn.momentum = 0.5
    expected.train()
    with torch.no_grad():
        for batch in x.split(8):
            expected(batch)
    bn.momentum = 0.1
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model[1].momentum == 0.1
    # And not what the layers' own momentum gives.
    own = _bn_model()
    adapt_batchnorm(own, x.split(8), estimator="ema", layers=["1"], reset=False)
    assert not torch.equal(own[1].running_mean, model[1].running_mean)


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


@pytest.mark.slow
def test_a_job_enqueued_under_the_old_path_runs(stack: Stack) -> None:
    """A job an earlier release enqueued (RQ function ``workers.jobs.run_job``, a payload
    without the dataset facts) runs on today's worker."""
    client = stack.client("t-old")
    model = client.add_model("mlp", {"in_features": 4, "hidden": 8, "num_classes": 2})
    assert model.status_code == 201, model.text
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    dataset = client.add_dataset(npz_bytes(x=x))
    assert dataset.status_code == 201, dataset.text
    body = {
        "kind": "adapt",
        "model_id": model.json()["id"],
        "dataset_id": dataset.json()["id"],
        "params": {"estimator": "ema_momentum", "momentum": 0.3, "batch_size": 8},
    }
    submitted = client.submit(body)
    assert submitted.status_code == 202, submitted.text
    assert client.wait(submitted.json()["id"])["status"] == "succeeded"

    new = job_payload(stack, submitted.json()["id"]).model_dump(mode="json")
    old: dict[str, Any] = {**new, "job_id": new_id("job")}
    old["dataset"] = {k: new["dataset"][k] for k in ("id", "sha256", "format")}
    old["params"] = {**new["params"], "estimator": "cumulative"}
    payload = JobPayload.model_validate(old)
    assert payload.dataset.num_samples is None
    job = JobPublic(
        id=payload.job_id,
        kind="adapt",
        status=JobStatus.QUEUED,
        model_id=payload.model.id,
        dataset_id=payload.dataset.id,
        params=payload.params,
        created_at=utc_now(),
    )
    records = stack.records()
    queue = Queue("bnadapt", connection=records.client, serializer="json")
    assert workers.jobs.run_job.__module__ == "workers.running.job"
    records.create_job(
        payload.tenant_id,
        job,
        payload,
        enqueue=lambda pipe: queue.enqueue_call(
            "workers.jobs.run_job", args=(old,), job_id=job.id, pipeline=pipe
        ),
    )
    finished = client.wait(job.id)
    assert finished["status"] == "succeeded", finished
    assert finished["result"]["model_id"] is not None
