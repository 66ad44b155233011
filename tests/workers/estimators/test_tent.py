"""The entropy (TENT) estimator against the hand-written loop, with and without checkpointing,
and every estimator through the job's computation (compute), bitwise where claimed."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from api_schemas import ESTIMATOR_NAMES, JobPayload
from harness.stack import npz_bytes
from service.store.local import LocalStore
from workers.errors import AdaptError, JobCanceled
from workers.estimators.base import AdaptStats, select_batchnorm
from workers.estimators.entropy import SGD_MOMENTUM, entropy_adapt, entropy_loss
from workers.estimators.precise import layerwise_precise_batchnorm
from workers.kinds.changing import compute
from workers.models.architectures import build_model, registry
from workers.models.policy import apply_checkpoint_policy
from workers.running.saving import weights_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def resnet() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("resnet", {"depth": 2, "width": 4})
    model.eval()
    return model


def wrapped(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    assert apply_checkpoint_policy(twin, registry()["resnet"], "blocks", [], [], False)
    return twin


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.rand(n, 3, 8, 8, generator=gen) * 3 + 0.5 for n in (16, 16, 5)]


def record_outputs(model: nn.Module) -> list[torch.Tensor]:
    outputs: list[torch.Tensor] = []
    model.register_forward_hook(lambda m, args, out: outputs.append(out.detach().clone()))
    return outputs


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def hand_written_tent(
    model: nn.Module, data: list[torch.Tensor], layers: list[str], steps: int, optimizer: str
) -> None:
    modules = dict(model.named_modules())
    bns = [modules[name] for name in layers]
    params = [p for bn in bns for p in (bn.weight, bn.bias)]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(params, lr=0.05)
    )
    model.eval()
    for bn in bns:
        bn.train()
    for step in range(steps):
        logits = model(data[step % len(data)])
        p = logits.softmax(dim=1)
        loss = -(p * logits.log_softmax(dim=1)).sum(dim=1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    model.eval()


LAYERS = ["blocks.0.bn1", "blocks.0.bn2", "blocks.1.bn1", "blocks.1.bn2", "blocks.1.shortcut.1"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_entropy_equals_the_hand_written_loop(optimizer: str) -> None:
    assert SGD_MOMENTUM == 0.9
    reference = resnet()
    model = copy.deepcopy(reference)
    steps = 7  # more than the batches: the data is cycled
    hand_written_tent(reference, batches(), LAYERS, steps, optimizer)
    stats = entropy_adapt(
        model,
        batches(),
        layers=LAYERS,
        lr=0.05,
        steps=steps,
        optimizer=optimizer,  # type: ignore[arg-type]
    )
    assert stats == AdaptStats(batches=7, samples=16 + 16 + 5 + 16 + 16 + 5 + 16)
    assert_same_state(reference, model)
    assert all(p.requires_grad and p.grad is None for p in model.parameters()), "restored"
    assert not any(m.training for m in model.modules()), "flags restored"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_checkpointing_changes_nothing(optimizer: str) -> None:
    """Statistics, affine parameters and every step's outputs bitwise as without checkpointing;
    the recomputation updates no running statistics a second time."""
    plain = resnet()
    twin = wrapped(plain)
    outputs = [record_outputs(plain), record_outputs(twin)]
    for model in (plain, twin):
        entropy_adapt(model, batches(), layers=LAYERS, lr=0.05, steps=5, optimizer=optimizer)  # type: ignore[arg-type]
    assert len(outputs[0]) == len(outputs[1]) == 5
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)
    assert_same_state(plain, twin)
    assert int(twin.state_dict()["blocks.0.bn1.num_batches_tracked"]) == 5
    x = batches()[2]
    with torch.no_grad():
        assert torch.equal(plain(x), twin(x)), "eval outputs after adaptation"


def test_only_selected_affine_parameters_and_statistics_change() -> None:
    model = resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = select_batchnorm(model, ["blocks.*"], ["blocks.1.shortcut.*"])
    progress: list[int] = []
    stats = entropy_adapt(model, batches(), layers=layers, lr=0.05, progress=progress.append)
    assert stats == AdaptStats(batches=3, samples=37), "steps=None: one pass"
    assert progress == [1, 2, 3]
    after = model.state_dict()
    for key, value in before.items():
        layer, _, field = key.rpartition(".")
        changed = not torch.equal(after[key], value)
        if layer in layers and field != "num_batches_tracked":
            assert changed, key
        elif layer in layers:
            assert int(after[key]) == int(value) + 3, "one update per step, no reset"
        else:
            assert not changed, key


def test_reset_and_dropout_stay_as_asked() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(6)
            self.drop = nn.Dropout(0.5)
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 6) -> (B, 3)
            return self.fc(self.drop(self.bn(x)))

    torch.manual_seed(0)
    model = Head()
    model.bn.num_batches_tracked.fill_(100)
    data = [torch.randn(8, 6) + 2 for _ in range(2)]
    twin = copy.deepcopy(model)
    entropy_adapt(model, data, layers=["bn"], lr=0.1, steps=3, reset=True, optimizer="sgd")
    entropy_adapt(twin, data, layers=["bn"], lr=0.1, steps=3, reset=True, optimizer="sgd")
    assert_same_state(model, twin)  # Dropout in eval mode: nothing random
    assert int(model.bn.num_batches_tracked) == 3


def test_refusals() -> None:
    model = resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AdaptError, match="no batches to adapt on"):
        entropy_adapt(model, [], layers=LAYERS, lr=0.1)
    with pytest.raises(AdaptError, match="no layers to adapt"):
        entropy_adapt(model, batches(), layers=[], lr=0.1)
    with pytest.raises(AdaptError, match="learning rate must be > 0"):
        entropy_adapt(model, batches(), layers=LAYERS, lr=0.0)
    with pytest.raises(AdaptError, match="steps must be >= 1"):
        entropy_adapt(model, batches(), layers=LAYERS, lr=0.1, steps=0)
    with pytest.raises(JobCanceled, match="after 0 steps"):
        entropy_adapt(model, batches(), layers=LAYERS, lr=0.1, should_stop=lambda: True)
    no_affine = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, affine=False))
    with pytest.raises(AdaptError, match="has affine parameters"):
        entropy_adapt(no_affine, [torch.randn(4, 4)], layers=["1"], lr=0.1)
    features = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Flatten(0))
    with pytest.raises(AdaptError, match=r"class logits .* gives \(12,\)"):
        entropy_adapt(features, [torch.randn(4, 4)], layers=["1"], lr=0.1)
    assert_same_state_dict(model, before)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


def assert_same_state_dict(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_entropy_loss() -> None:
    logits = torch.tensor([[0.0, 0.0], [100.0, 0.0]])
    torch.testing.assert_close(entropy_loss(logits), torch.tensor(np.log(2) / 2, dtype=torch.float))


# --- through compute ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "layerwise"), [(name, False) for name in ESTIMATOR_NAMES] + [("precise", True)]
)
def test_every_estimator_through_compute(tmp_path: Path, estimator: str, layerwise: bool) -> None:
    """The job's computation with the blocks checkpointed: a consistent report for every
    BatchNorm layer, and for entropy nothing changed but BN affine parameters and buffers;
    layerwise precise gives bitwise what the function gives on the unwrapped model."""
    store = LocalStore(tmp_path / "store")
    source = resnet()
    weights = store.put_bytes(weights_bytes(source.state_dict()))
    gen = np.random.default_rng(0)
    x = (gen.random((50, 3, 8, 8)) * 2 + 0.3).astype(np.float32)
    y = gen.integers(0, 10, size=50)
    dataset = store.put_bytes(npz_bytes(x=x, y=y))
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
            "params": {
                "estimator": estimator,
                "batch_size": 16,
                "exclude": ["stem.*"],
                "steps": 6,
                "lr": 0.01,
                "device": "cpu",
                "layerwise": layerwise,
            },
        }
    )
    outcome = compute(payload, store)
    report = outcome.report
    if layerwise:
        layers = [name for name in select_batchnorm(source, ["*"], []) if "stem" not in name]
        batches = list(torch.from_numpy(x).split(16))
        layerwise_precise_batchnorm(source, lambda: batches, layers=layers)
        assert_same_state_dict(source, outcome.state_dict)
    expected_batches = 6 if estimator == "entropy" else 4
    reset = estimator in ("cumulative", "precise", "prior")
    changes = estimator != "auto" or (report.auto is not None and not report.auto.kept_source)
    if estimator == "auto":  # what it kept: the source, or precise/prior on 38 of the 50
        assert report.auto is not None
        expected_batches = 0 if report.auto.kept_source else 3
        reset = not report.auto.kept_source
    assert report.estimator == estimator
    assert report.batches == expected_batches
    for layer in report.batchnorm:
        assert layer.consistent, layer
        assert layer.adapted == (not layer.name.startswith("stem."))
        assert layer.reset == (reset and layer.adapted)
        assert layer.batches_run == (expected_batches if layer.adapted else 0)
    bn_names = {layer.name for layer in report.batchnorm}
    for tensor in report.tensors:
        layer, _, field = tensor.name.rpartition(".")
        adapted = layer in bn_names and not layer.startswith("stem.")
        affine = field in ("weight", "bias")
        expected = changes and adapted and (estimator == "entropy" or not affine)
        assert tensor.changed == expected, tensor
