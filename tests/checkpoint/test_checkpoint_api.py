"""bnadapt.checkpoint as a drop-in for fairscale's and torch.distributed's wrappers: both
signatures, torch's auto-wrap policies and state_dict prefixes, each with the guarantee kept;
what would break the guarantee is refused with an error that says what to use."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
)
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from bnadapt.checkpoint import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_wrapper,
    disable_checkpointing,
)
from tests.checkpoint.checkpoint_harness import assert_same, check_equivalent
from tests.checkpoint.test_checkpoint import Block, Net, forward_backward, fresh_net, images


def count_wrappers(model: nn.Module) -> int:
    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())


WRAPPER_CALLS: list[Any] = [
    pytest.param(lambda m: checkpoint_wrapper(m), id="default"),
    pytest.param(lambda m: checkpoint_wrapper(m, False), id="fairscale_positional_False"),
    pytest.param(lambda m: checkpoint_wrapper(m, True), id="fairscale_positional_True"),
    pytest.param(lambda m: checkpoint_wrapper(m, offload_to_cpu=True), id="fairscale_keyword"),
    pytest.param(lambda m: checkpoint_wrapper(m, {}), id="fairscale_falsy_flag"),
    pytest.param(lambda m: checkpoint_wrapper(m, CheckpointImpl.NO_REENTRANT), id="torch_impl"),
    pytest.param(
        lambda m: checkpoint_wrapper(m, torch_wrappers.CheckpointImpl.NO_REENTRANT),
        id="torch_distributed_enum",
    ),
    pytest.param(
        lambda m: checkpoint_wrapper(m, checkpoint_fn=torch_checkpoint, use_reentrant=False),
        id="torch_checkpoint_fn_non_reentrant",
    ),
    pytest.param(
        lambda m: checkpoint_wrapper(
            m, checkpoint_fn=functools.partial(torch_checkpoint, use_reentrant=False)
        ),
        id="torch_checkpoint_fn_partial",
    ),
    pytest.param(lambda m: checkpoint_wrapper(m, checkpoint_fn=checkpoint), id="our_checkpoint_fn"),
    pytest.param(
        lambda m: checkpoint_wrapper(
            m, preserve_rng_state=True, determinism_check="none", debug=False, early_stop=False
        ),
        id="passed_options",
    ),
    pytest.param(lambda m: CheckpointWrapper(m), id="class"),
]


@pytest.mark.parametrize("wrap_block", WRAPPER_CALLS)
def test_every_signature_keeps_the_guarantee(wrap_block: Callable[[nn.Module], nn.Module]) -> None:
    def wrap(model: nn.Module) -> nn.Module:
        assert isinstance(model, Net)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = wrap_block(block)
        return model

    _, wrapped, _ = check_equivalent(fresh_net(dropout=0.3), wrap, forward_backward, images())
    assert count_wrappers(wrapped) == 3
    assert int(wrapped.state_dict()["blocks.2.bn2.num_batches_tracked"]) == 5


def test_offload_flag_positional_or_keyword() -> None:
    assert checkpoint_wrapper(nn.Linear(1, 1), True).offload_to_cpu
    assert checkpoint_wrapper(nn.Linear(1, 1), offload_to_cpu=True).offload_to_cpu
    assert not checkpoint_wrapper(nn.Linear(1, 1), False).offload_to_cpu
    assert not checkpoint_wrapper(nn.Linear(1, 1)).offload_to_cpu
    with pytest.raises(TypeError, match="offload_to_cpu given twice"):
        checkpoint_wrapper(nn.Linear(1, 1), True, offload_to_cpu=True)
    with pytest.raises(TypeError, match="is a string"):
        checkpoint_wrapper(nn.Linear(1, 1), "NO_REENTRANT")  # type: ignore[arg-type]


def my_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        pytest.param(
            lambda m: checkpoint_wrapper(m, CheckpointImpl.REENTRANT),
            ValueError,
            r"REENTRANT cannot keep buffers exact.*use CheckpointImpl\.NO_REENTRANT",
            id="reentrant_impl",
        ),
        pytest.param(
            lambda m: checkpoint_wrapper(m, torch_wrappers.CheckpointImpl.REENTRANT),
            ValueError,
            r"REENTRANT cannot keep buffers exact",
            id="torch_distributed_reentrant_impl",
        ),
        pytest.param(
            lambda m: checkpoint_wrapper(m, use_reentrant=True),
            ValueError,
            r"use_reentrant=True cannot keep buffers exact.*NO_REENTRANT",
            id="use_reentrant_kwarg",
        ),
        pytest.param(
            lambda m: checkpoint_wrapper(m, checkpoint_fn=torch_checkpoint),
            ValueError,
            r"runs the reentrant variant unless use_reentrant=False.*pass use_reentrant=False",
            id="torch_checkpoint_fn_default",
        ),
        pytest.param(
            lambda m: checkpoint_wrapper(m, checkpoint_fn=torch_checkpoint, use_reentrant=True),
            ValueError,
            r"use_reentrant=True\)",
            id="torch_checkpoint_fn_reentrant",
        ),
        pytest.param(
            lambda m: checkpoint_wrapper(m, checkpoint_fn=my_checkpoint),
            ValueError,
            r"checkpoint_fn=my_checkpoint cannot keep buffers exact.*Drop checkpoint_fn",
            id="own_checkpoint_fn",
        ),
        pytest.param(
            lambda m: checkpoint_wrapper(m, preserve_rng_sate=False),
            TypeError,
            r"unknown checkpoint option\(s\) \['preserve_rng_sate'\]",
            id="misspelt_option",
        ),
    ],
)
def test_what_breaks_the_guarantee_is_refused(
    call: Callable[[nn.Module], nn.Module], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        call(Block(3))


def test_torchscript_modules_are_refused_with_what_to_do() -> None:
    """A TorchScript module keeps its state in C++, where the wrapper cannot record it: wrapping
    one (or a tree holding one) is refused, and so is a plain function that reaches one with
    parameters or buffers, with a TypeError that says to use the eager module instead."""
    says = r"TorchScript module exact .*checkpoint the eager module"
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    with pytest.raises(TypeError, match=says):
        checkpoint_wrapper(scripted)
    with pytest.raises(TypeError, match=says):
        checkpoint_wrapper(nn.Sequential(nn.Linear(3, 3), scripted))
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(TypeError, match=says):
        checkpoint(lambda t: scripted(t), x)
    # The eager module the message points to works.
    checkpoint_wrapper(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))(x).sum().backward()


def test_torch_distributed_attributes() -> None:
    wrapped = checkpoint_wrapper(Block(3), CheckpointImpl.NO_REENTRANT)
    assert wrapped.checkpoint_impl is CheckpointImpl.NO_REENTRANT
    assert isinstance(wrapped._checkpoint_wrapped_module, Block)
    assert wrapped.bn1 is wrapped.wrapped_module.bn1


def linear_bn_model() -> nn.Module:
    """The shape of torch.distributed's own apply_activation_checkpointing test: Linear layers
    at two depths, next to BatchNorm."""

    class LinearWithBatchNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.bn = nn.BatchNorm1d(10)
            self.nested_linear = nn.Sequential(nn.Linear(10, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.nested_linear(self.lin(x)))

    torch.manual_seed(0)
    return nn.Sequential(LinearWithBatchNorm(), nn.BatchNorm1d(10), LinearWithBatchNorm())


def vectors(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(6, 10, generator=gen, requires_grad=True) for _ in range(n)]


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear)


def wrapped_types(model: nn.Module) -> list[str]:
    return sorted(
        type(m.wrapped_module).__name__ for m in model.modules() if isinstance(m, CheckpointWrapper)
    )


@pytest.mark.parametrize(
    ("apply", "expected"),
    [
        pytest.param(
            lambda m: apply_activation_checkpointing(m, check_fn=is_linear),
            ["Linear"] * 4,
            id="check_fn",
        ),
        pytest.param(
            lambda m: apply_activation_checkpointing(
                m, auto_wrap_policy=ModuleWrapPolicy({nn.BatchNorm1d})
            ),
            ["BatchNorm1d"] * 3,
            id="ModuleWrapPolicy",
        ),
        pytest.param(
            lambda m: apply_activation_checkpointing(
                m, auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_linear)
            ),
            ["Linear"] * 4,
            id="lambda_auto_wrap_policy",
        ),
        pytest.param(
            # Each LinearWithBatchNorm holds 2 * 110 + 20 parameters; the BN between them 20.
            lambda m: apply_activation_checkpointing(
                m,
                auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=200),
            ),
            ["LinearWithBatchNorm"] * 2,
            id="size_based_auto_wrap_policy",
        ),
        pytest.param(
            lambda m: apply_activation_checkpointing(
                m, auto_wrap_policy=CustomPolicy(lambda mod: isinstance(mod, nn.Sequential))
            ),
            ["Sequential"] * 2,  # the nested ones; never the root
            id="CustomPolicy",
        ),
        pytest.param(
            lambda m: apply_activation_checkpointing(
                m,
                checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, offload_to_cpu=True),
                check_fn=lambda mod: isinstance(mod, nn.BatchNorm1d),
            ),
            ["BatchNorm1d"] * 3,
            id="partial_wrapper_fn",
        ),
    ],
)
def test_apply_activation_checkpointing_policies(
    apply: Callable[[nn.Module], None], expected: list[str]
) -> None:
    def wrap(model: nn.Module) -> nn.Module:
        apply(model)
        return model

    _, wrapped, _ = check_equivalent(linear_bn_model(), wrap, forward_backward, vectors())
    assert wrapped_types(wrapped) == expected
    assert int(wrapped.state_dict()["1.num_batches_tracked"]) == 3
    apply(wrapped)  # a second application wraps nothing twice
    assert wrapped_types(wrapped) == expected


def test_apply_activation_checkpointing_wraps_as_torch_does() -> None:
    # The same modules, in the same places, as torch.distributed's own function picks.
    for policy in (
        None,
        ModuleWrapPolicy({nn.Linear, nn.Sequential}),
        functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    ):
        ours, theirs = linear_bn_model(), linear_bn_model()
        apply_activation_checkpointing(ours, check_fn=is_linear, auto_wrap_policy=policy)
        torch_wrappers.apply_activation_checkpointing(
            theirs, check_fn=is_linear, auto_wrap_policy=policy
        )
        assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]


def test_state_dicts_load_across_torch_distributed_and_ours() -> None:
    plain = fresh_net()
    forward_backward(plain, images(2, grad=True))
    ours = apply_activation_checkpointing_blocks(fresh_net(), checkpoint_wrapper)
    theirs = apply_activation_checkpointing_blocks(fresh_net(), torch_wrappers.checkpoint_wrapper)
    # torch.distributed's wrapper -> ours, and ours -> theirs, both strict.
    theirs.load_state_dict(plain.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert_same(dict(plain.state_dict()), dict(ours.state_dict()))
    forward_backward(ours, images(1, grad=True))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert_same(dict(ours.state_dict()), dict(theirs.state_dict()))
    # Keys that keep the wrapper's prefix (the raw module tree, as FSDP and older releases of
    # torch write them) load too, strict.
    prefixed = {
        re.sub(r"^blocks\.(\d)\.", r"blocks.\1._checkpoint_wrapped_module.", k): v
        for k, v in plain.state_dict().items()
    }
    assert "blocks.0._checkpoint_wrapped_module.bn1.running_mean" in prefixed
    target = apply_activation_checkpointing_blocks(fresh_net(), checkpoint_wrapper)
    target.load_state_dict(prefixed, strict=True)
    assert_same(dict(plain.state_dict()), dict(target.state_dict()))


def apply_activation_checkpointing_blocks(
    model: nn.Module, wrapper_fn: Callable[..., nn.Module]
) -> nn.Module:
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper_fn, check_fn=lambda m: isinstance(m, Block)
    )
    return model


def test_disable_checkpointing_runs_plainly() -> None:
    calls: list[int] = []

    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return self.bn(x)

    wrapped = checkpoint_wrapper(Counts())
    x = torch.randn(5, 4, requires_grad=True)
    with disable_checkpointing():
        wrapped(x).sum().backward()
    assert len(calls) == 1  # nothing recomputed
    wrapped(x).sum().backward()
    assert len(calls) == 3
    assert int(wrapped.bn.num_batches_tracked) == 2
