"""BatchNorm adaptation against the plain computations, bitwise (torch.equal)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn

from workers.errors import AdaptError, JobCanceled
from workers.estimators.base import AdaptStats, select_batchnorm
from workers.estimators.moving_averages import adapt_batchnorm
from workers.models.architectures import build_model, registry
from workers.models.policy import apply_checkpoint_policy

ALL_BN = ["block1.bn", "block2.bn"]


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def digits_cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("digits_cnn", {"width": 4})


def batches(count: int = 5, size: int = 16, last: int = 7) -> list[torch.Tensor]:
    """Shifted, scaled inputs, so adapted statistics differ from the initial ones; the last
    batch is short."""
    gen = torch.Generator().manual_seed(1)
    sizes = [size] * (count - 1) + [last]
    return [torch.rand(n, 1, 8, 8, generator=gen) * 3 + 0.5 for n in sizes]


def wrapped(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    assert apply_checkpoint_policy(twin, registry()["digits_cnn"], "blocks", [], [], False)
    return twin


def hand_written_ema(model: nn.Module, data: list[torch.Tensor]) -> None:
    model.train()
    with torch.no_grad():
        for x in data:
            model(x)


@pytest.mark.parametrize("wrap", [False, True])
def test_cumulative_equals_update_bn(wrap: bool) -> None:
    reference = digits_cnn()
    model = wrapped(reference) if wrap else copy.deepcopy(reference)
    model.eval()
    data = batches()
    update_bn(data, reference)
    stats = adapt_batchnorm(model, data, estimator="cumulative", layers=ALL_BN, reset=False)
    assert stats == AdaptStats(batches=5, samples=4 * 16 + 7)
    assert_same_state(reference, model)
    assert int(model.state_dict()["block1.bn.num_batches_tracked"]) == 5
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert not any(m.training for m in model.modules()), "flags restored (all eval)"


@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("reset", [False, True])
def test_ema_equals_the_hand_written_loop(wrap: bool, reset: bool) -> None:
    reference = digits_cnn()
    hand_written_ema(reference, batches(count=2))  # stats that are not the initial ones
    model = wrapped(reference) if wrap else copy.deepcopy(reference)
    if reset:
        for m in reference.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.reset_running_stats()
    data = batches()
    hand_written_ema(reference, data)
    model.train()
    adapt_batchnorm(model, data, estimator="ema", layers=ALL_BN, reset=reset)
    assert_same_state(reference, model)
    expected = 5 if reset else 7
    assert int(model.state_dict()["block2.bn.num_batches_tracked"]) == expected


def test_checkpointed_model_with_grad_enabled_elsewhere_still_matches() -> None:
    """A wrapped model trained one step (grad on: checkpoint's recomputation runs) and then
    adapted equals its unwrapped twin."""
    plain = digits_cnn()
    twin = wrapped(plain)
    for model in (plain, twin):
        torch.manual_seed(3)
        model.train()
        model(batches(1)[0]).sum().backward()
        adapt_batchnorm(model, batches(), estimator="ema", layers=ALL_BN, reset=False)
    assert_same_state(plain, twin)


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.bn2 = nn.BatchNorm1d(6, momentum=0.3)
        self.sync = nn.SyncBatchNorm(6)
        self.plain = nn.BatchNorm1d(6, track_running_stats=False)
        self.seen: list[tuple[str, bool]] = []
        for name in ("bn1", "drop", "bn2", "sync"):
            getattr(self, name).register_forward_pre_hook(
                lambda m, args, name=name: self.seen.append((name, m.training))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 6)
        return self.plain(self.sync(self.bn2(self.drop(self.bn1(x)))))


def feature_batches(count: int = 3) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return (torch.randn(8, 6, generator=gen) * 2 + 1 for _ in range(count))


def test_selection_patterns_and_kinds() -> None:
    model = WithDropout()
    assert select_batchnorm(model, ["*"], []) == ["bn1", "bn2", "sync"], "no running stats: out"
    assert select_batchnorm(model, ["bn*"], ["bn1"]) == ["bn2"]
    assert select_batchnorm(build_model("resnet", {"depth": 2}), ["blocks.1.*"], ["*.bn1"]) == [
        "blocks.1.bn2",
        "blocks.1.shortcut.1",
    ]
    with pytest.raises(AdaptError, match=r"select none of the layers .*\(bn1, bn2, sync\)"):
        select_batchnorm(model, ["head*"], [])
    with pytest.raises(AdaptError, match="select none"):
        select_batchnorm(model, ["*"], ["*"])


def test_only_selected_layers_run_in_train_mode() -> None:
    model = WithDropout()
    model.train()
    model.drop.eval()  # a flag set on purpose must survive
    before = {k: v.clone() for k, v in model.state_dict().items()}
    progress: list[int] = []
    stats = adapt_batchnorm(
        model,
        feature_batches(),
        estimator="ema",
        layers=["bn2", "sync"],
        reset=True,
        progress=progress.append,
    )
    assert stats == AdaptStats(batches=3, samples=24)
    assert progress == [1, 2, 3]
    assert model.seen[:4] == [("bn1", False), ("drop", False), ("bn2", True), ("sync", True)]
    after = model.state_dict()
    for key in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):
        assert torch.equal(after[key], before[key]), f"unselected {key} kept bit for bit"
    assert (
        int(after["bn2.num_batches_tracked"]) == 3 and int(after["sync.num_batches_tracked"]) == 3
    )
    assert [m.training for m in model.modules()] == [True, True, False, True, True, True]

    # The same by hand: bn1 and Dropout in eval mode, bn2 and sync reset, then trained.
    reference = WithDropout()
    reference.eval()
    for bn in (reference.bn2, reference.sync):
        bn.train()
    with torch.no_grad():
        for x in feature_batches():
            reference(x)
    assert_same_state(reference, model)


def test_flags_and_momenta_are_restored_on_errors() -> None:
    model = digits_cnn()
    model.train()

    def failing() -> Iterator[torch.Tensor]:
        yield batches(1)[0]
        yield torch.rand(2, 3, 8, 8)  # wrong channel count: the conv raises

    with pytest.raises(RuntimeError):
        adapt_batchnorm(model, failing(), estimator="cumulative", layers=ALL_BN, reset=True)
    assert all(m.training for m in model.modules())
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_cancel_between_batches() -> None:
    model = digits_cnn()
    model.eval()
    asked = 0

    def should_stop() -> bool:
        nonlocal asked
        asked += 1
        return asked > 2

    with pytest.raises(JobCanceled, match="after 2 batches"):
        adapt_batchnorm(
            model, batches(), estimator="ema", layers=ALL_BN, reset=False, should_stop=should_stop
        )
    assert int(model.state_dict()["block1.bn.num_batches_tracked"]) == 2
    assert not any(m.training for m in model.modules())


def test_empty_data_and_bad_layers_are_refused() -> None:
    model = digits_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AdaptError, match="no batches to adapt on"):
        adapt_batchnorm(model, [], estimator="cumulative", layers=ALL_BN, reset=True)
    assert_same_state_dict(model, before)
    with pytest.raises(AdaptError, match=r"'block1.conv' is Conv2d, not a BatchNorm layer"):
        adapt_batchnorm(model, batches(), estimator="ema", layers=["block1.conv"], reset=False)
    with pytest.raises(AdaptError, match="'nope' is no module"):
        adapt_batchnorm(model, batches(), estimator="ema", layers=["nope"], reset=False)
    with pytest.raises(AdaptError, match="no layers to adapt"):
        adapt_batchnorm(model, batches(), estimator="ema", layers=[], reset=False)
    with pytest.raises(AdaptError, match="unknown estimator 'precise'"):
        adapt_batchnorm(model, batches(), estimator="precise", layers=ALL_BN, reset=False)
    assert_same_state_dict(model, before)


def assert_same_state_dict(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(expected)
    assert all(torch.equal(state[k], expected[k]) for k in state)
