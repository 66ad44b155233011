"""The precise and prior estimators against the plain computations.

``precise`` is checked against the mean and unbiased variance of all of a layer's input
activations, concatenated and reduced directly in float64; ``prior`` against its base
estimator and the mixing formula written out.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from workers.errors import AdaptError, JobCanceled
from workers.estimators.base import AdaptStats, select_batchnorm
from workers.estimators.layer_statistics import LayerStatistics
from workers.estimators.moving_averages import adapt_batchnorm
from workers.estimators.precise import (
    apply_statistics,
    collect_statistics,
    layerwise_precise_batchnorm,
    precise_batchnorm,
)
from workers.estimators.prior import mix_statistics, prior_batchnorm
from workers.models.architectures import build_model, registry
from workers.models.policy import apply_checkpoint_policy
from workers.sharding.compute import StatisticsMessage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SAMPLES = 131  # every split below leaves a short last batch


def resnet() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("resnet", {"depth": 3, "width": 4})
    model.eval()
    return model


def data(samples: int = SAMPLES) -> torch.Tensor:
    """Shifted, scaled images (N, 3, 8, 8), so the statistics move away from the initial ones."""
    gen = torch.Generator().manual_seed(1)
    return torch.rand(samples, 3, 8, 8, generator=gen) * 3 + 0.5


def split(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(x.split(size))


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    found = model.state_dict()
    assert list(found) == list(expected)
    for key in found:
        assert torch.equal(found[key], expected[key]), key


def direct_statistics(
    model: nn.Module, batches: list[torch.Tensor], layers: list[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: mean and unbiased variance (float64) of all its inputs concatenated, from a
    pass with the selected layers in train mode (batch statistics) and the rest in eval."""
    twin = copy.deepcopy(model)
    modules = dict(twin.named_modules())
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    for name in layers:
        modules[name].register_forward_pre_hook(
            lambda m, args, name=name: inputs[name].append(args[0].detach().clone())
        )
    twin.eval()
    for name in layers:
        modules[name].train()
    with torch.no_grad():
        for x in batches:
            twin(x)
    found = {}
    for name, seen in inputs.items():
        # (B, C, ...) -> (C, B * ...) per batch, then all batches side by side
        flat = torch.cat([t.transpose(0, 1).reshape(t.shape[1], -1) for t in seen], dim=1)
        flat = flat.double()
        found[name] = (flat.mean(dim=1), flat.var(dim=1, correction=1))
    return found


def assert_close_relative(found: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> None:
    """|found - expected| <= 1e-6 * scale, per channel."""
    error = (found.double() - expected).abs()
    assert bool((error <= 1e-6 * scale).all()), (error / scale).max().item()


def assert_precise(
    model: nn.Module, expected: dict[str, tuple[torch.Tensor, torch.Tensor]], batches: int
) -> None:
    modules = dict(model.named_modules())
    for name, (mean, var) in expected.items():
        bn = modules[name]
        assert isinstance(bn, _BatchNorm)
        assert bn.running_mean is not None
        assert bn.running_var is not None
        # A mean near 0 has no relative precision to speak of: scale by the spread too.
        assert_close_relative(bn.running_mean, mean, mean.abs() + var.sqrt())
        assert_close_relative(bn.running_var, var, var)
        assert int(model.state_dict()[f"{name}.num_batches_tracked"]) == batches


ALL = select_batchnorm(resnet(), ["*"], [])


def test_precise_equals_all_activations_concatenated() -> None:
    model = resnet()
    batches = split(data(), 32)
    expected = direct_statistics(model, batches, ALL)
    stats = precise_batchnorm(model, batches, layers=ALL)
    assert stats == AdaptStats(batches=5, samples=SAMPLES)
    assert_precise(model, expected, 5)
    assert not any(m.training for m in model.modules()), "flags restored"
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, _BatchNorm))


@pytest.mark.parametrize("size", [2, 3, 8, 32, 64])
def test_precise_equals_the_concatenation_for_every_split(size: int) -> None:
    x = data()
    model = resnet()
    batches = split(x, size)
    assert batches[-1].shape[0] < size, "a short last batch"
    precise_batchnorm(model, batches, layers=ALL)
    assert_precise(model, direct_statistics(resnet(), batches, ALL), math.ceil(SAMPLES / size))


@pytest.mark.parametrize("layer", ["stem.bn", "blocks.2.bn2"])
def test_precise_does_not_depend_on_the_batch_split(layer: str) -> None:
    """One selected layer, the layers upstream in eval mode: its inputs are the same whatever
    the split, and so are its statistics, to 1e-6 of the one-batch reference. (With several
    layers selected, a layer's inputs depend on the batch statistics of the selected layers
    upstream, hence on the split; see NOTE [ Precise statistics ].)"""
    x = data()
    expected = direct_statistics(resnet(), [x], [layer])
    for size in (2, 3, 8, 32, 64):
        model = resnet()
        before = state(model)
        precise_batchnorm(model, split(x, size), layers=[layer])
        assert_precise(model, expected, math.ceil(SAMPLES / size))
        after = model.state_dict()
        for key in before:
            if not key.startswith(f"{layer}."):
                assert torch.equal(after[key], before[key]), key


def layerwise_reference(x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer in forward order: the statistics of all its inputs concatenated, computed
    directly with the layers before it already holding theirs (written, in eval mode)."""
    model = resnet()
    modules = dict(model.named_modules())
    expected = {}
    for name in ALL:  # registration order is the forward order in this architecture
        mean, var = direct_statistics(model, [x], [name])[name]
        bn = modules[name]
        assert isinstance(bn, _BatchNorm)
        with torch.no_grad():
            bn.running_mean.copy_(mean)  # type: ignore[union-attr]
            bn.running_var.copy_(var)  # type: ignore[union-attr]
        expected[name] = (mean, var)
    return expected


def test_layerwise_precise_equals_the_direct_computation_for_every_split() -> None:
    """All layers at once, and still independent of the split (to 1e-6): each layer's input
    comes from the layers before it in eval mode with their new statistics."""
    x = data()
    expected = layerwise_reference(x)
    for size in (2, 3, 8, 32, 64):
        model = resnet()
        passes: list[int] = []
        stats = layerwise_precise_batchnorm(
            model, lambda size=size: split(x, size), layers=ALL, progress=passes.append
        )
        batches = math.ceil(SAMPLES / size)
        assert stats == AdaptStats(batches=batches, samples=SAMPLES)
        assert passes[-1] == batches * len(ALL), "progress counts every pass"
        assert_precise(model, expected, batches)


def test_one_pass_precise_depends_on_the_split_where_layerwise_does_not() -> None:
    """Why ``layerwise`` exists: with every layer estimated in one pass, layers below the first
    see inputs normalized with batch statistics, which depend on the batch size."""
    x = data()
    one_pass = {}
    for size in (2, SAMPLES):
        model = resnet()
        precise_batchnorm(model, split(x, size), layers=ALL)
        one_pass[size] = model.state_dict()["blocks.2.bn2.running_var"]
    relative = ((one_pass[2] - one_pass[SAMPLES]).abs() / one_pass[SAMPLES]).max().item()
    assert relative > 1e-4


class WithSpareLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = resnet()
        self.spare = nn.BatchNorm2d(4)  # registered, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def test_layerwise_refuses_layers_the_forward_never_reaches() -> None:
    model = WithSpareLayer()
    with pytest.raises(AdaptError, match=r"\['spare'\] received no input"):
        layerwise_precise_batchnorm(
            model, lambda: split(data(), 32), layers=["net.stem.bn", "spare"]
        )
    with pytest.raises(AdaptError, match="no batches"):
        layerwise_precise_batchnorm(model, list, layers=["net.stem.bn"])


def test_wrapped_model_gives_the_same_statistics() -> None:
    model = resnet()
    twin = copy.deepcopy(model)
    assert apply_checkpoint_policy(twin, registry()["resnet"], "blocks", [], [], False)
    batches = split(data(), 32)
    precise_batchnorm(model, batches, layers=ALL)
    precise_batchnorm(twin, batches, layers=ALL)
    assert_same_state(twin, state(model))


def test_collect_leaves_the_model_unchanged_and_shards_merge() -> None:
    model = resnet()
    before = state(model)
    buffers = [id(b) for b in model.buffers()]
    x = data()
    whole = collect_statistics(model, split(x, 32), layers=ALL)
    assert_same_state(model, before)
    assert [id(b) for b in model.buffers()] == buffers, "the buffers are the same objects"

    # Two shards, sent as JSON, merged: the statistics of all the data.
    shards = [collect_statistics(model, split(part, 32), layers=ALL) for part in (x[:64], x[64:])]
    received = [
        {
            k: StatisticsMessage.model_validate_json(
                StatisticsMessage.of(v).model_dump_json()
            ).statistics()
            for k, v in shard.items()
        }
        for shard in shards
    ]
    for name in ALL:
        merged = received[0][name].merge(received[1][name])
        assert merged.count == whole[name].count
        assert merged.batches == 2 + 3 == whole[name].batches + 0
        torch.testing.assert_close(merged.mean, whole[name].mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(merged.m2, whole[name].m2, rtol=1e-12, atol=0.0)
    merged_all = {name: received[0][name].merge(received[1][name]) for name in ALL}
    apply_statistics(model, merged_all, ALL)
    assert int(model.state_dict()["stem.bn.num_batches_tracked"]) == 5


def test_layer_statistics_merge_and_json() -> None:
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 1000, generator=gen, dtype=torch.float64) * 5 + 2  # (C, elements)
    parts = [values[:, :1], values[:, 1:300], values[:, 300:]]
    stats = [
        LayerStatistics(
            p.shape[1], p.mean(dim=1), ((p - p.mean(dim=1, keepdim=True)) ** 2).sum(1), 1
        )
        for p in parts
    ]
    merged = stats[0].merge(stats[1]).merge(stats[2])
    assert merged.count == 1000
    assert merged.batches == 3
    torch.testing.assert_close(merged.mean, values.mean(dim=1), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(merged.variance(), values.var(dim=1), rtol=1e-13, atol=0.0)
    empty = LayerStatistics(0, torch.zeros(4), torch.zeros(4))
    assert torch.equal(empty.merge(merged).mean, merged.mean)
    back = StatisticsMessage.model_validate_json(
        StatisticsMessage.of(merged).model_dump_json()
    ).statistics()
    assert back.count == merged.count
    assert back.batches == merged.batches
    assert torch.equal(back.mean, merged.mean)
    assert torch.equal(back.m2, merged.m2)
    with pytest.raises(ValueError, match="4 and 3 channels"):
        merged.merge(LayerStatistics(1, torch.zeros(3), torch.zeros(3)))
    with pytest.raises(AdaptError, match="at least 2 values per channel, got 1"):
        stats[0].variance()


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.bn2 = nn.BatchNorm1d(6, momentum=None)
        self.unused = nn.BatchNorm1d(6)
        self.seen: list[tuple[str, bool]] = []
        for name in ("bn1", "drop", "bn2"):
            getattr(self, name).register_forward_pre_hook(
                lambda m, args, name=name: self.seen.append((name, m.training))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 6)
        return self.bn2(self.drop(self.bn1(x)))


def feature_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(n, 6, generator=gen) * 2 + 1 for n in (8, 8, 5)]


def test_only_selected_layers_run_in_train_mode_and_others_keep_their_bits() -> None:
    model = WithDropout()
    model.train()
    model.drop.eval()
    before = state(model)
    expected = direct_statistics(model, feature_batches(), ["bn2"])
    progress: list[int] = []
    stats = precise_batchnorm(model, feature_batches(), layers=["bn2"], progress=progress.append)
    assert stats == AdaptStats(batches=3, samples=21)
    assert progress == [1, 2, 3]
    assert model.seen[:3] == [("bn1", False), ("drop", False), ("bn2", True)]
    assert_precise(model, expected, 3)
    after = model.state_dict()
    for key in before:
        if not key.startswith("bn2."):
            assert torch.equal(after[key], before[key]), key
    assert [m.training for m in model.modules()] == [True, True, False, True, True]
    assert model.bn2.momentum is None


def test_refusals_leave_the_model_unchanged() -> None:
    model = resnet()
    before = state(model)
    with pytest.raises(AdaptError, match="no batches to adapt on"):
        precise_batchnorm(model, [], layers=ALL)
    with pytest.raises(AdaptError, match="no layers to adapt"):
        precise_batchnorm(model, split(data(), 32), layers=[])
    with pytest.raises(AdaptError, match="no batches to adapt on"):
        prior_batchnorm(model, [], layers=ALL, strength=4.0, base="precise")
    with pytest.raises(AdaptError, match="no layers to adapt"):
        prior_batchnorm(model, split(data(), 32), layers=[], strength=4.0, base="cumulative")
    with pytest.raises(AdaptError, match="prior strength must be >= 0"):
        prior_batchnorm(model, split(data(), 32), layers=ALL, strength=-1.0, base="precise")
    assert_same_state(model, before)
    unused = WithDropout()
    with pytest.raises(AdaptError, match=r"\['unused'\] received no input in 3 batches"):
        precise_batchnorm(unused, feature_batches(), layers=["bn1", "unused"])
    with pytest.raises(AdaptError, match="no statistics for layer 'unused'"):
        apply_statistics(unused, {}, ["unused"])


def test_cancel_between_batches_leaves_the_model_unchanged() -> None:
    model = resnet()
    before = state(model)
    calls = iter([False, False, True])
    with pytest.raises(JobCanceled, match="after 2 batches"):
        precise_batchnorm(model, split(data(), 32), layers=ALL, should_stop=lambda: next(calls))
    assert_same_state(model, before)


# --- prior ------------------------------------------------------------------------------


def test_mixing_formula_on_known_numbers() -> None:
    source = torch.tensor([1.0, 2.0, -4.0])
    target = torch.tensor([3.0, 6.0, 4.0])
    # N = 2, n = 6: 2/8 * source + 6/8 * target
    mixed = mix_statistics(source, target, strength=2.0, samples=6)
    assert torch.equal(mixed, torch.tensor([2.5, 5.0, 2.0]))
    assert mixed.dtype == torch.float32
    assert torch.equal(mix_statistics(source, target, strength=0.0, samples=6), target)
    with pytest.raises(AdaptError, match="needs target samples, got 0"):
        mix_statistics(source, target, strength=2.0, samples=0)


@pytest.mark.parametrize("base", ["precise", "cumulative"])
def test_prior_with_zero_strength_equals_its_base(base: str) -> None:
    reference = resnet()
    model = copy.deepcopy(reference)
    batches = split(data(), 32)
    if base == "precise":
        precise_batchnorm(reference, batches, layers=ALL)
    else:
        adapt_batchnorm(reference, batches, estimator="cumulative", layers=ALL, reset=True)
    stats = prior_batchnorm(model, batches, layers=ALL, strength=0.0, base=base)  # type: ignore[arg-type]
    assert stats == AdaptStats(batches=5, samples=SAMPLES)
    assert_same_state(model, state(reference))


@pytest.mark.parametrize("base", ["precise", "cumulative"])
def test_prior_mixes_source_and_target(base: str) -> None:
    source = resnet()
    # Source statistics that are not the initial ones, and a layer left out of the selection.
    adapt_batchnorm(source, split(data(40) * 0.5, 8), estimator="ema", layers=ALL, reset=False)
    layers = [name for name in ALL if name != "stem.bn"]
    target = copy.deepcopy(source)
    model = copy.deepcopy(source)
    batches = split(data(), 32)
    if base == "precise":
        precise_batchnorm(target, batches, layers=layers)
    else:
        adapt_batchnorm(target, batches, estimator="cumulative", layers=layers, reset=True)
    strength = 16.0
    prior_batchnorm(model, batches, layers=layers, strength=strength, base=base)  # type: ignore[arg-type]
    src, tgt, found = source.state_dict(), target.state_dict(), model.state_dict()
    n = SAMPLES
    for key in found:
        name = key.rsplit(".", 1)[0]
        if name in layers and key.endswith(("running_mean", "running_var")):
            expected = src[key].double() * (strength / (strength + n)) + tgt[key].double() * (
                n / (strength + n)
            )
            assert torch.equal(found[key], expected.float()), key
            assert not torch.equal(found[key], tgt[key]), key
        elif name in layers and key.endswith("num_batches_tracked"):
            assert int(found[key]) == 5, "as the base: reset, then one per batch"
        else:
            assert torch.equal(found[key], src[key]), key
