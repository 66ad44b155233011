"""Every normalization layer's stated behaviour (issue 28, point 3) without the zoo: entropy
trains LayerNorm and GroupNorm affine parameters besides BatchNorm's, the report lists them
and what the checkpoint policy wrapped, and running-statistics estimators are refused at
submission for a model that keeps none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from api_schemas import (
    ESTIMATOR_NAMES,
    AdaptJobCreate,
    AdaptParams,
    JobPayload,
    ModelPublic,
    utc_now,
)
from harness.stack import npz_bytes
from service.errors import InvalidRequestError
from service.jobs.submission import check_running_statistics
from service.store.local import LocalStore
from workers.estimators.base import select_affine_norms, select_batchnorm
from workers.estimators.dispatch import run_estimator
from workers.estimators.entropy import entropy_adapt
from workers.kinds.changing import compute
from workers.models.architectures import build_model
from workers.passes.data import Samples
from workers.passes.hooks import NoHooks
from workers.running.saving import weights_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Mixed(nn.Module):
    """BatchNorm, LayerNorm and GroupNorm in one model: (B, 4) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.ln = nn.LayerNorm(6)
        self.gn = nn.GroupNorm(2, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gn(self.ln(self.bn(self.fc1(x)))))


def changed_keys(before: dict[str, torch.Tensor], model: nn.Module) -> set[str]:
    after = model.state_dict()
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_entropy_trains_the_affine_parameters_of_every_selected_norm() -> None:
    torch.manual_seed(0)
    model = Mixed()
    assert select_batchnorm(model, ["*"], []) == ["bn"]
    assert select_affine_norms(model, ["*"], []) == ["ln", "gn"]
    assert select_affine_norms(model, ["*"], ["gn"]) == ["ln"]
    batches = [torch.randn(8, 4) for _ in range(2)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    entropy_adapt(model, batches, layers=["bn"], affine_layers=["ln", "gn"], lr=0.05)
    assert changed_keys(before, model) == {
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
        "ln.weight",
        "ln.bias",
        "gn.weight",
        "gn.bias",
    }
    # TENT's choice (affine_norms "batchnorm"): the BatchNorm layer alone.
    torch.manual_seed(0)
    tent = Mixed()
    before = {k: v.clone() for k, v in tent.state_dict().items()}
    entropy_adapt(tent, batches, layers=["bn"], lr=0.05)
    assert not any(k.startswith(("ln.", "gn.")) for k in changed_keys(before, tent))
    # A model with LayerNorm only: no BatchNorm layer is needed.
    norm_only = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    before = {k: v.clone() for k, v in norm_only.state_dict().items()}
    entropy_adapt(norm_only, batches, layers=[], affine_layers=["1"], lr=0.05)
    assert changed_keys(before, norm_only) == {"1.weight", "1.bias"}


def payload_for(tmp_path: Path, estimator: str) -> tuple[JobPayload, LocalStore]:
    store = LocalStore(tmp_path / "store")
    torch.manual_seed(0)
    source = build_model("resnet", {"depth": 2, "width": 4})
    weights = store.put_bytes(weights_bytes(source.state_dict()))
    x = np.random.default_rng(0).random((32, 3, 8, 8)).astype(np.float32)
    dataset = store.put_bytes(npz_bytes(x=x))
    payload = JobPayload.model_validate(
        {
            "job_id": "job_x",
            "tenant_id": "tn_1",
            "kind": "adapt",
            "model": {
                "id": "mdl_a",
                "architecture": "resnet",
                "kwargs": {"depth": 2, "width": 4},
                "weights_sha256": weights,
            },
            "dataset": {"id": "ds_b", "sha256": dataset, "format": "npz"},
            "params": {"estimator": estimator, "batch_size": 16, "device": "cpu", "lr": 0.01},
        }
    )
    return payload, store


def test_report_says_what_was_checkpointed_and_which_affine_parameters_changed(
    tmp_path: Path,
) -> None:
    payload, store = payload_for(tmp_path, "entropy")
    report = compute(payload, store).report
    assert report.checkpoint is not None
    assert report.checkpoint.preset == "blocks" and report.checkpoint.blocks_rule == "block_types"
    assert report.checkpoint.modules == ["blocks.0", "blocks.1"]
    assert report.checkpoint.wrapped == 2 and report.checkpoint.note is None
    assert report.frozen_norms == []
    bn = [layer.name for layer in report.batchnorm]
    assert [a.name for a in report.affine] == bn
    assert all(
        a.kind == "BatchNorm2d" and a.parameters == ["weight", "bias"] for a in report.affine
    )
    assert all(a.changed and a.max_abs > 0 for a in report.affine)
    # A forward-only estimator trains no affine parameters.
    payload, store = payload_for(tmp_path, "precise")
    assert compute(payload, store).report.affine == []


def model_record(batchnorm: list[dict[str, object]]) -> ModelPublic:
    return ModelPublic(
        id="mdl_1",
        architecture="timm.vit_tiny_patch16_224",
        kwargs={},
        sha256="0" * 64,
        size_bytes=1,
        parameter_count=1,
        batchnorm_layers=batchnorm,
        input_shape=[3, 224, 224],
        source="upload",
        created_at=utc_now(),
    )


def adapt(estimator: str) -> AdaptJobCreate:
    return AdaptJobCreate.model_validate(
        {
            "kind": "adapt",
            "model_id": "mdl_1",
            "dataset_id": "ds_1",
            "params": {"estimator": estimator},
        }
    )


@pytest.mark.parametrize("estimator", ["cumulative", "precise", "ema", "prior", "auto"])
def test_running_statistics_estimators_need_a_layer_that_keeps_them(estimator: str) -> None:
    no_statistics = model_record([])
    with pytest.raises(InvalidRequestError) as refused:
        check_running_statistics(adapt(estimator), no_statistics)
    assert refused.value.status == 422
    assert "'entropy'" in str(refused.value) and estimator in str(refused.value)
    # A BatchNorm layer without running statistics does not count either.
    untracked = {
        "name": "bn",
        "kind": "BatchNorm2d",
        "num_features": 3,
        "momentum": 0.1,
        "track_running_stats": False,
    }
    with pytest.raises(InvalidRequestError):
        check_running_statistics(adapt(estimator), model_record([untracked]))
    check_running_statistics(
        adapt(estimator), model_record([{**untracked, "track_running_stats": True}])
    )
    check_running_statistics(adapt("entropy"), no_statistics)  # trains affine parameters


class EveryBatchNorm(nn.Module):
    """BatchNorm1d, 2d, 3d and SyncBatchNorm (in one process: plain BatchNorm) in one model:
    (B, 2, 4, 4) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn2d = nn.BatchNorm2d(2)
        self.sync = nn.SyncBatchNorm(2)
        self.bn3d = nn.BatchNorm3d(2)
        self.fc = nn.Linear(32, 6)
        self.bn1d = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.sync(self.bn2d(x))  # (B, 2, 4, 4)
        x = self.bn3d(x[:, :, None]).flatten(1)  # (B, 32)
        return self.head(self.bn1d(self.fc(x)))


@pytest.mark.parametrize("estimator", [n for n in ESTIMATOR_NAMES if n != "auto"])
def test_every_estimator_adapts_every_batchnorm_kind(estimator: str) -> None:
    torch.manual_seed(0)
    model = EveryBatchNorm().eval()
    layers = select_batchnorm(model, ["*"], [])
    assert layers == ["bn2d", "sync", "bn3d", "bn1d"]
    x = np.random.default_rng(0).standard_normal((16, 2, 4, 4)).astype(np.float32) + 1.0
    params = AdaptParams(estimator=estimator, batch_size=8, lr=0.01)
    reset = params.effective_reset()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run_estimator(
        model, params, layers, NoHooks(), x=Samples(x), reset=reset, device=torch.device("cpu")
    )
    changed = changed_keys(before, model)
    for layer in layers:
        assert f"{layer}.running_mean" in changed and f"{layer}.running_var" in changed, layer
