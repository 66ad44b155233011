"""Runs the same calls on a model and on its checkpointed twin, and compares them bitwise.

Every comparison is torch.equal: a tolerance would hide a double update of the statistics.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

Scenario = Callable[[nn.Module, Sequence[torch.Tensor]], Any]

WRAPPED = "_checkpoint_wrapped_module."


def unwrapped_name(name: str) -> str:
    return name.replace(WRAPPED, "")


def twin(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """A deep copy of ``model`` passed through ``wrap``."""
    return wrap(copy.deepcopy(model))


def run(model: nn.Module, scenario: Scenario, inputs: Sequence[torch.Tensor], seed: int) -> Any:
    torch.manual_seed(seed)
    fresh = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = scenario(model, fresh)
    return out, [x.grad for x in fresh]


def assert_same(a: Any, b: Any, where: str = "output") -> None:
    """Same structure, same types, bitwise-equal tensors."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape}"
        assert torch.equal(a, b), f"{where}: values differ (max {(a - b).abs().max()})"
    elif isinstance(a, Mapping):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_model(plain: nn.Module, wrapped: nn.Module) -> None:
    """Full state_dict (keys, order, values) and every gradient bitwise equal."""
    assert_same(dict(plain.state_dict()), dict(wrapped.state_dict()), "state_dict")
    grads_plain = {n: p.grad for n, p in plain.named_parameters()}
    grads_wrapped = {unwrapped_name(n): p.grad for n, p in wrapped.named_parameters()}
    assert_same(grads_plain, grads_wrapped, "grad")
    training_plain = [m.training for m in plain.modules()]
    training_wrapped = [
        m.training for m in wrapped.modules() if type(m).__name__ != "CheckpointWrapper"
    ]
    assert training_plain == training_wrapped


def check_equivalent(
    model: nn.Module,
    wrap: Callable[[nn.Module], nn.Module],
    scenario: Scenario,
    inputs: Sequence[torch.Tensor],
    seed: int = 0,
    copy_of_model: nn.Module | None = None,
) -> tuple[nn.Module, nn.Module, Any]:
    """Run ``scenario`` on ``model`` and on its wrapped twin; assert they agree bitwise.

    The twin is a deep copy of ``model``, or ``copy_of_model`` where a deep copy is impossible
    (Lazy modules).
    """
    wrapped = twin(model, wrap) if copy_of_model is None else wrap(copy_of_model)
    expected = run(model, scenario, inputs, seed)
    got = run(wrapped, scenario, inputs, seed)
    assert_same(expected, got)
    assert_same_model(model, wrapped)
    return model, wrapped, expected
