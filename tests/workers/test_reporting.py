"""Report figures against hand computations, and the stat-consistency facts after a job."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from torch import nn

from workers.estimators.base import select_batchnorm
from workers.estimators.moving_averages import adapt_batchnorm
from workers.models.architectures import batchnorm_layers, build_model, registry
from workers.models.policy import apply_checkpoint_policy
from workers.running.reporting import (
    BatchNormChange,
    TensorChange,
    batchnorm_changes,
    state_snapshot,
    tensor_changes,
)


def test_snapshot_is_a_copy() -> None:
    model = nn.BatchNorm1d(3)
    snapshot = state_snapshot(model)
    model(torch.randn(4, 3))
    assert list(snapshot) == list(model.state_dict())
    assert torch.equal(snapshot["running_mean"], torch.zeros(3))
    assert int(snapshot["num_batches_tracked"]) == 0
    assert int(model.num_batches_tracked) == 1


def test_tensor_changes_by_hand() -> None:
    before = {
        "w": torch.tensor([3.0, 4.0]),
        "same": torch.tensor([1.0, -0.0]),
        "zero": torch.zeros(2),
        "count": torch.tensor(5),
        "empty": torch.zeros(0),
    }
    after = {
        "w": torch.tensor([3.0, 4.5]),
        "same": torch.tensor([1.0, -0.0]),
        "zero": torch.tensor([0.0, 1e-3]),
        "count": torch.tensor(8),
        "empty": torch.zeros(0),
    }
    changes = {c.name: c for c in tensor_changes(before, after)}
    assert list(changes) == list(before)
    assert changes["w"] == TensorChange("w", True, 0.5, 0.5 / 5.0, 0.5)
    assert changes["same"] == TensorChange("same", False, 0.0, 0.0, 0.0)
    # A counter: no relative change, its plain values (NOTE [ Relative change from a zero
    # baseline ]); a fresh model's num_batches_tracked once showed relative_l2 2.5e39.
    assert changes["count"] == TensorChange("count", True, 3.0, None, 3.0, 5.0, 8.0)
    assert changes["empty"] == TensorChange("empty", False, 0.0, 0.0, 0.0)
    zero = changes["zero"]
    assert zero.changed and zero.max_abs == pytest.approx(1e-3)
    # From a zero baseline (a fresh running_mean: once 7.9e37): no relative change, the
    # absolute one.
    assert zero.relative_l2 is None and zero.l2 == pytest.approx(1e-3)
    with pytest.raises(ValueError, match=r"only before \['w'\]"):
        tensor_changes(before, {k: v for k, v in after.items() if k != "w"})


def test_batchnorm_changes_by_hand() -> None:
    before = {
        "bn.running_mean": torch.tensor([0.0, 1.0]),
        "bn.running_var": torch.tensor([1.0, 0.0]),
        "bn.num_batches_tracked": torch.tensor(3),
        "frozen.running_mean": torch.tensor([2.0]),
        "frozen.running_var": torch.tensor([4.0]),
        "frozen.num_batches_tracked": torch.tensor(9),
    }
    after = dict(before) | {
        "bn.running_mean": torch.tensor([0.5, 0.0]),
        "bn.running_var": torch.tensor([3.0, 0.0]),
        "bn.num_batches_tracked": torch.tensor(7),
    }
    changes = batchnorm_changes(before, after, ["bn", "frozen", "untracked"], {"bn"}, 4)
    assert changes == [
        BatchNormChange("bn", True, 0.75, (3.0 + 1.0) / 2, 3, 7, 4),
        BatchNormChange("frozen", False, 0.0, 1.0, 9, 9, 0),
    ]
    assert set(asdict(changes[0])) == {
        "name",
        "adapted",
        "running_mean_mean_abs_shift",
        "running_var_mean_ratio",
        "num_batches_tracked_before",
        "num_batches_tracked_after",
        "batches_run",
        "reset",
    }


@pytest.mark.parametrize(("estimator", "reset"), [("ema", False), ("cumulative", True)])
def test_report_after_adaptation_of_a_checkpointed_model(estimator: str, reset: bool) -> None:
    torch.manual_seed(0)
    model = build_model("resnet", {"depth": 2, "width": 4})
    apply_checkpoint_policy(model, registry()["resnet"], "blocks", [], [], False)
    names = [layer["name"] for layer in batchnorm_layers(model)]
    layers = select_batchnorm(model, ["blocks.*"], [])
    before = state_snapshot(model)
    data = [torch.rand(8, 3, 6, 6) * 2 for _ in range(3)]
    stats = adapt_batchnorm(model, data, estimator=estimator, layers=layers, reset=reset)
    after = state_snapshot(model)

    changes = batchnorm_changes(before, after, names, set(layers), stats.batches)
    assert [c.name for c in changes] == names
    for change in changes:
        added = change.num_batches_tracked_after - change.num_batches_tracked_before
        assert added == change.batches_run == (3 if change.adapted else 0)
        assert (change.running_mean_mean_abs_shift > 0) == change.adapted
        assert (change.running_var_mean_ratio != 1.0) == change.adapted
    tensors = {c.name: c for c in tensor_changes(before, after)}
    assert list(tensors) == list(model.state_dict())
    assert not tensors["stem.bn.running_mean"].changed
    assert tensors["blocks.0.bn1.running_mean"].changed
    assert not any(c.changed for name, c in tensors.items() if name.endswith(("weight", "bias")))
