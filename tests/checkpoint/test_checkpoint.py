"""The guarantee of bnadapt/checkpoint.py, NOTE [ Buffers and the recomputation ]: after any
sequence of calls, outputs, gradients and the full state_dict of the checkpointed model are
bitwise equal to those of the same model run without checkpointing."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import bnadapt.checkpoint
from bnadapt.checkpoint import (
    CheckpointWrapper,
    apply_checkpointing,
    checkpoint,
    checkpoint_wrapper,
)
from bnadapt.sync_batchnorm import convert_sync_batchnorm
from tests.checkpoint.checkpoint_harness import assert_same, check_equivalent, run


class Block(nn.Module):
    """Conv-BN-ReLU-Conv-BN with a residual connection; shape-preserving. # (B, C, H, W)"""

    def __init__(self, channels: int, momentum: float | None = 0.1, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn1(self.conv1(x))))
        return torch.relu(x + self.bn2(self.conv2(h)))


class Net(nn.Module):
    """Stem, ``depth`` Blocks, pooled linear head. (B, 3, 8, 8) -> (B, 5)"""

    def __init__(self, depth: int = 3, momentum: float | None = 0.1, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum)
        )
        self.blocks = nn.Sequential(*(Block(8, momentum, dropout) for _ in range(depth)))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(torch.relu(self.stem(x)))  # (B, 8, 8, 8)
        return self.head(h.mean(dim=(2, 3)))


def wrap_blocks(model: nn.Module) -> nn.Module:
    return apply_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def wrap_whole(model: nn.Module) -> nn.Module:
    return checkpoint_wrapper(model)


def images(n: int = 5, batch: int = 4, grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(batch, 3, 8, 8, generator=gen).requires_grad_(grad) for _ in range(n)]


def fresh_net(**kwargs: Any) -> Net:
    torch.manual_seed(0)
    return Net(**kwargs)


MOMENTA = [pytest.param(0.1, id="momentum0.1"), pytest.param(None, id="cumulative")]
WRAPS = [pytest.param(wrap_blocks, id="blocks"), pytest.param(wrap_whole, id="whole")]


def adapt_no_grad(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    model.train()
    with torch.no_grad():
        return [model(x) for x in xs]


def forward_with_grad(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    model.train()
    return [model(x).detach() for x in xs]


def forward_backward(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    model.train()
    outs = []
    for x in xs:
        out = model(x)
        out.square().mean().backward()
        outs.append(out.detach())
    return outs


def several_then_one_backward(model: nn.Module, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    model.train()
    total = sum(model(x).square().mean() for x in xs)
    assert isinstance(total, torch.Tensor)
    total.backward()
    return total.detach()


def retain_graph_twice(model: nn.Module, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    model.train()
    out = model(xs[0]).square().mean()
    out.backward(retain_graph=True)
    out.backward()
    return out.detach()


SCENARIOS = [
    pytest.param(adapt_no_grad, id="no_grad_adaptation"),
    pytest.param(forward_with_grad, id="grad_forward_only"),
    pytest.param(forward_backward, id="forward_backward"),
    pytest.param(several_then_one_backward, id="several_forwards_one_backward"),
    pytest.param(retain_graph_twice, id="retain_graph_twice"),
]


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("momentum", MOMENTA)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_call_patterns_match_unwrapped(
    scenario: Callable[..., Any], momentum: float | None, wrap: Callable[[nn.Module], nn.Module]
) -> None:
    _plain, wrapped, _ = check_equivalent(
        fresh_net(momentum=momentum), wrap, scenario, images(grad=True)
    )
    counts = {
        int(b.num_batches_tracked) for b in wrapped.modules() if isinstance(b, nn.BatchNorm2d)
    }
    # Each BN saw each batch once: 1 for the retain_graph scenario, 5 otherwise.
    assert counts == {1 if scenario is retain_graph_twice else 5}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_call_patterns_match_without_foreach_clone(
    scenario: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch releases without torch._foreach_clone (2.11, seen on a GPU machine) take the
    wrapper's one-clone-each path, with the same guarantee."""
    monkeypatch.setattr(bnadapt.checkpoint, "_FOREACH_CLONE", None)
    check_equivalent(fresh_net(momentum=0.1), wrap_blocks, scenario, images(grad=True))


def _scales_by_running_mean(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    running_mean = module.running_mean
    assert isinstance(running_mean, torch.Tensor)
    return output * (1 + running_mean.view(1, -1, 1, 1))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_batchnorm_whose_hook_reads_its_statistics_is_recorded(
    scenario: Callable[..., Any],
) -> None:
    """NOTE [ BatchNorm in train mode ]: a forward hook that reads the running statistics makes
    the output depend on them, so that BatchNorm is recorded and copied, not given scratch."""
    model = fresh_net(momentum=0.1)
    for block in model.blocks:
        block.bn1.register_forward_hook(_scales_by_running_mean)
    check_equivalent(model, wrap_blocks, scenario, images(grad=True))


class OwnForwardBatchNorm(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_only_torchs_own_train_mode_batchnorm_skips_the_copies() -> None:
    """NOTE [ BatchNorm in train mode ]: a train-mode BatchNorm2d records no copies; in eval mode
    it does, and so does a subclass with a forward of its own, in either mode."""
    block = Block(4)
    block.bn2 = OwnForwardBatchNorm(4)
    for training, copies in ((True, 3), (False, 6)):
        state = bnadapt.checkpoint._CallState()
        state.capture(block.train(training))
        assert len(state.values) == copies
        records = {module: record for module, _, _, record in state.records}
        assert records[block.bn1] is not None and records[block.bn2] is not None
        assert (records[block.bn1].scratch is not None) is training
        assert records[block.bn2].scratch is None


def test_batchnorm_scratch_is_reused_and_goes_with_its_module() -> None:
    """NOTE [ BatchNorm in train mode ]: the scratch is made once for a module's buffer objects
    and reused by every recomputation, stands in for its _buffers only while one runs, is made
    anew for new buffer objects, and its cache entry goes when the module does."""
    scratches = bnadapt.checkpoint._SCRATCH
    bn = nn.BatchNorm1d(4)
    wrapped = checkpoint_wrapper(nn.Sequential(bn))
    own = bn._buffers
    x = torch.randn(6, 4, requires_grad=True)
    wrapped(x).sum().backward()
    entry = scratches[id(bn)]
    scratch = entry.record.scratch
    assert scratch is not None and scratch.keys() == own.keys()
    assert all(scratch[name] is not own[name] for name in own)
    wrapped(x).sum().backward()
    assert scratches[id(bn)] is entry
    assert bn._buffers is own and int(bn.num_batches_tracked) == 2
    # A new object for any one of the three buffers, as .to() or a replacing load makes them,
    # gets a new scratch made for it.
    for calls, name in enumerate(("running_mean", "running_var", "num_batches_tracked"), 3):
        setattr(bn, name, getattr(bn, name).clone())
        wrapped(x).sum().backward()
        assert scratches[id(bn)] is not entry and bn._buffers is own
        entry = scratches[id(bn)]
        assert entry.record.scratch is not None
        assert all(entry.record.scratch[k] is not v for k, v in own.items())
        assert int(bn.num_batches_tracked) == calls
    key = id(bn)
    del wrapped, bn
    gc.collect()
    assert key not in scratches


@pytest.mark.parametrize("momentum", MOMENTA)
def test_no_grad_adaptation_moves_the_statistics(momentum: float | None) -> None:
    # Not vacuous: the statistics really change, in the wrapped model as in the plain one.
    model = fresh_net(momentum=momentum)
    before = copy.deepcopy(model.state_dict())
    _, wrapped, _ = check_equivalent(model, wrap_blocks, adapt_no_grad, images())
    after = wrapped.state_dict()
    assert not torch.equal(before["blocks.0.bn1.running_mean"], after["blocks.0.bn1.running_mean"])
    assert int(after["blocks.0.bn1.num_batches_tracked"]) == 5


@pytest.mark.parametrize("momentum", MOMENTA)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_ten_optimizer_steps(momentum: float | None, dropout: float) -> None:
    def train(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(10):
            opt.zero_grad()
            loss = model(xs[step % len(xs)]).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    _, wrapped, (losses, _) = check_equivalent(
        fresh_net(momentum=momentum, dropout=dropout, depth=4), wrap_blocks, train, images()
    )
    assert int(wrapped.state_dict()["blocks.3.bn2.num_batches_tracked"]) == 10
    assert not torch.equal(losses[0], losses[-1])


class EMA(nn.Module):
    """Keeps an exponential moving average of its input's mean and uses it in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(x.mean(), alpha=0.1)
                self.calls += 1
        return x * 2 - self.avg


class RegistersOnFirstCall(nn.Module):
    """Registers its buffer in its first forward (so a call's record may lack it), then keeps
    a running sum of its input's column means in it, which it also uses in the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "total" not in self._buffers:
            self.register_buffer("total", torch.zeros(x.shape[-1], dtype=torch.float64))
        total = self._buffers["total"]
        assert total is not None
        if self.training:
            with torch.no_grad():
                total.add_(x.mean(0).double())
        return x + total.float()


class MixedBuffers(nn.Module):
    """Buffers of several shapes and dtypes, one of which requires grad (and gets one), all
    updated in train mode and read in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("matrix", torch.eye(6, dtype=torch.float64).t())  # not contiguous
        self.register_buffer("counts", torch.zeros(6, dtype=torch.int32))
        self.register_buffer("flag", torch.zeros((), dtype=torch.bool))
        self.register_buffer("scale", torch.ones(6, requires_grad=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.matrix.mul_(0.9).add_(torch.outer(x.mean(0), x.mean(0)).double(), alpha=0.1)
                self.counts += (x > 0).sum(0).int()
                self.flag.fill_(bool(self.counts.sum() % 2))
        # Read only in ways that save none of them for backward: a later forward updates them
        # in place before this one's backward, as without checkpointing.
        shift = self.matrix.sum(0).float() + self.counts.float() / 100
        return x * self.scale * (2.0 if bool(self.flag) else 1.0) + shift


def layer_cases() -> list[Any]:
    def seq(*layers: nn.Module) -> nn.Module:
        return nn.Sequential(*layers)

    return [
        pytest.param(lambda: seq(nn.Linear(6, 6), nn.BatchNorm1d(6)), (4, 6), id="BatchNorm1d"),
        pytest.param(
            lambda: seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), (4, 3, 6, 6), id="BatchNorm2d"
        ),
        pytest.param(
            lambda: seq(nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4)), (2, 3, 5, 5, 5), id="BatchNorm3d"
        ),
        pytest.param(
            lambda: seq(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d()), (4, 3, 6, 6), id="LazyBN2d"
        ),
        pytest.param(
            lambda: seq(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True)),
            (4, 3, 6, 6),
            id="InstanceNorm2d",
        ),
        pytest.param(
            lambda: seq(spectral_norm(nn.Linear(6, 6)), nn.Tanh()), (4, 6), id="spectral_norm"
        ),
        pytest.param(lambda: seq(nn.Linear(6, 6), EMA()), (4, 6), id="ema_buffer"),
        pytest.param(
            lambda: seq(nn.Linear(6, 6), RegistersOnFirstCall()), (4, 6), id="registers_buffer"
        ),
        pytest.param(lambda: seq(nn.Linear(6, 6), MixedBuffers()), (4, 6), id="mixed_buffers"),
        pytest.param(
            lambda: nn.SyncBatchNorm.convert_sync_batchnorm(
                seq(nn.Linear(6, 6), nn.BatchNorm1d(6))
            ),
            (4, 6),
            id="SyncBatchNorm_no_process_group",
        ),
        pytest.param(
            lambda: convert_sync_batchnorm(seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))),
            (4, 3, 6, 6),
            id="bnadapt_SyncBatchNorm_no_process_group",
        ),
    ]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize(("factory", "shape"), layer_cases())
def test_every_buffer_updating_module(
    factory: Callable[[], nn.Module], shape: tuple[int, ...], scenario: Callable[..., Any]
) -> None:
    torch.manual_seed(0)
    model = factory()
    torch.manual_seed(0)
    same_model = factory()
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(*shape, generator=gen).requires_grad_() for _ in range(3)]
    check_equivalent(model, wrap_whole, scenario, xs, copy_of_model=same_model)


def test_spectral_norm_power_iteration_runs_once_per_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(spectral_norm(nn.Linear(6, 6)))
    u0 = model[0].parametrizations.weight[0]._u.clone()
    _, wrapped, _ = check_equivalent(model, wrap_whole, forward_backward, [torch.randn(4, 6)])
    assert not torch.equal(u0, wrapped.state_dict()["0.parametrizations.weight.0._u"])


class Twice(nn.Module):
    """Calls the same BatchNorm twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.bn(x)))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_same_batchnorm_twice_in_one_region(scenario: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    _, wrapped, _ = check_equivalent(Twice(), wrap_whole, scenario, images(n=2, grad=True))
    expected = 2 if scenario is retain_graph_twice else 4
    assert int(wrapped.state_dict()["bn.num_batches_tracked"]) == expected


def nested(model: nn.Module) -> nn.Module:
    # A wrapped block inside a wrapped block, inside a wrapped model.
    assert isinstance(model, Net)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    model.blocks[1].bn2 = checkpoint_wrapper(model.blocks[1].bn2)
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    model.blocks = checkpoint_wrapper(model.blocks)  # type: ignore[assignment]
    return checkpoint_wrapper(model)


def wrapped_twice(model: nn.Module) -> nn.Module:
    assert isinstance(model, Net)
    model.blocks[0] = checkpoint_wrapper(checkpoint_wrapper(model.blocks[0]))
    return checkpoint_wrapper(checkpoint_wrapper(model))


@pytest.mark.parametrize("wrap", [nested, wrapped_twice])
@pytest.mark.parametrize("momentum", MOMENTA)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_nested_and_double_wrappers(
    scenario: Callable[..., Any], momentum: float | None, wrap: Callable[[nn.Module], nn.Module]
) -> None:
    check_equivalent(fresh_net(momentum=momentum), wrap, scenario, images(n=3, grad=True))


def test_one_module_in_two_wrappers_used_in_turn() -> None:
    def scenario(model: nn.Module, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        # Model with a shared block: the plain one calls it directly, the other through two
        # different wrappers of the same module.
        assert isinstance(model, nn.ModuleDict)
        total = model["a"](xs[0]).sum() + model["b"](xs[1]).sum()
        total.backward()
        return total.detach()

    block = Block(3)
    plain = nn.ModuleDict({"a": block, "b": block})
    wrap: Callable[[nn.Module], nn.Module] = lambda m: nn.ModuleDict(  # noqa: E731
        {"a": checkpoint_wrapper(m["a"]), "b": checkpoint_wrapper(m["b"])}  # type: ignore[index]
    )
    wrapped = wrap(copy.deepcopy(plain))
    assert_same(run(plain, scenario, images(2), 0), run(wrapped, scenario, images(2), 0))
    assert int(wrapped["a"].bn1.num_batches_tracked) == 2


def test_eval_mode() -> None:
    def scenario(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        model.eval()
        return forward_backward_keep_mode(model, xs)

    check_equivalent(fresh_net(dropout=0.5), wrap_blocks, scenario, images(grad=True))


def forward_backward_keep_mode(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    outs = []
    for x in xs:
        out = model(x)
        out.sum().backward()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize(("forward_mode", "backward_mode"), [("train", "eval"), ("eval", "train")])
def test_mode_switched_between_forward_and_backward(forward_mode: str, backward_mode: str) -> None:
    # The recomputation replays each call in the mode it ran in (torch's checkpoint would
    # recompute in the current mode and fail or compute something else).
    def scenario(model: nn.Module, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        model.train(forward_mode == "train")
        total = sum(model(x).square().mean() for x in xs)
        assert isinstance(total, torch.Tensor)
        model.train(backward_mode == "train")
        total.backward()
        return total.detach()

    check_equivalent(fresh_net(dropout=0.2), wrap_blocks, scenario, images(n=3, grad=True))


def test_eval_call_then_train_calls_then_backward() -> None:
    # An eval-mode call saves running_var for backward. If train-mode calls update it in place
    # before backward, the unwrapped model's backward silently reads the updated values (torch
    # does not version-check BatchNorm's running statistics), so bitwise equality with it is
    # not the right yardstick here. The wrapper recomputes with the statistics the eval call
    # saw: its gradient equals that of the eval call run and back-propagated on its own.
    def eval_then_train(model: nn.Module, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        model.eval()
        first = model(xs[0]).square().mean()
        model.train()
        with torch.no_grad():
            model(xs[1])
        first.backward()
        return first.detach()

    def eval_alone(model: nn.Module, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        model.eval()
        first = model(xs[0]).square().mean()
        first.backward()
        model.train()
        with torch.no_grad():
            model(xs[1])
        return first.detach()

    plain = fresh_net()
    wrapped = wrap_whole(copy.deepcopy(plain))  # every BatchNorm inside the region
    assert_same(
        run(plain, eval_alone, images(2, grad=True), 0),
        run(wrapped, eval_then_train, images(2, grad=True), 0),
    )
    assert_same(dict(plain.state_dict()), dict(wrapped.state_dict()))


def test_frozen_parameters_and_input_without_grad() -> None:
    model = fresh_net()
    for param in model.parameters():
        param.requires_grad_(False)
    _, wrapped, _ = check_equivalent(model, wrap_blocks, forward_with_grad, images(grad=False))
    assert int(wrapped.state_dict()["blocks.0.bn1.num_batches_tracked"]) == 5


def test_frozen_body_trainable_head() -> None:
    model = fresh_net()
    for param in model.blocks.parameters():
        param.requires_grad_(False)
    check_equivalent(model, wrap_blocks, forward_backward, images(grad=False))


def test_dropout_mask_is_replayed() -> None:
    # With p=0.5 a different mask in the recomputation would change every gradient.
    model, _, (_outs, _) = check_equivalent(
        fresh_net(dropout=0.5), wrap_blocks, forward_backward, images(grad=True)
    )
    assert model.blocks[0].drop.p == 0.5
    # The global random stream after the calls is the same too.
    torch.manual_seed(3)
    forward_backward(copy.deepcopy(model), images(1))
    plain_next = torch.rand(3)
    torch.manual_seed(3)
    forward_backward(wrap_blocks(copy.deepcopy(model)), images(1))
    assert torch.equal(plain_next, torch.rand(3))


class Structured(nn.Module):
    """Takes keyword arguments; returns nested containers with None and non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(
        self, x: torch.Tensor, *, scale: float = 1.0, extra: torch.Tensor | None = None
    ) -> dict[str, Any]:
        h = self.bn(self.lin(x)) * scale
        if extra is not None:
            h = h + extra
        return {"out": h, "pair": (h.sum(), None), "list": [h.mean(), "tag", 3], "none": None}


def test_keyword_arguments_and_output_structure() -> None:
    def scenario(model: nn.Module, xs: Sequence[torch.Tensor]) -> dict[str, Any]:
        result: dict[str, Any] = model(xs[0], scale=0.5, extra=xs[1])
        (result["out"].square().sum() + result["pair"][0] + result["list"][0]).backward()
        return {
            "out": result["out"].detach(),
            "pair": tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in result["pair"]),
            "list": [v.detach() if isinstance(v, torch.Tensor) else v for v in result["list"]],
            "none": result["none"],
        }

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(5, 4, generator=gen, requires_grad=True) for _ in range(2)]
    _, _, ((result, grads)) = check_equivalent(Structured(), wrap_whole, scenario, xs)
    assert isinstance(result["pair"], tuple) and isinstance(result["list"], list)
    assert result["pair"][1] is None and result["list"][1:] == ["tag", 3]
    assert all(g is not None for g in grads)


def test_output_types_survive_the_wrapper() -> None:
    torch.manual_seed(0)
    wrapped = checkpoint_wrapper(Structured())
    out = wrapped(torch.randn(3, 4, requires_grad=True))
    assert type(out) is dict and type(out["pair"]) is tuple and type(out["list"]) is list
    assert out["out"].requires_grad


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x)
        if self.fail:
            raise RuntimeError("boom")
        return h


@pytest.mark.parametrize("grad", [True, False])
def test_exception_leaves_module_as_before(grad: bool) -> None:
    # The exception happens after BN updated (as it would unwrapped); afterwards the module
    # must behave exactly like its unwrapped twin: no hook, flag or swapped buffer left over.
    torch.manual_seed(0)
    plain = Fails()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(6, 4, requires_grad=True)
    with torch.set_grad_enabled(grad):
        for model in (plain, wrapped):
            with pytest.raises(RuntimeError, match="boom"):
                model(x)
    assert not nn.modules.module._global_forward_pre_hooks
    plain.fail = False
    wrapped.wrapped_module.fail = False
    assert_same(run(plain, forward_backward, [x], 0), run(wrapped, forward_backward, [x], 0))
    assert_same(dict(plain.state_dict()), dict(wrapped.state_dict()))


def test_exception_during_recomputation_restores_buffers() -> None:
    class FailsOnSecondRun(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.runs = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.runs += 1
            h = self.bn(x)
            if self.runs == 2:
                raise RuntimeError("recomputation failed")
            return h.square()

    torch.manual_seed(0)
    module = FailsOnSecondRun()
    wrapped = checkpoint_wrapper(module)
    out = wrapped(torch.randn(6, 4, requires_grad=True))
    real_mean = module.bn.running_mean
    own_buffers = module.bn._buffers
    snapshot = real_mean.clone()
    with pytest.raises(RuntimeError, match="recomputation failed"):
        out.sum().backward()
    assert module.bn._buffers is own_buffers
    assert module.bn.running_mean is real_mean and torch.equal(real_mean, snapshot)
    assert module.training and int(module.bn.num_batches_tracked) == 1


def test_bf16_autocast_on_cpu() -> None:
    def scenario(model: nn.Module, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        model.train()
        outs = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().mean().backward()
            outs.append(out.detach())
        return outs

    _, _, ((outs, _)) = check_equivalent(fresh_net(), wrap_blocks, scenario, images(n=3, grad=True))
    assert outs[0].dtype == torch.bfloat16


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_functional_checkpoint(scenario: Callable[..., Any]) -> None:
    class UsesFunctional(nn.Module):
        """A plain function (not a module) passed to checkpoint, closing over modules."""

        def __init__(self, inner: Net) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stem = self.inner.stem
            blocks = self.inner.blocks

            def body(h: torch.Tensor, *, gain: float) -> torch.Tensor:
                return blocks(torch.relu(stem(h))) * gain

            h = checkpoint(body, x, gain=2.0)
            return self.inner.head(h.mean(dim=(2, 3)))

    def functional(model: nn.Module) -> nn.Module:
        assert isinstance(model, Net)
        return UsesFunctional(model)

    def plain_scenario(model: nn.Module, xs: Sequence[torch.Tensor]) -> Any:
        return scenario(model, xs)

    torch.manual_seed(0)
    plain = Net()

    class Doubled(nn.Module):
        def __init__(self, inner: Net) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner.blocks(torch.relu(self.inner.stem(x))) * 2.0
            return self.inner.head(h.mean(dim=(2, 3)))

    reference = Doubled(plain)
    wrapped = functional(copy.deepcopy(plain))
    assert_same(
        run(reference, plain_scenario, images(grad=True), 0),
        run(wrapped, plain_scenario, images(grad=True), 0),
    )
    assert_same(dict(reference.state_dict()), dict(wrapped.state_dict()))


def test_functional_checkpoint_of_a_bound_method() -> None:
    torch.manual_seed(0)
    block = Block(3)
    twin_block = copy.deepcopy(block)
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    checkpoint(twin_block.forward, x).sum().backward()
    block(x).sum().backward()
    assert_same(dict(block.state_dict()), dict(twin_block.state_dict()))


def test_user_context_fn_is_entered_in_both_passes() -> None:
    entered: list[str] = []

    class Mark:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            entered.append(self.name)

        def __exit__(self, *exc: object) -> None:
            return None

    block = Block(3)
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    out = checkpoint(block, x, context_fn=lambda: (Mark("forward"), Mark("recompute")))
    out.sum().backward()
    assert entered == ["forward", "recompute"]
    assert int(block.bn1.num_batches_tracked) == 1


def test_reentrant_is_refused() -> None:
    with pytest.raises(ValueError, match="non-reentrant only"):
        checkpoint(nn.Identity(), torch.ones(1), use_reentrant=True)


def test_state_dict_keys_and_loading_both_ways() -> None:
    plain = fresh_net()
    wrapped = nested(copy.deepcopy(plain))
    assert list(plain.state_dict()) == list(wrapped.state_dict())
    forward_backward(wrapped, images(2, grad=True))
    # wrapped -> plain, strict
    fresh = fresh_net()
    fresh.load_state_dict(wrapped.state_dict(), strict=True)
    assert_same(dict(fresh.state_dict()), dict(wrapped.state_dict()))
    # plain -> wrapped, strict
    other = nested(fresh_net())
    forward_backward(plain, images(3, grad=True))
    other.load_state_dict(plain.state_dict(), strict=True)
    assert_same(dict(plain.state_dict()), dict(other.state_dict()))
    # Wrong keys are still reported, with the unwrapped names.
    broken = dict(plain.state_dict())
    broken["blocks.0.bn1.bogus"] = broken.pop("blocks.0.bn1.running_mean")
    with pytest.raises(RuntimeError, match=r"blocks\.0\.bn1\.running_mean"):
        nested(fresh_net()).load_state_dict(broken, strict=True)


def test_wrapper_named_parameters_and_attribute_access() -> None:
    block = Block(3)
    wrapped = checkpoint_wrapper(block)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in block.named_parameters()]
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in block.named_buffers()]
    assert wrapped.bn1 is block.bn1
    seq = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert isinstance(seq[1], nn.ReLU)
    with pytest.raises(TypeError, match=r"needs an nn\.Module"):
        checkpoint_wrapper(lambda x: x)  # type: ignore[arg-type]


def test_apply_checkpointing_is_idempotent_and_skips_root() -> None:
    model = fresh_net(depth=2)
    apply_checkpointing(model, check_fn=lambda m: isinstance(m, (Block, Net)))
    apply_checkpointing(model, check_fn=lambda m: isinstance(m, (Block, Net)))
    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrappers) == 2
    assert all(isinstance(w.wrapped_module, Block) for w in wrappers)


def test_offload_to_cpu_keeps_the_guarantee() -> None:
    def wrap(model: nn.Module) -> nn.Module:
        return apply_checkpointing(
            model, check_fn=lambda m: isinstance(m, Block), offload_to_cpu=True
        )

    check_equivalent(fresh_net(), wrap, several_then_one_backward, images(grad=True))


def test_no_grad_calls_the_module_directly() -> None:
    # The adaptation loop pays nothing: no checkpoint, no hook, no record.
    calls: list[bool] = []
    block = Block(3)
    block.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    wrapped = checkpoint_wrapper(block)
    with torch.no_grad():
        wrapped(torch.randn(2, 3, 4, 4))
    assert calls == [False]
