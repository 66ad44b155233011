"""The architecture's seams: the estimator and job-kind tables are what every part reads, and a
new estimator costs its module plus one row (``ema_momentum``, added that way)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from api_schemas import (
    ESTIMATORS,
    JOB_KINDS,
    AdaptParams,
)
from harness.stack import Stack
from service.local.cli import _parser as build_parser
from workers.estimators.dispatch import load_runner, run_estimator
from workers.estimators.moving_averages import adapt_batchnorm
from workers.passes.hooks import NoHooks


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
